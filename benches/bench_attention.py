"""Decode attention over vLLM's paged CPU KV cache: ``ternary_rs::decode_attention`` against vLLM's own CPU
kernel (``_C::cpu_attention_with_kv_cache``), side by side in one run, and end to end in vLLM.

    python benches/bench_attention.py [--cases 64x2048,16x2048,1x16384] [--shapes 1.7b,27b] [--threads 2]
        [--budget 1.5] [--e2e MODEL_DIR --e2e-seqs 16 --e2e-context 1500]

1. Kernels. Per shape (``1.7b``: Qwen3-1.7B's 16 query / 8 KV heads of 128; ``27b``: Qwen3.5-27B's 24 / 4 of
   256), case ``SEQSxCONTEXT`` and thread count: the cache is written by vLLM's own ``reshape_and_cache``
   (its ``vec`` layout, blocks of 128 in shuffled order, bf16), then both kernels answer the same decode
   step (one query token per sequence). Reported: ms per call (median of round-robin runs of calls,
   ``timed_together`` of benches/bench_cpu_op.py), the KV bytes read per second and their fraction of the
   streaming read bandwidth (``torch.sum`` over 1 GiB), the speed-up, and the largest difference between
   the two outputs. Each case is sized past the last-level cache where the context allows (several copies
   of the cache are cycled), as a model's 28-64 layers are.
2. ``--e2e MODEL_DIR``: a ternary checkpoint served by ``vllm.LLM`` (vLLM's CPU defaults but reserved CPUs 0
   and threads bound, as ``ternary-rs serve`` sets them), ``--e2e-seqs`` sequences of ``--e2e-context``
   prompt tokens each decoding 64 tokens, with ternary_rs's decode kernel and with vLLM's
   (``TERNARY_RS_CPU_ATTENTION=vllm``), each in its own process: decode tokens/s (64-token runs less 1-token
   runs, so the short prefill of each cached prompt's last partial block is not counted), and how many
   sequences' greedy tokens are the same. (The two kernels' outputs differ by f32 rounding; on a random-weight
   bf16 model, whose top logits lie within one bf16 step of each other and often tie, greedy decoding
   follows such a difference within a few dozen tokens — in float32 the same model's tokens match.)

Timings on a shared machine are not results: run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_op import stream_bandwidth, timed_together  # noqa: E402

from ternary_rs.serving import ops  # noqa: E402

SHAPES = {"1.7b": (16, 8, 128), "27b": (24, 4, 256)}
BLOCK = 128
LLC_BYTES = 512 << 20  # larger than any last-level cache this runs on


def make_case(seqs: int, context: int, heads: int, kv_heads: int, head: int, gen: torch.Generator):
    """A cache holding ``seqs`` sequences of ``context`` tokens, written by vLLM's kernel; the step's query,
    metadata, and both outputs."""
    per_seq = -(-context // BLOCK)
    blocks = seqs * per_seq + 1
    cache = torch.zeros(blocks, kv_heads, BLOCK, 2 * head, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(blocks, kv_heads, 2 * BLOCK, head).chunk(2, dim=2)
    table = torch.randperm(blocks - 1, generator=gen)[: seqs * per_seq].view(seqs, per_seq).int()
    slots = (table.long()[:, :, None] * BLOCK + torch.arange(BLOCK)).view(seqs, -1)[:, :context].reshape(-1)
    for part in slots.split(1 << 16):  # bounded temporaries
        k = torch.randn(part.numel(), kv_heads, head, generator=gen).bfloat16()
        v = torch.randn(part.numel(), kv_heads, head, generator=gen).bfloat16()
        torch.ops._C.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, part, "vec", 1.0, 1.0, "auto")
    q = torch.randn(seqs, heads, head, generator=gen).bfloat16()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    starts = torch.arange(seqs + 1, dtype=torch.int32)
    return dict(cache=cache, keys=key_cache, values=value_cache, table=table, q=q, lens=lens, starts=starts,
                ours=torch.empty_like(q), theirs=torch.empty_like(q))


def kernel_table(args) -> None:
    from vllm import _custom_ops as vops

    vllm_attention = torch.ops._C.cpu_attention_with_kv_cache.default
    ours_op = torch.ops.ternary_rs.decode_attention.default
    assert ops.NATIVE_ATTENTION_UNAVAILABLE is None, ops.NATIVE_ATTENTION_UNAVAILABLE
    gen = torch.Generator().manual_seed(0)
    for threads in [int(t) for t in args.threads.split(",")]:
        bw = stream_bandwidth(threads, huge_pages=False)
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s), streaming read bandwidth {bw:.1f} GB/s (torch.sum, 1 GiB, 4 KiB pages)")
        print(f"{'shape':>5} {'case':>10} {'KV MB':>7} | {'vLLM ms':>8} {'GB/s':>6} {'of bw':>6} | "
              f"{'ours ms':>8} {'GB/s':>6} {'of bw':>6} | {'speed-up':>8} {'max diff':>9}")
        for shape in args.shapes.split(","):
            heads, kv_heads, head = SHAPES[shape]
            for case in args.cases.split(","):
                seqs, context = (int(x) for x in case.split("x"))
                kv_bytes = seqs * context * kv_heads * head * 2 * 2
                copies = max(1, min(4, -(-LLC_BYTES // kv_bytes)))
                cases = [make_case(seqs, context, heads, kv_heads, head, gen) for _ in range(copies)]
                scale = head ** -0.5
                for c in cases:
                    c["meta"] = vops.cpu_attn_get_scheduler_metadata(
                        num_reqs=seqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head, seq_lens=c["lens"],
                        dtype=torch.bfloat16, query_start_loc=c["starts"], causal=True, sliding_window_size=-1,
                        isa="vec", enable_kv_split=True, dynamic_causal=None, kv_cache_dtype="auto")

                def theirs(i, cs=cases, scale=scale):
                    c = cs[i]
                    vllm_attention(c["q"], c["keys"], c["values"], c["theirs"], c["starts"], c["lens"], scale, True,
                                   None, -1, c["table"], 0.0, c["meta"], None, None, 1.0, 1.0, "auto")

                def ours(i, cs=cases, scale=scale):
                    c = cs[i]
                    ours_op(c["ours"], c["q"], c["cache"], c["lens"], c["table"], scale, -1, 0.0)

                t = timed_together({"vllm": (theirs, copies, None), "ours": (ours, copies, None)}, args.budget)
                diff = max((c["ours"].float() - c["theirs"].float()).abs().max().item() for c in cases)
                tv, to = t["vllm"][0], t["ours"][0]
                gv, go = kv_bytes / tv / 1e9, kv_bytes / to / 1e9
                print(f"{shape:>5} {case:>10} {kv_bytes / 1e6:7.1f} | {tv * 1e3:8.2f} {gv:6.1f} {gv / bw:6.0%} | "
                      f"{to * 1e3:8.2f} {go:6.1f} {go / bw:6.0%} | {tv / to:7.2f}x {diff:9.2e}", flush=True)
                del cases


E2E = r"""
import os, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    model, seqs, context, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model, dtype="bfloat16", max_model_len=context + tokens + 16, max_num_seqs=max(seqs, 16))
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 5000 + 10 for j in range(context)]} for i in range(seqs)]
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # prefill once: the prompts stay cached

    def best(n):
        # a cached prompt's partial last block is computed again (a short prefill step): timing 1 token and
        # n tokens, their difference is n - 1 decode steps
        sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
        times = []
        for _ in range(2):
            t = time.perf_counter()
            out = llm.generate(prompts, sp, use_tqdm=False)
            times.append(time.perf_counter() - t)
        return min(times), out

    (t1, _), (tn, out) = best(1), best(tokens)
    print("RESULT", seqs * (tokens - 1) / (tn - t1), [list(o.outputs[0].token_ids) for o in out], flush=True)
