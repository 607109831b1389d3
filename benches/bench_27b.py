"""A 27B-shaped Bonsai 2 on this machine: vLLM CPU peak resident memory (load and serving) and decode speed.

    python benches/bench_27b.py [--workdir DIR] [--layers 64] [--tokens 32] [--batch 1,8,16] [--keep]
                                [--max-model-len 1024] [--kv-space-gib GIB] [--eager]
                                [--rotation rotated|unrotated|both] [--profile STEPS] [--llama-cpp]

1. Builds a synthetic Ternary-Bonsai-2-27B-shaped checkpoint in ternary_rs's vLLM layout (qwen35 text:
   hidden 5120, 64 layers — 48 Gated-DeltaNet + 16 full attention at layers 3, 7, …, 63 —, ffn 17408,
   vocab 248320, attention heads 24 / kv 4 × 256, GDN 16 key / 48 value heads × 128, conv 4; every linear,
   the embedding and lm_head ternary at group 128 with the Hadamard rotation description of the real
   file: block 1024, one ±1 sign vector per input width 5120 / 6144 / 17408). Weights are random codes
   drawn tensor by tensor and streamed into the shards (``ternary_rs.sinks.checkpoint.write_shards``): the model
   is never in memory, only a couple of tensors (the largest, the embedding, is 0.34 GB packed).
   The bf16 model would be 54 GB; this checkpoint is about 7.2 GB.
2. Serves it with vLLM CPU, compiled as vLLM's default is (``--eager`` for enforce_eager), in a fresh process
   (the engine in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so one process holds everything) from token
   ids (no tokenizer), greedy, each batch size of ``--batch`` in turn in the same engine (so their ratios are
   side by side), and prints: checkpoint size; peak resident memory (VmHWM) after loading and after serving,
   with the split into anonymous and file-backed pages at those points; the KV cache space configured and
   vLLM's own maximum concurrency; the ratio to the goal ``1.3 × checkpoint + KV cache``; per batch size the
   time to first token, decode tokens/s (``--tokens`` new tokens, excluding the first), the ratio to batch 1,
   and the weight bytes read per second as a fraction of the streaming bandwidth measured at the start
   (``torch.sum``, as ``bench_cpu_op.py``) and of the bandwidth of the model's own weight pages read right
   before and after that batch size's timed run (``weight_read_bandwidth``: this VM's bandwidth drifts
   between ~45 and ~80 GB/s within minutes, so only the bracketing figure describes the run); then the same
   fractions for all the bytes a step moves: the weights and each sequence's Gated-DeltaNet state, read and
   written back (~0.15 GB per sequence at this shape with vLLM's f32 recurrent state: ~4.5 % more than the
   weights at batch 1). ``--rotation both`` then serves the same weights without the
   rotation (the shards linked, the config without it).
3. ``--llama-cpp`` (needs ``LLAMA_CPP_BIN``, ``scripts/build_llama_cpp.sh``): the unrotated weights as a TQ2_0
   GGUF written by ``ternary-rs convert --gguf-type TQ2_0 --requantize`` (TQ2_0 has one scale per 256
   weights, so group 128 is re-ternarized: other values, the same shapes and 2.06 instead of 2.13 bits per
   weight; speed is what is compared), with a small trained tokenizer beside it (llama.cpp needs a
   vocabulary; both sides are fed token ids), then ``llama-bench -p 0 -n TOKENS`` on as many threads as
   vLLM has: upstream llama.cpp's batch-1 decode on the same shapes, and our batch 1 against it.

By design it fits in 24 GiB: weights stay ternary in vLLM (linear, lm_head and — through the plugin's
Qwen3.5 class — embed_tokens), vLLM's placeholder dense embedding is never touched (no resident pages), the
safetensors are read tensor by tensor, and the KV cache / recurrent state is bounded by
``VLLM_CPU_KVCACHE_SPACE``: by default the plugin sizes it for ``--batch`` sequences (as a user gets it);
``--kv-space-gib`` sets it. Too small a space caps how many sequences vLLM runs at once — at this shape one
sequence's Gated-DeltaNet state is ~150 MB, so 1 GiB runs only a few of a batch of 8 together, and the
"batch 8" rate would be a smaller batch's. Timings on a shared machine are not results; smoke-test
with ``--layers 4``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Ternary-Bonsai-2-27B geometry (docs/formats.md#model-inventory, read from the GGUF by a third party).
HIDDEN = 5120
LAYERS = 64
FFN = 17408
VOCAB = 248320
HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256
GDN_K_HEADS, GDN_V_HEADS, GDN_HEAD_DIM = 16, 48, 128
CONV_KERNEL = 4
FULL_ATTENTION_INTERVAL = 4
GROUP = 128
HADAMARD_BLOCK = 1024
ROPE_DIMS = 64
SHARD_BYTES = 2 * 10**9
# All 81 bytes whose four 2-bit fields are valid codes (0, 1, 2): random ternary weights, drawn per byte.
VALID_CODE_BYTES = np.array([a | b << 2 | c << 4 | d << 6 for a in range(3) for b in range(3) for c in range(3)
                             for d in range(3)], dtype=np.uint8)


def layer_types(layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(layers)]


def config(layers: int) -> dict:
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": ROPE_DIMS / HEAD_DIM,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "attention_bias": False,
        "linear_conv_kernel_dim": CONV_KERNEL,
        "linear_key_head_dim": GDN_HEAD_DIM,
        "linear_value_head_dim": GDN_HEAD_DIM,
        "linear_num_key_heads": GDN_K_HEADS,
        "linear_num_value_heads": GDN_V_HEADS,
        "layer_types": layer_types(layers),
        "eos_token_id": 0,
        "pad_token_id": 0,
        "bos_token_id": None,
        "dtype": "bfloat16",
    }


def tensor_list(layers: int) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, ...]]]:
    """``(ternary modules -> (N, K), dense tensors -> shape)`` in Hugging Face / vLLM names."""
    ternary = {"model.embed_tokens": (VOCAB, HIDDEN), "lm_head": (VOCAB, HIDDEN)}
    dense: dict[str, tuple[int, ...]] = {"model.norm.weight": (HIDDEN,)}
    qk, v = GDN_K_HEADS * GDN_HEAD_DIM, GDN_V_HEADS * GDN_HEAD_DIM
    for i, kind in enumerate(layer_types(layers)):
        p = f"model.layers.{i}."
        dense[p + "input_layernorm.weight"] = (HIDDEN,)
        dense[p + "post_attention_layernorm.weight"] = (HIDDEN,)
        ternary[p + "mlp.gate_proj"] = (FFN, HIDDEN)
        ternary[p + "mlp.up_proj"] = (FFN, HIDDEN)
        ternary[p + "mlp.down_proj"] = (HIDDEN, FFN)
        if kind == "full_attention":
            ternary[p + "self_attn.q_proj"] = (2 * HEADS * HEAD_DIM, HIDDEN)  # queries + output gate
            ternary[p + "self_attn.k_proj"] = (KV_HEADS * HEAD_DIM, HIDDEN)
            ternary[p + "self_attn.v_proj"] = (KV_HEADS * HEAD_DIM, HIDDEN)
            ternary[p + "self_attn.o_proj"] = (HIDDEN, HEADS * HEAD_DIM)
            dense[p + "self_attn.q_norm.weight"] = (HEAD_DIM,)
            dense[p + "self_attn.k_norm.weight"] = (HEAD_DIM,)
        else:
            ternary[p + "linear_attn.in_proj_qkv"] = (2 * qk + v, HIDDEN)
            ternary[p + "linear_attn.in_proj_z"] = (v, HIDDEN)
            ternary[p + "linear_attn.out_proj"] = (HIDDEN, v)
            dense[p + "linear_attn.in_proj_a.weight"] = (GDN_V_HEADS, HIDDEN)  # dense in Bonsai 2 (BF16)
            dense[p + "linear_attn.in_proj_b.weight"] = (GDN_V_HEADS, HIDDEN)
            dense[p + "linear_attn.conv1d.weight"] = (2 * qk + v, 1, CONV_KERNEL)
            dense[p + "linear_attn.A_log"] = (GDN_V_HEADS,)
            dense[p + "linear_attn.dt_bias"] = (GDN_V_HEADS,)
            dense[p + "linear_attn.norm.weight"] = (GDN_HEAD_DIM,)
    return ternary, dense


def build(out_dir: Path, layers: int, seed: int = 0, rotation: bool = True) -> Path:
    """Stream the synthetic checkpoint into ``out_dir`` (config.json, shards, index); ``rotation=False``
    leaves out the Hadamard rotation description (a plain ternary qwen35, as upstream llama.cpp runs)."""
    from ternary_rs.core.hadamard import HadamardSpec
    from ternary_rs.sinks.checkpoint import Job, OutTensor, quantization_config, write_shards

    ternary, dense = tensor_list(layers)
    jobs = []
    for i, (module, (n, k)) in enumerate(ternary.items()):
        def produce(n=n, k=k, i=i):
            rng = np.random.default_rng([seed, i])
            q = VALID_CODE_BYTES[rng.integers(0, VALID_CODE_BYTES.size, size=(n, k // 4), dtype=np.uint8)]
            s = (rng.random((n, k // GROUP), dtype=np.float32) * 0.02 + 0.005).astype(np.float16)
            return q, s

        jobs.append(Job([OutTensor(module + ".qweight", "U8", (n, k // 4), n * k // 4),
                         OutTensor(module + ".scales", "F16", (n, k // GROUP), n * (k // GROUP) * 2)],
                        produce, module, n * k // 4))
    for j, (name, shape) in enumerate(dense.items()):
        def produce(name=name, shape=shape, j=j):
            rng = np.random.default_rng([seed, 10**6 + j])
            if name.endswith("A_log"):
                return (np.log(rng.uniform(1, 8, shape)).astype(np.float32),)
            if name.endswith("linear_attn.norm.weight"):
                return (np.ones(shape, np.float32),)
            if "norm" in name:
                return (np.zeros(shape, np.float32),)  # Qwen3.5 RMSNorm: x·(1 + w)
            return ((rng.standard_normal(shape) * 0.02).astype(np.float32),)

        jobs.append(Job([OutTensor(name, "F32", shape, int(np.prod(shape)) * 4)], produce, name))
    # Widest dtype first keeps every tensor aligned in the shards (F32, then F16 scales, then U8 codes).
    jobs.sort(key=lambda job: {"F32": 0}.get(job.outputs[0].dtype, 1))
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_shards(tmp, jobs, SHARD_BYTES)
    rng = np.random.default_rng([seed, 99])
    widths = sorted({HIDDEN, GDN_V_HEADS * GDN_HEAD_DIM, FFN})
    signs = {w: rng.choice(np.array([-1, 1], np.int8), size=w) for w in widths}
    rotated = {m: (k, None) for m, (n, k) in ternary.items() if m != "model.embed_tokens"}
    spec = HadamardSpec(HADAMARD_BLOCK, signs, rotated, ("model.embed_tokens",), source="bench_27b")
    qc = quantization_config(GROUP)
    if rotation:
        qc["hadamard"] = spec.to_config()
    (tmp / "config.json").write_text(json.dumps({**config(layers), "quantization_config": qc}, indent=2) + "\n")
    tmp.rename(out_dir)
    return out_dir


def checkpoint_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


def parameters(layers: int) -> int:
    ternary, dense = tensor_list(layers)
    return sum(n * k for n, k in ternary.values()) + sum(int(np.prod(s)) for s in dense.values())


def state_bytes(layers: int) -> int:
    """Bytes of one sequence's Gated-DeltaNet state (recurrent and conv, every linear-attention layer): a
    decode step reads all of it and writes it back, so each sequence in a step adds twice this to the weight
    bytes that step streams. The recurrent state is f32 where vLLM CPU makes it so (AVX512_BF16 CPUs,
    ``ternary_rs.serving.cpu.recurrent_state_bytes``), the conv state bf16. The full-attention layers' KV
    cache read at these lengths (16-token prompts, ``--tokens`` new ones) is ~1 MB a step: left out."""
    from ternary_rs.serving.cpu import recurrent_state_bytes

    gdn_layers = sum(kind == "linear_attention" for kind in layer_types(layers))
    conv_channels = 2 * GDN_K_HEADS * GDN_HEAD_DIM + GDN_V_HEADS * GDN_HEAD_DIM
    recurrent = GDN_V_HEADS * GDN_HEAD_DIM * GDN_HEAD_DIM * recurrent_state_bytes()
    conv = (CONV_KERNEL - 1) * conv_channels * 2
    return gdn_layers * (recurrent + conv)


# ------------------------------------------------------------------------------------------ serving (child)
def _status() -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


# How much of the model's own weight bytes the bandwidth probe reads (the largest code tensors first): more
# than any L3 this runs on (480 MiB on the AMX machines), so it reads DRAM as a decode step does.
PROBE_BYTES = 1 << 30


def weight_read_bandwidth(model) -> float:
    """GB/s of a reduction (a wrapping sum of 64-bit words: as fast as ``torch.sum`` of f32, whose NaN and
    subnormal bit patterns random codes would hit) over the largest ternary code tensors of the served
    model, ``PROBE_BYTES`` of them: the pages a decode step streams, read by torch's threads as vLLM set
    them. Taken right before and after each timed run (this VM's bandwidth drifts by tens of per cent
    within minutes, so a figure taken before loading does not describe a run minutes later), with no
    memory of its own (a 1 GiB buffer would raise the peak RSS this bench also reports)."""
    import torch

    codes = {}
    for module in model.modules():
        for name in ("qweight_k", "qweight"):
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.is_contiguous() and t.numel() % 8 == 0:
                codes[t.data_ptr()] = t
    chosen, total = [], 0
    for t in sorted(codes.values(), key=lambda t: -t.numel()):
        if total >= PROBE_BYTES:
            break
        chosen.append(t.view(torch.int64))
        total += t.numel()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for t in chosen:
            t.sum()
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e9


def serve(model: Path, tokens: int, batches: list[int], max_model_len: int, compile_: bool, profile: int = 0,
          prefix_caching: bool = True) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: its peak RSS is the total
    # Reserved CPUs, thread binding and KV space are left to the plugin (vLLM defaults, as LLM(model) gives
    # them); its settings line is printed with the results.
    import torch  # noqa: F401  (imported before the baseline, as vLLM will)
    import vllm.model_executor.models.qwen3_5  # noqa: F401
    from vllm import LLM, SamplingParams

    import ternary_rs.vllm.plugin  # noqa: F401

    before = _status()
    t0 = time.perf_counter()
    llm = LLM(model=str(model), dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=max(batches),
              enforce_eager=not compile_, skip_tokenizer_init=True, seed=0, enable_prefix_caching=prefix_caching)
    load_s = time.perf_counter() - t0
    loaded = _status()
    warm = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], warm, use_tqdm=False)  # first-call set-up, not timed
    runs = []
    for batch in batches:  # one engine, so the ratios between batch sizes are side by side
        def fresh(seed: int) -> list:  # prompts no earlier run has put in the prefix cache
            return [{"prompt_token_ids": [int(x) for x in np.random.default_rng(seed + i).integers(1, VOCAB, 16)]}
                    for i in range(batch)]

        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        llm.generate(fresh(1000 * batch), first, use_tqdm=False)
        ttft = time.perf_counter() - t0
        sp = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True, detokenize=False)
        prompts = fresh(1000 * batch + 500)
        bandwidth_before = llm.apply_model(weight_read_bandwidth)[0]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        total = time.perf_counter() - t0
        bandwidth_after = llm.apply_model(weight_read_bandwidth)[0]
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        # The timed run does its own prefill of prompts as long as the first run's: subtract that run's time.
        runs.append({"batch": batch, "ttft_s": ttft, "generated": generated,
                     "decode_tok_per_s": (generated - batch) / max(total - ttft, 1e-9),
                     "bandwidth": [bandwidth_before, bandwidth_after]})
    served = _status()
    if profile:
        _profile(llm, prompts, profile)
    kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0")) * 2**30
    chosen = getattr(getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None),
                     "kv_cache_memory_bytes", None)
    kv = float(chosen) if chosen else kv  # the plugin's choice when the environment left it open
    return {"load_s": load_s, "runs": runs, "kv_cache_bytes": kv,
            "rss_before": before, "rss_loaded": loaded, "rss_served": served}


def unrotated_twin(rotated: Path, out_dir: Path) -> Path:
    """The same weights without the rotation description: the shards linked, the config without
    ``quantization_config.hadamard`` (a plain ternary qwen35, as upstream llama.cpp runs it)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in rotated.iterdir():
        if f.name != "config.json":
            (tmp / f.name).symlink_to(f.resolve())
    cfg = json.loads((rotated / "config.json").read_text())
    cfg["quantization_config"].pop("hadamard", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tmp.rename(out_dir)
    return out_dir


def llama_cpp_gguf(unrotated: Path, out: Path) -> Path:
    """``unrotated`` as a TQ2_0 GGUF upstream llama.cpp runs (module doc, item 3); kept beside the checkpoint."""
    if out.is_file():
        return out
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.gguf_models import train_qwen2_tokenizer

    src = out.with_name(out.stem + "-src")  # the checkpoint linked, plus the tokenizer the GGUF needs
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    try:
        for f in unrotated.iterdir():
            (src / f.name).symlink_to(f.resolve())
        train_qwen2_tokenizer(src)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ternary_rs", "convert", str(src), str(out), "--gguf-type", "TQ2_0",
                        "--requantize", "--no-progress"], check=True)
        print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return out


