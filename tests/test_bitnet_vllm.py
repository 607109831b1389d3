"""BitNet b1.58 served by vLLM (CPU) through the plugin's ``BitNetForCausalLM``, against transformers' own
BitNet (``from_pretrained`` on the source checkpoint: ``AutoBitLinear`` / ``BitLinear``, ``BitNetRMSNorm``).

Engines (subprocesses, ``tests/support/vllm_runner.py``; tiny models from ``tests/support/bitnet_model.py``):

* **A** — transformers-packed ``bitlinear`` checkpoint (reciprocal ``weight_scale``, attention biases, tied
  head), float32, TP=1, torch.compile;
* **B** — the master-weight variant converted with ``--ternarize``, bfloat16, TP=1, eager, untied head;
* **C** — a bitnet.cpp-style I2_S GGUF (``general.architecture = bitnet-b1.58``), float32, TP=2, eager.

Greedy tokens are compared teacher-forced (transformers scores vLLM's sequence) at every step:

* ``|vLLM − transformers|`` log-prob of vLLM's token ``<= LOGPROB_TOL[dtype]`` at every step;
* vLLM's token is transformers' argmax unless transformers' top-2 log-probs are within
  ``TIE_MARGIN = 2 · LOGPROB_TOL`` — a *near tie*: two scores each off by at most the tolerance can only
  swap if they are that close. At least a third of the steps must be decisive (else the check says little).

Why the tolerances are not f32-tiny: BitNet quantizes every linear input to int8 per token, so an ulp of
difference upstream (summation order, fp16 weight scales of a reciprocal or f32 ``weight_scale``) moves a
code whose ``x·s`` lies within an ulp of .5 by one, and these random tiny models amplify that to ~1e-2 in
log-prob (measured: with bit-identical inputs and fp16-exact scales, vLLM float32 matches to ~1e-6).
bfloat16 adds transformers' and vLLM's different bf16 roundings (attention, norms, residuals).

Model B uses head_dim 48: vLLM's AMX attention kernel (bf16, head_dim % 32 == 0) died with SIGILL in
``cpu_attention_with_kv_cache`` under ``tests/support/vllm_runner.py`` on this project's CPU machine (a tiny Qwen3 too);
head_dim 48 selects its portable ``vec16`` kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

import ternary_rs
from support.bitnet_model import build_tiny_bitnet, load_reference, write_bitnet_gguf
from ternary_rs.serving import ops
from ternary_rs.serving.cpu import bf16_gemm_is_native

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).parent
RUNNER = TESTS / "support" / "vllm_runner.py"
TP_WORKER = TESTS / "support" / "bitnet_tp_worker.py"
PROMPTS = ["The quick brown fox", "Hello world! This is", "Ternary weights take one of", "A scale per group"]
MAX_TOKENS = 16
# Measured maxima on these fixtures: float32 0.029 (A) / 0.023 (C), bfloat16 0.049 (B, 33 of 64 near ties).
LOGPROB_TOL = {"float32": 0.05, "bfloat16": 0.08}
ENGINE_TIMEOUT_S = 900


def run_engine(tmp: Path, model_dir: Path, dtype: str, *extra: str) -> tuple[dict, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out, dump = tmp / "result.json", tmp / "weights"
    cmd = [sys.executable, str(RUNNER), "--model", str(model_dir), "--out", str(out), "--prompts-json",
           str(prompts), "--max-tokens", str(MAX_TOKENS), "--dtype", dtype, "--dump-weights", str(dump), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        pytest.fail(f"vLLM runner failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    return json.loads(out.read_text()), dump


def check_generation(result: dict, model, dtype: str) -> dict:
    """The comparison described in the module doc against transformers' ``model``; returns statistics."""
    tol = LOGPROB_TOL[dtype]
    steps = ties = 0
    worst = 0.0
    assert len(result["outputs"]) == len(PROMPTS)
    for out in result["outputs"]:
        prompt, gen = out["prompt_token_ids"], out["token_ids"]
        assert len(gen) == MAX_TOKENS
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1: len(prompt) - 1 + len(gen)]
        for step, token in enumerate(gen):
            top = ref[step].topk(2)
            best, gap = int(top.indices[0]), float(top.values[0] - top.values[1])
            steps += 1
            ties += gap < 2 * tol
            assert token == best or gap < 2 * tol, (
                f"prompt {prompt}: step {step}: vLLM {token}, transformers {best} (top-2 gap {gap:.4f})")
            diff = abs(out["logprobs"][step][str(token)] - float(ref[step][token]))
            worst = max(worst, diff)
            assert diff <= tol, (prompt, step, token, diff)
    assert 3 * (steps - ties) >= steps, f"{ties} of {steps} steps are near ties: the comparison says too little"
    stats = {"dtype": dtype, "steps": steps, "near_ties": ties, "max_logprob_diff": round(worst, 5)}
    print("bitnet vLLM vs transformers:", stats)  # shown with pytest -s
    return stats


