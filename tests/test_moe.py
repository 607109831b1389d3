"""Ternary Mixture-of-Experts end to end: a tiny ``Qwen3MoeForCausalLM`` (transformers, 8 experts, top-2, every
linear — experts included — exactly ternary with one scale per 256 values) written as a ``qwen3moe`` TQ2_0
GGUF the way llama.cpp writes it (3-D ``ffn_{gate,up,down}_exps``, F32 router ``ffn_gate_inp``), converted by
``ternary_rs.convert`` (one ``qweight``/``scales`` pair per expert), then served by vLLM CPU through the
plugin's ``TernaryMoEMethod``: at TP=1 with torch.compile and at TP=2 with ``--enforce-eager`` (the TP=2
down_proj K shard, 128, splits the checkpoint's 256-groups: served at group 128).

The GGUF comes from llama.cpp's own ``convert_hf_to_gguf.py`` when ``tests/support/llama_cpp.py`` finds it
(``scripts/fetch_llama_cpp_converter.sh``, ``LLAMA_CPP_CONVERT_DIR`` or ``LLAMA_CPP_BIN``), otherwise from
``moe_model.write_qwen3moe_gguf`` (pip gguf; the same keys, tensors and bytes: checked against the reference
converter whenever it is there).

Numerics: vLLM serves in float32, where the op's exact mode makes every expert's output a float32 sum like
transformers'; tokens must be transformers' greedy choice (a different one only at a reference gap below
``TIE_GAP``) and logprobs within ``LOGPROB_ATOL`` (``greedy_reference``), as ``test_vllm.py`` checks dense models. (In bfloat16
vLLM's own dense MoE leaves transformers' greedy path at the same near-ties as the ternary one: gaps of
0.025 logit std on this model.) One vLLM process per TP size, both started at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import ternary_rs
from support.greedy_reference import check_greedy
from support.moe_model import build_tiny_moe, write_qwen3moe_gguf

TESTS = Path(__file__).parent
RUNNER = TESTS / "support" / "vllm_runner.py"
PROMPTS = ["The quick brown fox", "Hello world! This is", "Ternary weights take one of", "A scale per group"]
MAX_TOKENS = 8
ENGINE_TIMEOUT_S = 600
EXPERTS, TOP_K = 8, 2


def _reference_converter() -> Path | None:
    from support import llama_cpp
    d = llama_cpp.convert_dir()
    return d if d is not None and (d / "convert_hf_to_gguf.py").is_file() else None


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    tiny = build_tiny_moe(root / "hf", experts=EXPERTS, top_k=TOP_K)
    if _reference_converter() is not None:
        from support import llama_cpp
        src = llama_cpp.reference_convert(tiny.hf_dir, root / "tiny-TQ2_0.gguf", "tq2_0", tokenizer_pre="qwen2")
        writer = "llama.cpp convert_hf_to_gguf.py"
    else:
        src = write_qwen3moe_gguf(tiny.hf_dir, root / "tiny-TQ2_0.gguf")
        writer = "gguf-py (write_qwen3moe_gguf)"
    ckpt = ternary_rs.convert(src, root / "vllm", progress=False)
    return SimpleNamespace(root=root, tiny=tiny, gguf=src, writer=writer, ckpt=Path(ckpt))


def hf_weights(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(hf_dir / "model.safetensors").items()}


# ---------------------------------------------------------------------------------------------------
# GGUF and conversion
# ---------------------------------------------------------------------------------------------------
def test_gguf_holds_stacked_ternary_experts(moe):
    cfg = moe.tiny.config
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    with ternary_rs.open(moe.gguf) as f:
        t = f.tensors
        assert t["blk.0.ffn_gate_exps.weight"].type == "TQ2_0", moe.writer
        assert tuple(t["blk.0.ffn_gate_exps.weight"].shape) == (EXPERTS, inter, hidden)
        assert tuple(t["blk.1.ffn_up_exps.weight"].shape) == (EXPERTS, inter, hidden)
        assert tuple(t["blk.1.ffn_down_exps.weight"].shape) == (EXPERTS, hidden, inter)
        router = t["blk.0.ffn_gate_inp.weight"]
        assert (router.type, tuple(router.shape)) == ("F32", (EXPERTS, hidden))
        md = f.metadata
        assert (md["qwen3moe.expert_count"], md["qwen3moe.expert_used_count"]) == (EXPERTS, TOP_K)
        assert md["qwen3moe.expert_feed_forward_length"] == inter


def test_fallback_writer_is_llama_cpps(moe, tmp_path):
    """The gguf-py writer used without llama.cpp writes what llama.cpp's converter writes: same keys and
    values, same tensors (names, types, shapes, bytes)."""
    if _reference_converter() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py not available (LLAMA_CPP_CONVERT_DIR / LLAMA_CPP_BIN)")
    import gguf

    assert moe.writer.startswith("llama.cpp")  # the fixture's GGUF is the reference converter's
    ours = write_qwen3moe_gguf(moe.tiny.hf_dir, tmp_path / "ours.gguf")
    a, b = gguf.GGUFReader(str(moe.gguf)), gguf.GGUFReader(str(ours))
    assert list(a.fields) == list(b.fields)
    for key, field in a.fields.items():
        assert field.types == b.fields[key].types and field.contents() == b.fields[key].contents(), key
    assert [(t.name, t.tensor_type, list(t.shape)) for t in a.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)), x.name


def test_convert_splits_every_expert_exactly(moe):
    """Each expert of each stacked tensor becomes its own qweight/scales pair, equal to transformers' weight;
    the router stays dense; config.json says what vLLM's Qwen3-MoE needs; verify passes."""
    cfg = json.loads((moe.ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    assert (cfg["num_experts"], cfg["num_experts_per_tok"]) == (EXPERTS, TOP_K)
    assert cfg["moe_intermediate_size"] == moe.tiny.config["moe_intermediate_size"]
    assert cfg["norm_topk_prob"] is True and cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == []
    assert cfg["quantization_config"]["group_size"] == 256
    src = hf_weights(moe.tiny.hf_dir)
    with ternary_rs.open(moe.ckpt) as f:
        names = set(f.tensors)
        assert not [n for n in names if ".experts.gate_proj" in n or "_exps" in n]  # nothing left stacked
        for layer in range(moe.tiny.config["num_hidden_layers"]):
            for e in range(EXPERTS):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    p = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                    assert f.tensors[f"{p}.qweight"].type == "U8", p
                    got = ternary_rs.decode(f, p).dequantize("float32")
                    np.testing.assert_array_equal(got, src[f"{p}.weight"], err_msg=p)
            router = f"model.layers.{layer}.mlp.gate.weight"
            assert f.tensors[router].type == "F32"
            np.testing.assert_array_equal(np.asarray(f.raw(router)).view(np.float32).reshape(EXPERTS, -1), src[router])
    report = ternary_rs.verify(moe.ckpt)
    assert report, report


def test_gguf_output_of_moe_refused(moe, tmp_path):
    for source in (moe.gguf, moe.ckpt):
        with pytest.raises(ternary_rs.UnsupportedTypeError, match="Mixture-of-Experts.*not supported"):
            ternary_rs.convert(source, tmp_path / "out.gguf", progress=False)
        assert not (tmp_path / "out.gguf").exists()


# ---------------------------------------------------------------------------------------------------
# the op and the quant config (no vLLM start)
# ---------------------------------------------------------------------------------------------------
def _random_experts(torch, n_expert, hidden, inter, g, seed=0):
    from ternary_rs.serving import ops

    gen = torch.Generator().manual_seed(seed)
    dense, prepared = {"w13": [], "w2": []}, {"w13": [], "w2": []}
    for _ in range(n_expert):
        for stem, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
            t = torch.randint(-1, 2, (n, k), generator=gen).numpy().astype(np.int8)
            s = (torch.rand(n, k // g, generator=gen) * 0.1 + 0.01).half().numpy()
            tt = ternary_rs.TernaryTensor(ternary_rs.pack_codes(t), s, g)
            dense[stem].append(torch.from_numpy(tt.dequantize("float32")).double())
            prepared[stem].append(ops.prepare_weight(torch.from_numpy(tt.qweight.copy()),
                                                     torch.from_numpy(tt.scales.copy()), g))
    stacked = [torch.stack([p[i] for p in prepared[stem]]) for stem in ("w13", "w2") for i in (0, 1)]
    return dense, stacked


def test_moe_op_matches_dense_experts():
    """``ternary_rs::ternary_moe`` equals the dense per-token sum over the routed experts (float64 reference):
    float32 exactly up to f32 rounding, bfloat16 within the int8-activation error; it traces under
    ``torch.compile(fullgraph=True)``; experts without tokens are skipped; router weights may scale the input."""
    import torch
    import torch.nn.functional as F

    from ternary_rs.serving import ops  # noqa: F401  (registers the op)

    n_expert, hidden, inter, g, m, k = 6, 256, 128, 128, 9, 2
    dense, (w13q, w13s, w2q, w2s) = _random_experts(torch, n_expert, hidden, inter, g)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, hidden, generator=gen)
    probs = torch.randn(m, n_expert, generator=gen).softmax(-1)
    probs[:, 5] = 0  # expert 5 never routed
    weights, ids = torch.topk(probs, k)
    weights, ids = weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)

    def reference(x, weights, ids, on_input=False):
        y = torch.zeros(x.shape[0], hidden, dtype=torch.float64)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e, w = int(ids[t, j]), float(weights[t, j])
                xt = x[t].double() * (w if on_input else 1.0)
                h = xt @ dense["w13"][e].T
                out = (F.silu(h[:inter]) * h[inter:]) @ dense["w2"][e].T
                y[t] += out if on_input else w * out
        return y

    def moe_op(x, weights, ids, act, on_input=False):
        return torch.ops.ternary_rs.ternary_moe(x, weights, ids, w13q, w13s, w2q, w2s, inter, g, g, act, on_input)

    ref = reference(x, weights, ids)
    scale = float(ref.abs().max())
    y32 = moe_op(x, weights, ids, ops.EXACT)
    assert y32.dtype == torch.float32 and y32.shape == (m, hidden)
    assert float((y32.double() - ref).abs().max()) < 1e-5 * scale
    ybf = moe_op(x.bfloat16(), weights, ids, ops.AUTO)
    assert ybf.dtype == torch.bfloat16 and float((ybf.double() - ref).abs().max()) < 5e-2 * scale
    compiled = torch.compile(lambda x, w, i: moe_op(x, w, i, ops.EXACT), fullgraph=True)
    assert float((compiled(x, weights, ids).double() - ref).abs().max()) < 1e-5 * scale
    top1_w, top1_i = weights[:, :1], ids[:, :1]
    on_input = moe_op(x, top1_w, top1_i, ops.EXACT, True)
    assert float((on_input.double() - reference(x, top1_w, top1_i, True)).abs().max()) < 1e-5 * scale
    assert moe_op(x[:0], weights[:0], ids[:0], ops.EXACT).shape == (0, hidden)


def test_native_moe_kernel_matches_the_python_composition():
    """The native CPU kernel (one call per layer: pairs sorted by expert, activations quantized once, the
    experts with few tokens in one parallel region) gives what the per-expert ``ternary_linear`` composition of
    ``_ops_moe`` gives: bit for bit at decode and nearly everywhere at prefill (its token sums run in slot
    order, the composition's in expert order) in the int8 modes, within float32 rounding in the exact one,
    and with the weight on the input;
    bad routing is refused, naming the token and slot."""
    import torch

    from ternary_rs.serving import _ops_cpu, _ops_moe, ops

    assert ops.NATIVE_MOE_UNAVAILABLE is None, ops.NATIVE_MOE_UNAVAILABLE
    n_expert, hidden, inter, g = 8, 512, 256, 128
    _, (w13q, w13s, w2q, w2s) = _random_experts(torch, n_expert, hidden, inter, g, seed=3)
    gen = torch.Generator().manual_seed(4)
    for m, k, on_input in ((1, 2, False), (3, 2, False), (24, 2, False), (7, 1, True)):
        x = torch.randn(m, hidden, generator=gen)
        weights, ids = torch.rand(m, n_expert, generator=gen).softmax(-1).topk(k)
        ids = ids.to(torch.int32)
        for dtype, act in ((torch.bfloat16, ops.AUTO), (torch.float32, ops.EXACT), (torch.float16, ops.INT8_TOKEN)):
            args = (x.to(dtype), weights, ids, w13q, w13s, w2q, w2s, inter, g, g, act, on_input)
            native, composed = torch.ops.ternary_rs.ternary_moe(*args), _ops_moe.ternary_moe(*args)
            assert native.dtype == dtype and native.shape == (m, hidden)
            scale = float(composed.float().abs().max())
            if dtype == torch.float32:  # SiLU's exp differs from torch's in the last bit or so
                assert float((native - composed).abs().max()) <= 1e-5 * scale, m
                continue
            assert float((native.float() - composed.float()).abs().max()) <= 1e-2 * scale, (m, dtype)
            same = float((native == composed).float().mean())
            assert same == 1.0 if m < 4 else same > 0.97, (m, dtype, same)
            int64_ids = torch.ops.ternary_rs.ternary_moe(*args[:2], ids.long(), *args[3:])
            assert torch.equal(int64_ids, native)
    with _ops_cpu.warm_up_pass():  # vLLM's discarded warm-up forward: zeros, no products
        skipped = torch.ops.ternary_rs.ternary_moe(*args)
        assert skipped.shape == native.shape and skipped.dtype == native.dtype and not skipped.any()
    assert torch.equal(torch.ops.ternary_rs.ternary_moe(*args), native)
    bad = ids.clone()
    bad[2, 0] = n_expert
    with pytest.raises(RuntimeError, match=rf"expert id {n_expert} \(token 2, slot 0\) is outside \[0, {n_expert}\)"):
        torch.ops.ternary_rs.ternary_moe(x, weights, bad, w13q, w13s, w2q, w2s, inter, g, g, 0, True)
    with pytest.raises(RuntimeError, match="w2_qweight must be the experts' prepared weights"):
        torch.ops.ternary_rs.ternary_moe(x, weights, ids, w13q, w13s, w2q[:, 1:], w2s, inter, g, g, 0, True)


def test_config_serves_experts_all_ternary_or_all_dense():
    pytest.importorskip("vllm")
    from ternary_rs.vllm.config import TernaryConfig

    layer = SimpleNamespace(ckpt_gate_proj_name="gate_proj", ckpt_up_proj_name="up_proj",
                            ckpt_down_proj_name="down_proj", moe_config=SimpleNamespace(num_logical_experts=2))
    prefix = "model.layers.0.mlp.experts"
    parts = {f"{prefix}.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    qc = TernaryConfig(group_size=256)
    qc.ternary_prefixes = set(parts)
    assert qc._experts_are_ternary(prefix, layer) is True
    qc.ternary_prefixes, qc.dense_prefixes = {"other.q_proj"}, set(parts)
    assert qc._experts_are_ternary(prefix, layer) is False
    qc.ternary_prefixes, qc.dense_prefixes = parts - {f"{prefix}.1.up_proj"}, {f"{prefix}.1.up_proj"}
    with pytest.raises(ValueError, match="mixes ternary experts"):
        qc._experts_are_ternary(prefix, layer)
    qc.ternary_prefixes, qc.dense_prefixes = parts - {f"{prefix}.1.down_proj"}, set()
    with pytest.raises(ValueError, match=r"has no tensors for \['model.layers.0.mlp.experts.1.down_proj'\]"):
        qc._experts_are_ternary(prefix, layer)


def test_moe_method_refuses_what_it_cannot_serve():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from ternary_rs.vllm.moe import refuse_unsupported

    def moe_config(**kw):
        base = dict(moe_parallel_config=SimpleNamespace(use_ep=False), has_bias=False, activation=MoEActivation.SILU)
        return SimpleNamespace(**{**base, **kw})

    refuse_unsupported("p", moe_config())
    with pytest.raises(NotImplementedError, match="'p': expert parallelism is not supported"):
        refuse_unsupported("p", moe_config(moe_parallel_config=SimpleNamespace(use_ep=True)))
    with pytest.raises(NotImplementedError, match="biases"):
        refuse_unsupported("p", moe_config(has_bias=True))
    with pytest.raises(NotImplementedError, match="activation 'gelu'"):
        refuse_unsupported("p", moe_config(activation=MoEActivation.GELU))


def test_moe_method_names_the_expert_with_invalid_values():
    """Code 3 or a NaN scale in a loaded expert is refused naming the layer, the expert and the projection."""
    pytest.importorskip("vllm")
    import torch

    from ternary_rs.vllm.config import TernaryConfig
    from ternary_rs.vllm.moe import TernaryMoEMethod

    method = TernaryMoEMethod.__new__(TernaryMoEMethod)  # only the checks, no vLLM layer around it
    method.quant_config, method.prefix = TernaryConfig(group_size=256), "model.layers.3.mlp.experts"
    layer = SimpleNamespace(ckpt_gate_proj_name="gate_proj", ckpt_up_proj_name="up_proj",
                            ckpt_down_proj_name="down_proj")
    q = torch.full((4, 8, 64), 0x55, dtype=torch.uint8)  # all code 1 (zero)
    sc = torch.ones(4, 8, 1, dtype=torch.float16)
    method._validate(layer, "w13", "gate_proj/up_proj", q, sc)
    q[2, 5, 7] = 0x57  # code 3 in expert 2
    with pytest.raises(ValueError, match=r"'model.layers.3.mlp.experts expert 2 \(gate_proj/up_proj\)'.*code 3"):
        method._validate(layer, "w13", "gate_proj/up_proj", q, sc)
    q[2, 5, 7] = 0x55
    sc[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"expert 1 \(down_proj\)'.*NaN/Inf"):
        method._validate(layer, "w2", "down_proj", q, sc)


# ---------------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------------
def start_engine(moe, name: str, *extra: str):
    """Start the vLLM runner on the checkpoint (float32, weight dump); output goes to files, not pipes."""
    tmp = moe.root / name
    tmp.mkdir()
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out, dump_dir, log = tmp / "result.json", tmp / "weights", tmp / "runner.log"
    cmd = [sys.executable, str(RUNNER), "--model", str(moe.ckpt), "--out", str(out), "--prompts-json", str(prompts),
           "--max-tokens", str(MAX_TOKENS), "--dtype", "float32", "--dump-weights", str(dump_dir), *extra]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, out, dump_dir, log


@pytest.fixture(scope="module")
def engines(moe):
    """TP=1 with torch.compile and TP=2 with --enforce-eager, started together: most of a start is waiting
    (imports, worker spawn, distributed set-up), so two overlapping starts take ~2 min on 2 cores where two
    in a row take ~3.5."""
    pytest.importorskip("vllm")
    runs = {"tp1": start_engine(moe, "tp1", "--tp", "1"), "tp2": start_engine(moe, "tp2", "--tp", "2", "--eager")}
    results = {}
    try:
        for name, (proc, out, dump_dir, log) in runs.items():
            rc = proc.wait(timeout=ENGINE_TIMEOUT_S)
            if rc != 0:
                pytest.fail(f"vLLM runner ({name}) failed ({rc}):\n{log.read_text(errors='replace')[-8000:]}")
            results[name] = (json.loads(out.read_text()), dump_dir)
    finally:
        for proc, *_ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.fixture(scope="module")
def tp1_compiled(engines):
    return engines["tp1"]


@pytest.fixture(scope="module")
def tp2_eager(engines):
    return engines["tp2"]


def check_experts(result: dict, dump_dir: Path, moe, tp: int) -> None:
    """Every rank serves the ternary MoE method, and holds exactly its slice of every expert: the rows of
    gate and up for its part of the intermediate size (w13), the same columns of down (w2)."""
    src = hf_weights(moe.tiny.hf_dir)
    layers, inter = moe.tiny.config["num_hidden_layers"], moe.tiny.config["moe_intermediate_size"]
    n_expert = moe.tiny.config.get("num_experts") or moe.tiny.config["num_local_experts"]
    part = inter // tp
    assert sorted(w["rank"] for w in result["workers"]) == list(range(tp))
    for worker in result["workers"]:
        rank, methods = worker["rank"], worker["methods"]
        experts = sorted(n for n, m in methods.items() if m == "TernaryMoEMethod")
        assert len(experts) == layers, methods
        # The router stays dense: vLLM's own method (models that build it without the quant config) or the
        # plugin's dense one.
        dense = ("UnquantizedLinearMethod", "DenseLinearMethod")
        assert all(methods[n] in dense for n in methods if n.endswith("mlp.gate")), methods
        got = np.load(dump_dir / f"rank{rank}.npz")
        for layer, name in enumerate(experts):
            assert name.startswith(f"model.layers.{layer}.mlp.experts"), name
            p = f"model.layers.{layer}.mlp.experts"
            rows = slice(rank * part, (rank + 1) * part)
            w13 = np.stack([np.concatenate([src[f"{p}.{e}.{proj}.weight"][rows] for proj in ("gate_proj", "up_proj")])
                            for e in range(n_expert)])
            w2 = np.stack([src[f"{p}.{e}.down_proj.weight"][:, rows] for e in range(n_expert)])
            np.testing.assert_array_equal(got[name + ".w13"], w13, err_msg=f"rank {rank} {name}")
            np.testing.assert_array_equal(got[name + ".w2"], w2, err_msg=f"rank {rank} {name}")


def reference_model(moe):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe.tiny.hf_dir, dtype=torch.float32).eval()


def check_generation(result: dict, ref) -> None:
    """vLLM's greedy tokens and logprobs vs transformers float32, teacher-forced on vLLM's tokens."""
    assert len(result["outputs"]) == len(PROMPTS)
    check_greedy(result["outputs"], ref, MAX_TOKENS)


@pytest.mark.vllm
def test_tp1_compiled_serves_exact_experts(tp1_compiled, moe):
    result, dump = tp1_compiled
    assert result["quantization"] == "ternary"
    assert result["compilation_mode"] != "0", "expected torch.compile (not eager) mode"
    check_experts(result, dump, moe, tp=1)


@pytest.mark.vllm
def test_tp1_compiled_generation_matches_transformers(tp1_compiled, moe):
    check_generation(tp1_compiled[0], reference_model(moe))


@pytest.mark.vllm
def test_tp2_eager_serves_exact_expert_shards(tp2_eager, moe):
    check_experts(*tp2_eager, moe, tp=2)


@pytest.mark.vllm
def test_tp2_eager_generation_matches_transformers(tp2_eager, moe):
    check_generation(tp2_eager[0], reference_model(moe))


@pytest.mark.vllm
def test_experts_decide_the_tokens(tp1_compiled, moe):
    """Guard against a vacuous pass: with its routed experts silenced (down_proj zeroed) the reference model
    continues the prompts differently, so matching it above means the experts were served right."""
    import torch

    ref = reference_model(moe)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if name.endswith("mlp.experts.down_proj"):
                param.zero_()
    differs = 0
    for out in tp1_compiled[0]["outputs"]:
        prompt = out["prompt_token_ids"]
        silenced = ref.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                pad_token_id=0)[0][len(prompt):].tolist()
        differs += silenced != out["token_ids"]
    assert differs >= len(PROMPTS) - 1


# ---------------------------------------------------------------------------------------------------
# Qwen2-MoE: routed experts plus a shared expert (llama.cpp's ffn_*_shexp, ffn_gate_inp_shexp)
# ---------------------------------------------------------------------------------------------------
SHARED_EXPERTS, SHARED_TOP_K, SHARED_INTER = 4, 2, 256


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A tiny ``Qwen2MoeForCausalLM`` written as TQ2_0 by llama.cpp's own converter, converted by ours."""
    from support import llama_cpp
    llama_cpp.require_converter()
    root = tmp_path_factory.mktemp("qwen2moe")
    tiny = build_tiny_moe(root / "hf", experts=SHARED_EXPERTS, top_k=SHARED_TOP_K, seed=1,
                          shared_intermediate=SHARED_INTER)
    src = llama_cpp.reference_convert(tiny.hf_dir, root / "tiny-TQ2_0.gguf", "tq2_0", tokenizer_pre="qwen2")
    ckpt = ternary_rs.convert(src, root / "vllm", progress=False)
    return SimpleNamespace(root=root, tiny=tiny, gguf=src, writer="llama.cpp", ckpt=Path(ckpt))


def test_shared_expert_gguf_converts_exactly(shared):
    """llama.cpp's file holds the shared expert as TQ2_0 ``ffn_*_shexp`` and its gate as F32; the checkpoint
    holds it as ternary qweight/scales equal to transformers' weights, the gate dense, and config.json
    what vLLM's Qwen2-MoE needs (shared size, no top-k renormalisation, q/k/v biases)."""
    cfg = shared.tiny.config
    with ternary_rs.open(shared.gguf) as f:
        t, md = f.tensors, f.metadata
        assert t["blk.0.ffn_gate_shexp.weight"].type == "TQ2_0"
        assert t["blk.0.ffn_gate_inp_shexp.weight"].type == "F32"
        assert md["qwen2moe.expert_shared_feed_forward_length"] == SHARED_INTER
    out = json.loads((shared.ckpt / "config.json").read_text())
    assert out["architectures"] == ["Qwen2MoeForCausalLM"] and out["model_type"] == "qwen2_moe"
    assert out["shared_expert_intermediate_size"] == SHARED_INTER and out["norm_topk_prob"] is False
    assert (out["num_experts"], out["num_experts_per_tok"]) == (SHARED_EXPERTS, SHARED_TOP_K)
    src = hf_weights(shared.tiny.hf_dir)
    with ternary_rs.open(shared.ckpt) as f:
        for layer in range(cfg["num_hidden_layers"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                p = f"model.layers.{layer}.mlp.shared_expert.{proj}"
                np.testing.assert_array_equal(ternary_rs.decode(f, p).dequantize("float32"), src[f"{p}.weight"],
                                              err_msg=p)
            gate = f"model.layers.{layer}.mlp.shared_expert_gate.weight"
            assert f.tensors[gate].type == "F32"
            np.testing.assert_array_equal(np.asarray(f.raw(gate)).view(np.float32).reshape(1, -1), src[gate])
            bias = f"model.layers.{layer}.self_attn.q_proj.bias"
            np.testing.assert_array_equal(np.asarray(f.raw(bias)).view(np.float32), src[bias])
    assert ternary_rs.verify(shared.ckpt)


@pytest.mark.vllm
def test_shared_expert_model_serves_like_transformers(shared):
    """vLLM (TP=1, eager) serves the routed experts through TernaryMoEMethod and the shared expert through
    the ternary linear method, every weight exact; greedy tokens and logprobs follow transformers'."""
    pytest.importorskip("vllm")
    proc, out, dump_dir, log = start_engine(shared, "tp1", "--tp", "1", "--eager")
    try:
        rc = proc.wait(timeout=ENGINE_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, log.read_text(errors="replace")[-8000:]
    result = json.loads(out.read_text())
    check_experts(result, dump_dir, shared, tp=1)
    src = hf_weights(shared.tiny.hf_dir)
    got = np.load(dump_dir / "rank0.npz")
    methods = result["workers"][0]["methods"]
    for layer in range(shared.tiny.config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.shared_expert"
        assert methods[f"{p}.gate_up_proj"] == methods[f"{p}.down_proj"] == "TernaryLinearMethod", methods
        np.testing.assert_array_equal(got[f"{p}.gate_up_proj"],
                                      np.concatenate([src[f"{p}.gate_proj.weight"], src[f"{p}.up_proj.weight"]]))
        np.testing.assert_array_equal(got[f"{p}.down_proj"], src[f"{p}.down_proj.weight"])
    check_generation(result, reference_model(shared))
