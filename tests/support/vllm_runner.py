"""Runs vLLM (CPU build) in its own process for the vLLM tests and benches (test_vllm.py, bench_vllm.py, …).

    python tests/support/vllm_runner.py --model DIR [DIR …] --out OUT.json [--tp 2] [--eager] [--dtype float32]
        [--prompts-json FILE] [--max-tokens 12] [--dump-weights DIR] [--quantization ternary]
        [--speculative-config JSON]
    python tests/support/vllm_runner.py --load-probe --model DIR [DIR …] --out OUT.json

Several models are served one after another in this one process (each engine shut down before the next
starts: the imports and process start, ~30 s on 2 cores, are paid once); OUT.json then holds
``{"runs": [one result per model, in order]}``. For one model OUT.json is its result: greedy generations
(token ids + top logprobs) of the prompts, the quant method of every module, load time, and with --speculative-config vLLM's speculative-decoding counters (``spec_decode``: drafts,
draft tokens, accepted tokens); with --dump-weights, every ternary layer's weights as seen *through vLLM* (linear /
lm_head: ``quant_method.apply(layer, I_K)`` = W_shard.T through the real op; embeddings: the lookup of
every row of the shard; MoE experts: ``<layer>.w13`` ``[E, 2I, H]`` and ``<layer>.w2`` ``[E, H, I]``, each
expert through the op's exact mode on the identity) to ``DIR/rank<r>.npz``. The ``__main__`` guard is required: vLLM starts worker
processes with ``spawn``.

With --load-probe (tests/test_vllm_hostile.py): for each directory, in order, one ``vllm.LLM(...)`` in this
process (engine in-process) and, if it loads, one greedy token: OUT.json gets ``[{"model", "ok", "error",
"text"}]``, rewritten after every case so a crash keeps the earlier results. ``error`` is
``"<type>: <message>"`` of the exception and its causes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import time
import traceback


def cpu_env(tp: int) -> None:
    """vLLM CPU settings for a small shared machine. For TP > 1 the reserved cores and the per-rank
    thread binding are left to the plugin's defaults (``ternary_rs.serving.cpu``), as a user gets them:
    vLLM's own ``auto`` binding refuses two ranks on this one-NUMA-node machine."""
    ncpu = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp == 1:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{ncpu - 1}" if ncpu > 1 else "0")
    # One process fewer to start (~20 s on 2 cores) when there is a single worker.
    if tp == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The weight dump sends a function to the workers (cloudpickle).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def attention_impls(model) -> list[str]:
    """Worker side: the class names of the model's attention impls (which backend vLLM built)."""
    return sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl") and hasattr(m, "kv_cache")})


def dump_weights(model, out_dir: str):
    """Worker side: each ternary layer's shard as dequantized by the serving path."""
    import numpy as np
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from ternary_rs.vllm.dense import dense_cpu_linear
    from ternary_rs.vllm.embedding import TernaryEmbeddingMethod
    from ternary_rs.vllm.linear import TernaryLinearMethod

    rank = get_tensor_model_parallel_rank()
    arrays, methods, activations, dense_kernel = {}, {}, {}, []
    with torch.no_grad():
        for name, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if qm is None:
                continue
            methods[name] = type(qm).__name__
            if getattr(module, "cpu_linear", None) is dense_cpu_linear:  # ternary_rs.dense_linear
                dense_kernel.append(name)
            if hasattr(module, "ternary_activations"):  # the op's activation mode this layer asks for
                activations[name] = int(module.ternary_activations)
            if isinstance(qm, TernaryLinearMethod) or (
                isinstance(qm, TernaryEmbeddingMethod) and isinstance(module, ParallelLMHead)
            ):
                eye = torch.eye(module.ternary_in_features, dtype=torch.float32)
                arrays[name] = qm.apply(module, eye).T.contiguous().numpy()
            elif isinstance(qm, TernaryEmbeddingMethod):
                ids = torch.arange(module.ternary_out_features)
                arrays[name] = qm.embedding(module, ids).float().numpy()
            elif type(qm).__name__ == "TernaryMoEMethod":
                arrays[name + ".w13"], arrays[name + ".w2"] = moe_expert_weights(module)
    os.makedirs(out_dir, exist_ok=True)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays)
    return {"rank": rank, "methods": methods, "activations": activations, "dense_kernel": dense_kernel}


def moe_expert_weights(layer):
    """A ternary MoE layer's expert shards as the op serves them: ``[E, 2I, H]`` (gate rows, then up) and
    ``[E, H, I]``, each expert's prepared weight applied to the identity in the op's exact mode."""
    import numpy as np
    import torch

    from ternary_rs.serving import ops

    hidden, inter = layer.ternary_hidden_size, layer.ternary_intermediate_size

    def dense(q, s, n, k, g):
        eye = torch.eye(k, dtype=torch.float32)
        return np.stack([ops.ternary_linear(eye, q[e], s[e], n, k, g, None, ops.EXACT).T.numpy() for e in range(len(q))])

    return (dense(layer.w13_qweight, layer.w13_scales, 2 * inter, hidden, layer.ternary_w13_group_size),
            dense(layer.w2_qweight, layer.w2_scales, hidden, inter, layer.ternary_w2_group_size))


