"""Architectures without a hand-written module (``ternary_rs.arch.generic``: transformers' GGUF tables).

End to end, for Phi-3, Gemma 3 and Qwen2 (``generic_arch_models``): a tiny ternary-valued model written to a
TQ2_0 GGUF **by llama.cpp's own converter** (``convert_hf_to_gguf.py --outtype tq2_0``;
``scripts/fetch_llama_cpp_converter.sh`` provides it, skipped without it), ``ternary_rs.convert`` to a
checkpoint, then

* the checkpoint's weights, dequantized, equal the Hugging Face model's (names, fused tensors, Gemma's norm
  offset undone);
* the Hugging Face safetensors source gives the same ternary tensors;
* checkpoint -> GGUF gives llama.cpp's file back, every key and tensor byte (plus our provenance key);
* vLLM (CPU, float32; all three in one runner process, one start) generates transformers' greedy tokens on the
  dense model, with its log-probabilities.

Without the converter or vLLM: the generic arch against the hand-written llama module (names and the q/k
permutation learnt by probing transformers' processor), the probe itself, and the refusals.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ternary_rs
from support.generic_arch_models import ARCHITECTURES, TOKENIZER_PRE, build_generic_model
from support.greedy_reference import check_greedy
from support.llama_cpp import ConvertJob, gguf_contents, reference_convert_many, require_converter

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TESTS = Path(__file__).parent
RUNNER = TESTS / "support" / "vllm_runner.py"
PROMPTS = ["The quick brown fox", "Hello world! This is", "Ternary weights take one of"]
MAX_TOKENS = 8
ENGINE_TIMEOUT_S = 900
OWN_KEYS = ("ternary_rs.version",)
HF_CLASSES = {"phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{arch: (hf_dir, llama.cpp's TQ2_0 GGUF, ternary_rs checkpoint)}; the converter runs once for all."""
    require_converter()
    root = tmp_path_factory.mktemp("generic_arch")
    hf = {a: build_generic_model(root / f"hf-{a}", a) for a in ARCHITECTURES}
    ggufs = reference_convert_many([ConvertJob(hf[a], root / f"{a}-TQ2_0.gguf", "tq2_0", TOKENIZER_PRE[a])
                                    for a in ARCHITECTURES])
    out = {}
    for a, gguf_path in zip(ARCHITECTURES, ggufs):
        out[a] = (hf[a], gguf_path, Path(ternary_rs.convert(gguf_path, root / f"ckpt-{a}", progress=False)))
    return out


def _hf_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    return out


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_gguf_to_checkpoint_holds_the_hf_weights(arch, models, tmp_path):
    hf, gguf_path, ckpt = models[arch]
    _, tensors = gguf_contents(gguf_path)
    linear = [n for n in tensors if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n]
    assert linear and all(tensors[n][0] == "TQ2_0" for n in linear), {n: tensors[n][0] for n in linear}
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == [HF_CLASSES[arch]]
    qc = config["quantization_config"]
    assert qc["group_size"] == 256 and qc["modules_not_converted"] == []
    manifest = json.loads((ckpt / "ternary_rs.json").read_text())
    assert manifest["architecture"] == arch
    for path in (gguf_path, ckpt):  # fused layers (Phi-3) are not shape problems
        report = ternary_rs.verify(path)
        assert report.ok, (path.name, report.problems)

    dense = ternary_rs.dequantize_checkpoint(ckpt, tmp_path / "dense")
    got, want = _hf_tensors(dense), _hf_tensors(hf)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=f"{arch}: {name}")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_safetensors_source_gives_the_same_checkpoint(arch, models, tmp_path):
    from safetensors.numpy import load_file

    hf, _, ckpt = models[arch]
    direct = Path(ternary_rs.convert(hf, tmp_path / "direct", progress=False))
    a, b = (load_file(p / "model-00001-of-00001.safetensors") for p in (direct, ckpt))
    assert sorted(a) == sorted(b)
    packed = [k for k in a if k.endswith((".qweight", ".scales"))]
    assert packed
    for k in packed:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{arch}: {k}")
    for k in set(a) - set(packed):  # float tensors: the same values (dtypes follow each source)
        np.testing.assert_array_equal(a[k].astype(np.float32), b[k].astype(np.float32), err_msg=f"{arch}: {k}")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_checkpoint_back_to_gguf_is_llama_cpps_file(arch, models, tmp_path):
    hf, gguf_path, ckpt = models[arch]
    back = Path(ternary_rs.convert(ckpt, tmp_path / "back.gguf", progress=False))
    meta_o, tens_o = gguf_contents(back)
    meta_r, tens_r = gguf_contents(gguf_path)
    diff = {k for k in set(meta_o) | set(meta_r) if k not in OWN_KEYS and meta_o.get(k) != meta_r.get(k)}
    assert not diff, {k: (str(meta_r.get(k))[:120], str(meta_o.get(k))[:120]) for k in sorted(diff)}
    assert tens_o.keys() == tens_r.keys()
    for name in tens_r:
        assert tens_o[name] == tens_r[name], f"{arch}: {name} differs"
    # Without the source's keys (a Hugging Face directory) the hyper-parameters are not in any table: refused.
    with pytest.raises(ternary_rs.UnsupportedTypeError, match="convert_hf_to_gguf.py"):
        ternary_rs.convert(hf, tmp_path / "from-hf.gguf", progress=False)