"""


def e2e(args) -> None:
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    results = {}
    for name, kernel in (("ternary_rs", ""), ("vLLM", "vllm")):
        out = subprocess.run([sys.executable, "-c", E2E, str(args.e2e), str(args.e2e_seqs), str(args.e2e_context),
                              "64"], env=dict(env, TERNARY_RS_CPU_ATTENTION=kernel), capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
        if line is None:
            sys.exit(f"{name} run failed:\n{out.stderr[-3000:]}")
        rate, tokens = line.split(" ", 2)[1:]
        results[name] = (float(rate), tokens)
        print(f"  decode with {name}'s attention: {float(rate):.1f} tok/s", flush=True)
    ours, theirs = (ast.literal_eval(results[k][1]) for k in ("ternary_rs", "vLLM"))
    same = sum(a == b for a, b in zip(ours, theirs))
    first = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(ours, theirs) if a != b]
    print(f"  {args.e2e_seqs} sequences x {args.e2e_context} tokens of context: ternary_rs / vLLM "
          f"{results['ternary_rs'][0] / results['vLLM'][0]:.2f}x; greedy tokens: {same} of {len(ours)} sequences "
          f"identical" + (f", the others from step {min(first)} on" if first else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="64x128,64x2048,16x2048,1x16384")
    ap.add_argument("--shapes", default="1.7b,27b")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--budget", type=float, default=1.5)
    ap.add_argument("--e2e", type=Path, help="a ternary checkpoint directory for the end-to-end A/B")
    ap.add_argument("--e2e-seqs", type=int, default=16)
    ap.add_argument("--e2e-context", type=int, default=1500)
    args = ap.parse_args()
    kernel_table(args)
    if args.e2e:
        print(f"\nend to end ({args.e2e}):")
        e2e(args)


if __name__ == "__main__":
    main()