def spec_decode_counters(llm) -> dict:
    """vLLM's speculative-decoding counters (``vllm:spec_decode_num_*`` metrics, summed over engines)."""
    out: dict = {}
    for metric in llm.get_metrics():
        name = getattr(metric, "name", "")
        if name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            key = name[len("vllm:spec_decode_num_"):]
            out[key] = out.get(key, 0) + int(metric.value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--prompts-json", default=None)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--dump-weights", default=None)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="vLLM CPU: hybrid (Mamba/GDN) prefix caching's 'align' mode needs Triton with speculation")
    ap.add_argument("--speculative-config", default=None, help='e.g. \'{"method": "mtp", "num_speculative_tokens": 1}\'')
    # Benchmark mode: decode throughput for a batch of prompts.
    ap.add_argument("--bench-batch", default="", help="comma-separated batch sizes, e.g. 1,16")
    ap.add_argument("--bench-tokens", type=int, default=64)
    ap.add_argument("--load-probe", action="store_true", help="only load each model and record what happened")
    args = ap.parse_args()
    if args.load_probe:
        cpu_env(1)
        probe_loads(args.model, args.out)
        return
    if args.dump_weights and len(args.model) > 1:
        ap.error("--dump-weights takes one --model")
    cpu_env(args.tp)
    runs = []
    for i, model in enumerate(args.model):
        runs.append(serve_model(args, model, last=i == len(args.model) - 1))
        if i < len(args.model) - 1:
            free_process_state()
    with open(args.out, "w") as f:
        json.dump(runs[0] if len(runs) == 1 else {"runs": runs}, f)


def free_process_state() -> None:
    """After an engine was shut down and dropped: free what vLLM keeps per process (distributed groups,
    cached memory), so that another ``LLM`` can start in this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def serve_model(args, model: str, last: bool = True) -> dict:
    """Start an engine for ``model`` and run what ``args`` ask for; the result dict. Unless ``last``, the
    engine is shut down before returning (the last one ends with the process, as it always did)."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        tensor_parallel_size=args.tp,
        enforce_eager=args.eager,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        max_num_seqs=32,
        seed=0,
        speculative_config=json.loads(args.speculative_config) if args.speculative_config else None,
        disable_log_stats=not args.speculative_config,
        enable_prefix_caching=False if args.no_prefix_caching else None,
    )
    result: dict = {"load_s": time.perf_counter() - t0}
    cfg = llm.llm_engine.vllm_config
    result["compilation_mode"] = str(cfg.compilation_config.mode)
    result["cpp_wrapper"] = bool(cfg.compilation_config.inductor_compile_config.get("cpp_wrapper", False))
    result["quantization"] = cfg.model_config.quantization
    result["dtype"] = str(cfg.model_config.dtype)
    import vllm_runner  # by reference to this file as a module, so the spawned workers can import it

    result["attention_impls"] = sorted({name for names in llm.apply_model(vllm_runner.attention_impls) for name in names})

    if args.dump_weights:
        result["workers"] = llm.apply_model(functools.partial(vllm_runner.dump_weights, out_dir=args.dump_weights))

    if args.prompts_json:
        with open(args.prompts_json) as f:
            prompts = json.load(f)
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=args.logprobs, ignore_eos=True)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        result["outputs"] = [
            {
                "prompt_token_ids": list(o.prompt_token_ids),
                "token_ids": list(o.outputs[0].token_ids),
                "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
                "text": o.outputs[0].text,
            }
            for o in outs
        ]

    if args.speculative_config:
        result["spec_decode"] = spec_decode_counters(llm)

    if args.bench_batch:
        llm.generate([{"prompt_token_ids": [5, 9, 11]}], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        result["bench"] = []
        for batch in (int(b) for b in args.bench_batch.split(",")):
            prompts = [{"prompt_token_ids": [5 + (i % 7), 9, 11 + i % 3]} for i in range(batch)]
            # The same batch once untimed: shapes compiled lazily for this batch size are not timed.
            llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            sp = SamplingParams(temperature=0.0, max_tokens=args.bench_tokens, ignore_eos=True)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            result["bench"].append({"batch": batch, "tokens": generated, "seconds": dt, "tok_per_s": generated / dt})

    if not last:
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
    return result


def describe(e: BaseException) -> str:
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def probe_loads(models: list[str], out_path: str) -> None:
    """--load-probe: load each model in this process, one greedy token if it loads; record every outcome."""
    from vllm import LLM, SamplingParams

    results = []
    for model in models:
        entry = {"model": model, "ok": False, "error": None, "text": None}
        try:
            llm = LLM(model=model, max_model_len=128, enforce_eager=True, dtype="float32", max_num_seqs=4, seed=0)
            out = llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            entry.update(ok=True, text=out[0].outputs[0].text)
            del llm
        except BaseException as e:  # noqa: BLE001 - recording every outcome is the point
            entry["error"] = describe(e)
            entry["traceback"] = traceback.format_exc()[-4000:]
        gc.collect()
        results.append(entry)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