def llama_bench(gguf_path: Path, tokens: int, threads: int) -> float:
    """llama.cpp's batch-1 decode rate (``llama-bench -p 0 -n tokens``, the mean of two repetitions)."""
    exe = Path(os.environ["LLAMA_CPP_BIN"]) / "llama-bench"
    proc = subprocess.run([str(exe), "-m", str(gguf_path), "-p", "0", "-n", str(tokens), "-t", str(threads),
                           "-r", "2", "-o", "json"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"llama-bench failed ({proc.returncode}) on {gguf_path}:\n{proc.stderr[-3000:]}")
    return float(json.loads(proc.stdout[proc.stdout.index("["):])[0]["avg_ts"])


def _profile(llm, prompts: list, steps: int) -> None:
    """Where a decode step's time goes: the torch profiler over ``steps`` decode steps (the engine runs
    in this process), after a warm prefill, printed as the top operators by self CPU time."""
    import torch
    from vllm import SamplingParams

    # Two-token prompts: the prefill is a small part of what is profiled.
    prompts = [{"prompt_token_ids": p["prompt_token_ids"][:2]} for p in prompts]
    warm = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, warm, use_tqdm=False)
    run = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, detokenize=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, run, use_tqdm=False)
        wall = time.perf_counter() - t0
    print(f"PROFILE {steps} decode steps (+1 two-token prefill), batch {len(prompts)}: {wall:.2f} s wall, "
          f"{wall / (steps + 1) * 1e3:.0f} ms per step", file=sys.stderr)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40), file=sys.stderr)
    # The op per input shape: decode calls (M = batch) apart from the prefill's.
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("ternary_rs::")]
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:20]:
        print(f"OP {e.key} {e.input_shapes[:2]} calls {e.count} avg {e.self_cpu_time_total / e.count / 1e3:.3f} ms "
              f"total {e.self_cpu_time_total / 1e6:.2f} s", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where the checkpoint goes (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (64 = the real model; 4 to smoke-test)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens to time")
    ap.add_argument("--batch", default="1", help="batch sizes, comma-separated, run in one engine (e.g. 1,8,16)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-space-gib", type=float, default=None,
                    help="VLLM_CPU_KVCACHE_SPACE (default: the plugin sizes it for the largest --batch)")
    ap.add_argument("--eager", action="store_true",
                    help="enforce_eager (default: vLLM's default, torch.compile, as LLM(model) gives; compiling the "
                         "64 layers adds 5-10 minutes to each load here)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--rotation", choices=("rotated", "unrotated", "both"), default="rotated",
                    help="Bonsai 2's Hadamard rotation, a plain ternary qwen35 (the same weights, as upstream "
                         "llama.cpp runs it), or one after the other")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after timing, profile STEPS decode steps at the last batch size and print the top operators")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="turn vLLM's prefix caching off (on by default in vLLM; for a hybrid model it keeps two "
                         "recurrent-state pages per layer and sequence)")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also time upstream llama.cpp (LLAMA_CPP_BIN) on the unrotated weights as a TQ2_0 GGUF")
    ap.add_argument("--serve-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.llama_cpp and not os.environ.get("LLAMA_CPP_BIN"):
        sys.exit("--llama-cpp needs LLAMA_CPP_BIN (the folder with llama-bench: scripts/build_llama_cpp.sh)")
    if args.serve_child is not None:
        print("RESULT " + json.dumps(serve(args.serve_child, args.tokens, batches, args.max_model_len,
                                             not args.eager, args.profile, not args.no_prefix_caching)))
        return

    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_27b_"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt = root / f"bonsai2-27b-shaped-{args.layers}L"
    try:
        if not (ckpt / "config.json").is_file():
            t0 = time.perf_counter()
            build(ckpt, args.layers)
            print(f"built {ckpt} in {time.perf_counter() - t0:.0f} s")
        size = checkpoint_bytes(ckpt)
        params = parameters(args.layers)
        print(f"checkpoint: {params / 1e9:.2f} B parameters, {size / 2**30:.2f} GiB on disk "
              f"({8 * size / params:.3f} bits/weight; bf16 would be {2 * params / 2**30:.1f} GiB)")
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_cpu_op import stream_bandwidth

        threads = len(os.sched_getaffinity(0))
        bandwidth = stream_bandwidth(threads)
        # Bytes a decode step reads at batch 1: every ternary weight but the embedding (one row is gathered).
        per_token = size - VOCAB * (HIDDEN // 4 + HIDDEN // GROUP * 2)
        state = state_bytes(args.layers)
        print(f"streaming read bandwidth ({threads} threads): {bandwidth:.1f} GB/s; a decode step reads "
              f"{per_token / 1e9:.2f} GB of weights, and reads and writes {state / 1e9:.3f} GB of recurrent state "
              f"per sequence")
        variants = {"rotated": [ckpt], "unrotated": [unrotated_twin(ckpt, root / (ckpt.name + "-unrotated"))]}
        variants["both"] = variants["rotated"] + variants["unrotated"]
        batch1 = {model.name: run_one(args, model, batches, size, per_token, state, bandwidth)
                  for model in variants[args.rotation]}
        if args.llama_cpp:
            unrotated = variants["unrotated"][0]
            gguf_path = llama_cpp_gguf(unrotated, root / (unrotated.name + "-TQ2_0.gguf"))
            # Bracketed like our runs: which of this VM's bandwidth states llama.cpp ran in.
            before = stream_bandwidth(threads)
            theirs = llama_bench(gguf_path, args.tokens, threads)
            after = stream_bandwidth(threads)
            mean = (before + after) / 2
            print(f"== upstream llama.cpp, {gguf_path.name}, {threads} threads, batch 1: {theirs:.2f} tok/s "
                  f"(weights {theirs * per_token / 1e9:.2f} GB/s, counting our bytes per step: "
                  f"{theirs * per_token / 1e9 / mean:.0%} of the streaming bandwidth read right "
                  f"before / after it, {before:.1f} / {after:.1f} GB/s; with the recurrent state read and "
                  f"written: {theirs * (per_token + 2 * state) / 1e9 / mean:.0%})")
            for name, ours in batch1.items():
                if ours:
                    print(f"   {name} batch 1: {ours:.2f} tok/s = {ours / theirs:.2f}x llama.cpp (goal 1.8x)")
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def run_one(args, model: Path, batches: list[int], size: int, per_token: int, state: int,
            bandwidth: float) -> float | None:
    """Serve ``model`` in a fresh process and print its figures; returns the batch-1 decode tok/s (if timed)."""
    env = dict(os.environ)
    if args.kv_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_space_gib:g}"
    cmd = [sys.executable, __file__, "--serve-child", str(model), "--tokens", str(args.tokens), "--batch",
           ",".join(map(str, batches)), "--max-model-len", str(args.max_model_len), "--profile", str(args.profile)]
    cmd += ["--eager"] if args.eager else []
    cmd += ["--no-prefix-caching"] if args.no_prefix_caching else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    print(f"== {model.name}")
    # vLLM's own account of the KV cache (how many sequences it can run at once; vLLM logs to stdout) and
    # the plugin's settings line (Python logging, stderr).
    for line in (proc.stdout + proc.stderr).splitlines():
        if "Maximum concurrency" in line or "KV cache size" in line or "vLLM CPU settings" in line:
            print("vLLM:", line.split("] ", 1)[-1])
    if args.profile:
        print("\n".join(s for s in proc.stderr.splitlines() if not s.startswith(("INFO", "WARNING", "(EngineCore"))))
    line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"vLLM run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    r = json.loads(line[len("RESULT "):])
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    goal = 1.3 * size + r["kv_cache_bytes"]
    base = r["rss_before"]
    print(f"process before vLLM: RSS {gib(base['VmRSS'])} (Python, torch, vLLM and ternary_rs imported)")
    for phase in ("rss_loaded", "rss_served"):
        s = r[phase]
        print(f"{phase[4:]:>7}: peak RSS {gib(s['VmHWM'])} (now {gib(s['VmRSS'])}: anon {gib(s['RssAnon'])}, "
              f"file {gib(s['RssFile'])})")
    peak = r["rss_served"]["VmHWM"]
    print(f"peak RSS {gib(peak)} vs goal 1.3 x checkpoint + KV cache = {gib(goal)} "
          f"(ratio {peak / goal:.2f}; KV cache space {gib(r['kv_cache_bytes'])})")
    print(f"load {r['load_s']:.0f} s; {args.tokens} decode tokens per request")
    # "of streaming": against the start-up figure (torch.sum over 1 GiB, before loading) and against the
    # model's own weight pages read just before and after that batch size's timed run (their mean). "+ state":
    # the bytes a step moves with each sequence's recurrent state read and written back (``state_bytes``).
    print(f"{'batch':>5} {'first token s':>13} {'decode tok/s':>12} {'x batch 1':>9} {'weights GB/s':>12} "
          f"{'of streaming':>12} {'weight pages GB/s before/after':>30} {'of those':>8} {'+ state GB/s':>12} "
          f"{'of streaming':>12} {'of pages':>8}")
    one = next((x["decode_tok_per_s"] for x in r["runs"] if x["batch"] == 1), None)
    for x in r["runs"]:
        rate = x["decode_tok_per_s"]
        steps = rate / x["batch"]  # decode steps per second: each reads the weights once
        read = steps * per_token / 1e9
        moved = steps * (per_token + 2 * state * x["batch"]) / 1e9
        before, after = x["bandwidth"]
        pages = (before + after) / 2
        print(f"{x['batch']:>5} {x['ttft_s']:>13.2f} {rate:>12.2f} {(rate / one if one else float('nan')):>9.2f} "
              f"{read:>12.2f} {read / bandwidth:>12.0%} {f'{before:.1f} / {after:.1f}':>30} "
              f"{read / pages:>8.0%} {moved:>12.2f} {moved / bandwidth:>12.0%} {moved / pages:>8.0%}")
    return one


if __name__ == "__main__":
    main()
