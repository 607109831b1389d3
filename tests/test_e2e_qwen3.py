"""End to end on the tiny ternarized Qwen3 / Llama of tests/support/models.py.

HF dir -> vLLM dir, HF dir -> GGUF (TQ2_0, TQ1_0, PQ2_0, PTQ1_0) -> vLLM dir; references: the HF
weights themselves, ``tests/support/contract_writer.py`` (independent writer), gguf-py (``GGUFReader``,
``gguf.quants.dequantize``), transformers (logits, its GGUF config/tokenizer loading) and llama.cpp's
``LlamaModel.permute`` (copied in test_convert_units.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import ternary_rs
from support import contract_writer as cw
from support.models import SENTENCES, build_tiny_model
from test_convert_units import llama_cpp_permute

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_tensors(d: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _vllm_tensors(d: Path) -> dict[str, np.ndarray]:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(d / shard))
    assert set(out) == set(index["weight_map"])
    return out


def _assert_same_checkpoint(a: dict, b: dict) -> None:
    """Identical ternary tensors; other tensors equal in value (a GGUF keeps norms in F32)."""
    assert set(a) == set(b)
    for name in a:
        if name.endswith((".qweight", ".scales")) or a[name].ndim > 1:
            assert a[name].dtype == b[name].dtype, name
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        else:
            np.testing.assert_array_equal(a[name].astype(np.float32), b[name].astype(np.float32), err_msg=name)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    built = {}
    for name, arch, g in (("qwen3-g128", "qwen3", 128), ("qwen3-g256", "qwen3", 256), ("llama-g256", "llama", 256)):
        d = root / name
        built[name] = (d, build_tiny_model(d, arch=arch, group_size=g))
    return root, built


def _logits(model_dir_or_model, ids):
    if isinstance(model_dir_or_model, (str, Path)):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir_or_model, dtype=torch.float32)
    else:
        model = model_dir_or_model
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_hf_to_vllm_matches_independent_writer_and_original_weights(models):
    root, built = models
    src, _ = built["qwen3-g128"]
    out = root / "qwen3-g128-vllm"
    ternary_rs.convert(src, out, progress=False, shard_size="100KB")
    ref = cw.write_contract(src, root / "qwen3-g128-contract", group_size=128)
    qc_ours, ours = cw.read_contract(out)
    qc_ref, theirs = cw.read_contract(ref)
    assert qc_ours == qc_ref
    assert set(ours) == set(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype, name
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    # several shards (100 KB limit) with a consistent index
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    # dequantized weights are the ternarized originals
    hf = _hf_tensors(src)
    for name, w in hf.items():
        if name.endswith(cw.DEFAULT_TERNARY_SUFFIXES):
            prefix = name[: -len(".weight")]
            deq = cw.dequantize(ours[prefix + ".qweight"], ours[prefix + ".scales"], 128)
            np.testing.assert_array_equal(deq, w.astype(np.float32), err_msg=name)
    for fname in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "ternary_rs.json"):
        assert (out / fname).is_file(), fname
    manifest = json.loads((out / "ternary_rs.json").read_text())
    assert {s["path"] for s in manifest["sources"]} >= {str((src / "model.safetensors").absolute())}
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} - {"ternary_rs.json"}
    assert ternary_rs.verify(out).ok


@pytest.mark.parametrize("gguf_type, model", [("TQ2_0", "qwen3-g256"), ("TQ1_0", "qwen3-g256"),
                                               ("PQ2_0", "qwen3-g128"), ("PTQ1_0", "qwen3-g128")])
def test_gguf_roundtrip_identical(models, gguf_type, model):
    root, built = models
    src, _ = built[model]
    g = 256 if model.endswith("g256") else 128
    gguf_path = root / f"{model}-{gguf_type}.gguf"
    ternary_rs.convert(src, gguf_path, to="gguf", gguf_type=gguf_type, progress=False)

    # names and types, read by an independent reader (transformers' metadata reader knows any type id)
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, names = read_gguf_metadata(str(gguf_path), ("tokenizer.ggml.tokens",))
    assert metadata["general.architecture"] == "qwen3"
    arch = ternary_rs.arch.ARCHES["qwen3"]
    hf = _hf_tensors(src)
    assert set(names) == {arch.gguf_name(n, 2) for n in hf}
    assert metadata["tokenizer.ggml.tokens"] == [t for t, _ in sorted(
        transformers.AutoTokenizer.from_pretrained(src).get_vocab().items(), key=lambda kv: kv[1])]

    if gguf_type.startswith("TQ"):
        import gguf

        reader = gguf.GGUFReader(gguf_path)
        by_name = {t.name: t for t in reader.tensors}
        for name, w in hf.items():
            t = by_name[arch.gguf_name(name, 2)]
            if name.endswith(cw.DEFAULT_TERNARY_SUFFIXES):
                assert t.tensor_type == getattr(gguf.GGMLQuantizationType, gguf_type)
                deq = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
                np.testing.assert_array_equal(deq, w.astype(np.float32), err_msg=name)
            else:  # norms: F32, as llama.cpp's converter writes them
                assert t.tensor_type == gguf.GGMLQuantizationType.F32
                np.testing.assert_array_equal(np.asarray(t.data).reshape(w.shape), w.astype(np.float32), err_msg=name)

    direct = root / f"{model}-direct"
    if not direct.exists():
        ternary_rs.convert(src, direct, progress=False, group_size=g)
    via = root / f"{model}-{gguf_type}-vllm"
    ternary_rs.convert(gguf_path, via, progress=False)
    _assert_same_checkpoint(_vllm_tensors(direct), _vllm_tensors(via))
    cfg_direct = json.loads((direct / "config.json").read_text())
    cfg_via = json.loads((via / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
                "max_position_embeddings", "eos_token_id", "quantization_config", "architectures", "model_type"):
        assert cfg_via[key] == cfg_direct[key], key
    tok_src = transformers.AutoTokenizer.from_pretrained(src)
    tok_via = transformers.AutoTokenizer.from_pretrained(via)
    for s in SENTENCES[:3]:
        assert tok_via(s)["input_ids"] == tok_src(s)["input_ids"]
    assert ternary_rs.verify(via).ok


def test_dequantized_checkpoint_gives_original_logits(models):
    root, built = models
    src, model = built["qwen3-g128"]
    gguf_path = root / "qwen3-g128-PQ2_0.gguf"
    if not gguf_path.exists():
        ternary_rs.convert(src, gguf_path, to="gguf", gguf_type="PQ2_0", progress=False)
    via = root / "qwen3-logits-vllm"
    ternary_rs.convert(gguf_path, via, progress=False)
    dense = ternary_rs.dequantize_checkpoint(via, root / "qwen3-logits-dense")
    tok = transformers.AutoTokenizer.from_pretrained(src)
    ids = tok(SENTENCES[1])["input_ids"]
    # the original model as stored (fp16 checkpoint: norms were rounded to fp16), computed in float32
    np.testing.assert_allclose(_logits(dense, ids), _logits(src, ids), rtol=1e-5, atol=1e-5)
    # and the in-memory model differs from it only by that norm rounding
    np.testing.assert_allclose(_logits(dense, ids), _logits(model, ids), atol=1e-2)


def test_transformers_reads_our_gguf_config_and_tokenizer(models):
    root, built = models
    src, _ = built["qwen3-g256"]
    gguf_path = root / "tx-qwen3-TQ2_0.gguf"
    ternary_rs.convert(src, gguf_path, to="gguf", gguf_type="TQ2_0", progress=False)
    cfg = transformers.AutoConfig.from_pretrained(root, gguf_file=gguf_path.name)
    orig = transformers.AutoConfig.from_pretrained(src)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "model_type"):
        assert getattr(cfg, key) == getattr(orig, key), key
    assert np.float32(cfg.rms_norm_eps) == np.float32(orig.rms_norm_eps)  # GGUF holds f32
    # transformers' qwen3 GGUF mapping ignores attention.key_length (head_dim), so check the key itself.
    from transformers.integrations.gguf import read_gguf_metadata

    md, _ = read_gguf_metadata(str(gguf_path))
    assert md["qwen3.attention.key_length"] == orig.head_dim == 64
    assert md["qwen3.rope.freq_base"] == pytest.approx(orig.rope_parameters["rope_theta"])
    tok = transformers.AutoTokenizer.from_pretrained(root, gguf_file=gguf_path.name)
    tok_src = transformers.AutoTokenizer.from_pretrained(src)
    for s in SENTENCES:
        assert tok(s)["input_ids"] == tok_src(s)["input_ids"], s
    assert tok.eos_token == tok_src.eos_token and tok.pad_token == tok_src.pad_token
    _assert_converter_tokenizer_is_autotokenizers(gguf_path)


def _assert_converter_tokenizer_is_autotokenizers(gguf_path: Path) -> None:
    """convert builds the tokenizer without AutoTokenizer's slow config step: same result."""
    from ternary_rs.sources.hf_gguf import _transformers_gguf_tokenizer

    md = ternary_rs.open(gguf_path).metadata
    ours = _transformers_gguf_tokenizer(gguf_path, md)
    auto = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_tokens == auto.all_special_tokens
    for s in SENTENCES:
        assert ours(s)["input_ids"] == auto(s)["input_ids"]