@pytest.mark.vllm
def test_vllm_serves_them_like_transformers(models, tmp_path):
    """One runner process serves the three checkpoints in turn; each greedy continuation is transformers'
    argmax on the dense model at every step (or a near tie), with the same top log-probabilities."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(RUNNER), "--model", *(str(models[a][2]) for a in ARCHITECTURES), "--out", str(out),
           "--prompts-json", str(prompts), "--max-tokens", str(MAX_TOKENS), "--dtype", "float32", "--eager"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        pytest.fail(f"vLLM runner failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    runs = json.loads(out.read_text())["runs"]
    for arch, run in zip(ARCHITECTURES, runs):
        assert run["quantization"] == "ternary", arch
        model = AutoModelForCausalLM.from_pretrained(models[arch][0], dtype=torch.float32).eval()
        check_greedy(run["outputs"], model, MAX_TOKENS, every_logprob=True, label=arch)


# ------------------------------------------------------------------------------------------ units
def _llama_metadata(layers=2, heads=4, kv_heads=2, hidden=256) -> dict:
    return {"general.architecture": "llama", "llama.block_count": layers, "llama.embedding_length": hidden,
            "llama.feed_forward_length": 512, "llama.attention.head_count": heads,
            "llama.attention.head_count_kv": kv_heads, "llama.context_length": 512,
            "llama.rope.dimension_count": hidden // heads, "llama.attention.layer_norm_rms_epsilon": 1e-6,
            "llama.vocab_size": 320}


def test_generic_path_reproduces_the_llama_module():
    """The hand-written llama module and transformers' tables (names; the q/k permutation, learnt by probing
    transformers' LlamaTensorProcessor) agree, tensor by tensor."""
    from ternary_rs.arch import ARCHES
    from ternary_rs.arch.generic import for_gguf

    md = _llama_metadata()
    hand = ARCHES["llama"]
    names = [hand.gguf_name(hf, 2) for hf in (
        ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        + [t.format(bid=b) for b in range(2) for t in hand.hf_block_names if not t.endswith(".bias")])]
    generic = for_gguf("llama", md, names)
    assert generic.hf_architectures == ("LlamaForCausalLM",)
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2}
    for g in names:
        hf = hand.hf_name(g, 2)
        assert generic.hf_name(g, 2) == hf
        assert generic.gguf_name(hf, 2) == g
        rows = 256 if "k_proj" not in hf and "v_proj" not in hf else 128
        if hf.endswith("_proj.weight"):
            want, got = hand.rows_from_gguf(hf, cfg, rows), generic.rows_from_gguf(hf, cfg, rows)
            assert (want is None and got is None) or np.array_equal(want, got), hf
    assert generic.rows_from_gguf("model.layers.0.self_attn.q_proj.weight", cfg, 256) is not None