def expected_shards(model, tp: int, rank: int) -> dict[str, np.ndarray]:
    """What rank ``rank`` must hold for each fused ternary layer: the dense weights of transformers' ``model``
    (trits · fp16(magnitude)) sliced by hand the way vLLM shards Llama-shaped layers."""
    from transformers.integrations.bitnet import AutoBitLinear, BitLinear, unpack_weights

    dense = {}
    for name, m in model.named_modules():
        if isinstance(m, BitLinear):
            magnitude = 1.0 / float(m.weight_scale)
            dense[name] = unpack_weights(m.weight, dtype=torch.float32).numpy() * np.float32(np.float16(magnitude))
        elif isinstance(m, AutoBitLinear):
            magnitude = float(m.weight_scale)
            dense[name] = m.weight.detach().float().numpy() * np.float32(np.float16(magnitude))
    cfg = model.config
    rows = lambda w, parts, r: w[r * (w.shape[0] // parts):(r + 1) * (w.shape[0] // parts)]  # noqa: E731
    cols = lambda w, parts, r: w[:, r * (w.shape[1] // parts):(r + 1) * (w.shape[1] // parts)]  # noqa: E731
    kv = cfg.num_key_value_heads  # split across ranks when there are enough, replicated otherwise
    kv_parts, kv_rank = (tp, rank) if kv >= tp else (kv, rank * kv // tp)
    out = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj"] = np.concatenate([
            rows(dense[p + "self_attn.q_proj"], tp, rank), rows(dense[p + "self_attn.k_proj"], kv_parts, kv_rank),
            rows(dense[p + "self_attn.v_proj"], kv_parts, kv_rank)])
        out[p + "self_attn.o_proj"] = cols(dense[p + "self_attn.o_proj"], tp, rank)
        out[p + "mlp.gate_up_proj"] = np.concatenate([rows(dense[p + "mlp.gate_proj"], tp, rank),
                                                      rows(dense[p + "mlp.up_proj"], tp, rank)])
        out[p + "mlp.down_proj"] = cols(dense[p + "mlp.down_proj"], tp, rank)
    return out


def check_layers(result: dict, dump: Path, model, tp: int) -> None:
    """Every linear is ternary, asks for INT8_TOKEN, and holds its shard of transformers' weights (seen
    through the op: ``apply(layer, I)``, where the int8 quantization of a one-hot row is exact up to the
    f32 rounding of 1/127); embeddings and the head stay dense."""
    assert sorted(w["rank"] for w in result["workers"]) == list(range(tp))
    for worker in result["workers"]:
        methods, acts = worker["methods"], worker["activations"]
        linear = [n for n in methods if n.endswith("_proj")]
        assert len(linear) == 4 * 2 and all(methods[n] == "TernaryLinearMethod" for n in linear), methods
        assert all(acts[n] == ops.INT8_TOKEN for n in linear), acts
        assert methods["model.embed_tokens"] == "DenseEmbeddingMethod"
        assert methods.get("lm_head", "DenseEmbeddingMethod") == "DenseEmbeddingMethod"
        assert worker["dense_kernel"] == [], "float32 dense layers stay vLLM's"
        got = np.load(dump / f"rank{worker['rank']}.npz")
        want = expected_shards(model, tp, worker["rank"])
        assert sorted(got.files) == sorted(want)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-6, atol=0, err_msg=f"rank {worker['rank']}: {name}")


# ---------------------------------------------------------------------------------------------------
# checkpoints and engines (built once per module)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="ternary_bitnet_vllm_") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def engine_a(workdir):
    hf = build_tiny_bitnet(workdir / "a-hf", linear_class="bitlinear", dtype="bfloat16", seed=11,
                           attention_bias=True, tie_word_embeddings=True)
    ckpt = ternary_rs.convert(hf, workdir / "a-ternary", progress=False)
    return hf, run_engine(workdir / "a-run", ckpt, "float32")


@pytest.fixture(scope="module")
def engine_b(workdir):
    hf = build_tiny_bitnet(workdir / "b-hf", packed=False, dtype="bfloat16", seed=12, hidden=384, heads=8,
                           kv_heads=2, tie_word_embeddings=False)
    ckpt = ternary_rs.convert(hf, workdir / "b-ternary", ternarize=True, progress=False)
    return hf, run_engine(workdir / "b-run", ckpt, "bfloat16", "--eager")


@pytest.fixture(scope="module")
def engine_c(workdir):
    hf = build_tiny_bitnet(workdir / "c-hf", linear_class="autobitlinear", dtype="bfloat16", seed=13,
                           tie_word_embeddings=False)
    gguf_path = write_bitnet_gguf(hf, workdir / "c.gguf", "I2_S", "bitnet-b1.58")
    ckpt = ternary_rs.convert(gguf_path, workdir / "c-ternary", progress=False)
    return hf, run_engine(workdir / "c-run", ckpt, "float32", "--tp", "2", "--eager")


# ---------------------------------------------------------------------------------------------------
# no engine: registration, and the TP=2 reductions in a real 2-process vLLM world
# ---------------------------------------------------------------------------------------------------
def test_plugin_registers_the_bitnet_model_class():
    script = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm import ModelRegistry
assert "BitNetForCausalLM" in ModelRegistry.get_supported_archs()
cls = ModelRegistry._try_load_model_cls("BitNetForCausalLM")
print("CLASS", cls.__module__, cls.__name__)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "CLASS ternary_rs.vllm.bitnet BitNetForCausalLM" in proc.stdout


def test_tp2_sub_norm_and_int8_token_scale_span_all_ranks(tmp_path):
    """attn_sub_norm + o_proj sharded over 2 ranks (vLLM's own loaders and collectives) give the unsharded
    result: transformers' BitNetRMSNorm and BitLinear on the whole row. Without the cross-rank sum of squares
    and max|x| they would not (the per-shard variant is checked to differ by far more than the tolerance)."""
    from transformers.integrations.bitnet import BitLinear, pack_weights
    from transformers.models.bitnet.modeling_bitnet import BitNetRMSNorm

    rng = np.random.default_rng(5)
    k, n, g, eps = 256, 64, 128, 1e-5
    trits = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    ws = np.float32(2.0 ** -4)
    x = (rng.standard_normal((6, k)) * np.linspace(0.1, 3.0, k)).astype(np.float32)
    x[:, 200] *= 25.0  # the token maxima live in rank 1's half: rank 0 alone would pick another scale
    norm_weight = (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    inputs = tmp_path / "in.npz"
    np.savez(inputs, k=k, n=n, g=g, eps=eps, x=x, norm_weight=norm_weight, bias=bias,
             qweight=ternary_rs.pack_codes(trits), scales=np.full((n, k // g), ws, np.float16))
    init = f"file://{tmp_path / 'dist-init'}"
    procs = [subprocess.Popen([sys.executable, str(TP_WORKER), "--rank", str(r), "--init", init, "--inputs", str(inputs),
                               "--out", str(tmp_path / f"out{r}.npz")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    outs = [np.load(tmp_path / f"out{r}.npz") for r in range(2)]
    np.testing.assert_array_equal(outs[0]["y"], outs[1]["y"])  # all-reduced: every rank has the whole output
    np.testing.assert_array_equal(np.concatenate([o["norm_weight_shard"] for o in outs]), norm_weight)

    ref_norm = BitNetRMSNorm(k, eps=eps)
    ref_linear = BitLinear(k, n, bias=True, dtype=torch.float32)
    with torch.no_grad():
        ref_norm.weight.copy_(torch.from_numpy(norm_weight))
        ref_linear.weight.copy_(pack_weights(torch.from_numpy(trits).clone()))
        ref_linear.weight_scale.fill_(float(1.0 / ws))
        ref_linear.bias.copy_(torch.from_numpy(bias))
        normed = ref_norm(torch.from_numpy(x))
        want = ref_linear(normed).numpy()
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(outs[0]["y"], want, rtol=1e-5, atol=1e-5 * scale)

    # What per-shard statistics would give: norm and int8 scale from each half alone.
    qk, sk = ops.prepare_weight(torch.from_numpy(ternary_rs.pack_codes(trits[:, :128])),
                                torch.full((n, 1), float(ws), dtype=torch.float16), g)
    qk1, sk1 = ops.prepare_weight(torch.from_numpy(ternary_rs.pack_codes(trits[:, 128:])),
                                  torch.full((n, 1), float(ws), dtype=torch.float16), g)
    per_shard = sum(ops.ternary_linear(normed[:, h * 128:(h + 1) * 128].contiguous(), q, s, n, 128, g, None,
                                       ops.INT8_TOKEN).numpy() for h, (q, s) in enumerate(((qk, sk), (qk1, sk1))))
    assert np.abs(per_shard + bias - want).max() > 100 * 1e-5 * scale


# ---------------------------------------------------------------------------------------------------
# engines
# ---------------------------------------------------------------------------------------------------
def test_a_float32_compiled_bitlinear(engine_a):
    hf, (result, dump) = engine_a
    assert result["quantization"] == "ternary" and result["compilation_mode"] != "0"
    # vLLM's default opaque layer names: the plugin leaves the graph's Python wrapper (the C++ one cannot
    # pass them); test_vllm's compiled engine runs as `serve` starts vLLM, with the C++ wrapper
    assert result["cpp_wrapper"] == (os.environ.get("VLLM_USE_LAYERNAME") == "0")
    assert result["attention_impls"] == ["FusedUpdateCPUAttentionImpl"], result["attention_impls"]
    model = load_reference(hf, "float32")
    check_layers(result, dump, model, tp=1)
    check_generation(result, model, "float32")


def test_b_bfloat16_master_weights(engine_b):
    hf, (result, dump) = engine_b
    assert "bfloat16" in result["dtype"]
    # The dense bf16 head's product is ternary_rs.dense_linear exactly where torch's bf16 GEMM is not
    # native (vLLM's oneDNN path refuses bf16 there); the generations below went through it.
    for worker in result["workers"]:
        head = "lm_head" if "lm_head" in worker["methods"] else "model.embed_tokens"
        assert worker["methods"][head] == "DenseEmbeddingMethod"
        assert (head in worker["dense_kernel"]) == (not bf16_gemm_is_native()), worker["dense_kernel"]
    stats = check_generation(result, load_reference(hf, "bfloat16"), "bfloat16")  # transformers' online WeightQuant
    assert stats["steps"] == len(PROMPTS) * MAX_TOKENS


def test_c_tp2_from_bitnet_cpp_gguf(engine_c):
    hf, (result, dump) = engine_c
    model = load_reference(hf, "float32")
    check_layers(result, dump, model, tp=2)
    check_generation(result, model, "float32")