def test_llama_permutation_round_trip(models):
    import gguf

    root, built = models
    src, model = built["llama-g256"]
    gguf_path = root / "llama-TQ2_0.gguf"
    ternary_rs.convert(src, gguf_path, to="gguf", gguf_type="TQ2_0", progress=False)
    reader = gguf.GGUFReader(gguf_path)
    by_name = {t.name: t for t in reader.tensors}
    hf = _hf_tensors(src)
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    q = hf["model.layers.0.self_attn.q_proj.weight"].astype(np.float32)
    k = hf["model.layers.1.self_attn.k_proj.weight"].astype(np.float32)
    gq = gguf.quants.dequantize(by_name["blk.0.attn_q.weight"].data, gguf.GGMLQuantizationType.TQ2_0).reshape(q.shape)
    gk = gguf.quants.dequantize(by_name["blk.1.attn_k.weight"].data, gguf.GGMLQuantizationType.TQ2_0).reshape(k.shape)
    np.testing.assert_array_equal(gq, llama_cpp_permute(q, heads, heads))
    np.testing.assert_array_equal(gk, llama_cpp_permute(k, heads, kv))
    _assert_converter_tokenizer_is_autotokenizers(gguf_path)
    md = {f.name: f for f in reader.fields.values()}
    assert "llama.rope.dimension_count" in md and "llama.vocab_size" in md
    direct, via = root / "llama-direct", root / "llama-via"
    ternary_rs.convert(src, direct, progress=False)
    ternary_rs.convert(gguf_path, via, progress=False)
    _assert_same_checkpoint(_vllm_tensors(direct), _vllm_tensors(via))
    dense = ternary_rs.dequantize_checkpoint(via, root / "llama-dense")
    ids = transformers.AutoTokenizer.from_pretrained(src)(SENTENCES[0])["input_ids"]
    np.testing.assert_allclose(_logits(dense, ids), _logits(src, ids), rtol=1e-5, atol=1e-5)