def test_probe_tells_what_a_processor_does():
    from ternary_rs.arch.generic import AFFINE, OTHER, ROWS, SAME, _probe_effect

    def run(processor_cls, config, name, shape):
        proc = processor_cls(config=config)

        def process(values, n):
            r = proc.process(weights=values, name=n, tensor_key_mapping={}, parsed_parameters={"tensors": {}})
            return r.weights, r.name

        return _probe_effect(process, name, shape)

    from transformers.modeling_gguf_pytorch_utils import (
        BloomTensorProcessor,
        Gemma2TensorProcessor,
        GPT2TensorProcessor,
        TensorProcessor,
    )

    assert run(TensorProcessor, {}, "blk.0.attn_q.weight", (8, 256))[0] == SAME
    kind, (a, b) = run(Gemma2TensorProcessor, {}, "blk.0.attn_norm.weight", (256,))
    assert (kind, a, b) == (AFFINE, 1.0, -1.0)
    kind, perm = run(BloomTensorProcessor, {"n_head": 2, "hidden_size": 8}, "blk.0.attn_qkv.weight", (24, 8))
    assert kind == ROWS and sorted(perm.tolist()) == list(range(24)) and perm.tolist() != list(range(24))
    assert run(GPT2TensorProcessor, {}, "blk.0.attn_qkv.weight", (24, 8))[0] == OTHER  # a transpose


def test_a_ternary_tensor_whose_values_the_tables_change_is_refused():
    from ternary_rs.arch.generic import for_gguf

    md = {"general.architecture": "gemma3", "gemma3.block_count": 1, "gemma3.embedding_length": 256,
          "gemma3.feed_forward_length": 512, "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 2,
          "gemma3.attention.key_length": 64, "gemma3.context_length": 512}
    arch = for_gguf("gemma3", md, ["token_embd.weight", "blk.0.attn_norm.weight"])
    assert arch.hf_name("blk.0.attn_norm.weight", 1) == "model.layers.0.input_layernorm.weight"
    # A float norm is offset back (values_from_gguf); the same change on a packed ternary tensor is refused.
    raw = np.full(256, 1.5, np.float32).view(np.uint8)
    got = arch.values_from_gguf("model.layers.0.input_layernorm.weight", raw, "F32", (256,))
    np.testing.assert_array_equal(np.asarray(got).view(np.float32), np.full(256, 0.5, np.float32))
    with pytest.raises(ternary_rs.UnsupportedTypeError, match="attn_norm.*re-ternarizing"):
        arch.rows_from_gguf("model.layers.0.input_layernorm.weight", {}, 256)
    assert arch.ternary_candidate("model.layers.0.mlp.down_proj.weight", (256, 512))
    assert not arch.ternary_candidate("model.embed_tokens.weight", (320, 256))


def test_what_the_tables_do_not_describe_is_refused_by_name():
    from ternary_rs.arch import ARCHES, arch_for_config, arch_for_gguf

    with pytest.raises(ternary_rs.UnsupportedTypeError, match=r"'gpt_neox'.*(?s:.*)phi3.*hand-written"):
        arch_for_gguf("gpt_neox", {"general.architecture": "gpt_neox"}, [])
    with pytest.raises(ternary_rs.UnsupportedTypeError, match=r"'bert'.*(?s:.*)gemma3_text"):
        arch_for_config({"model_type": "bert"})
    with pytest.raises(ternary_rs.UnsupportedTypeError, match="experts"):
        arch_for_gguf("gpt-oss", {"general.architecture": "gpt-oss", "gpt-oss.block_count": 1},
                      ["blk.0.ffn_up_exps.weight"])
    # qwen2moe has its module (routed experts + shared expert), not the generic path
    assert arch_for_gguf("qwen2moe", {"general.architecture": "qwen2moe", "qwen2moe.block_count": 1},
                         ["blk.0.ffn_up_exps.weight"]) is ARCHES["qwen2moe"]
    # Mistral: llama.cpp writes it as llama, so the hand-written module (GGUF output included) handles it.
    assert arch_for_config({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}) is ARCHES["llama"]
    assert arch_for_config({"model_type": "phi3"}).hf_architectures == ("Phi3ForCausalLM",)
