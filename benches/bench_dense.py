"""A ternary model's dense bf16 layers on the CPU: ``torch.ops.ternary_rs.dense_linear`` against what vLLM CPU
runs for them otherwise, side by side in one run.

    python benches/bench_dense.py [--shapes 2560x128256,...] [--m 1,4,16,64] [--threads 1,2] [--budget 1.0]

Ternary checkpoints keep their embeddings / tied ``lm_head`` (BitNet b1.58 2B4T: 2560 → 128 256) or small
projections (Qwen3.5's ``in_proj_ba``: 5120 → 96) dense. vLLM CPU multiplies them with oneDNN where oneDNN
takes bf16 (AVX512_BF16 / AMX), else with ``torch.nn.functional.linear`` — the ``torch`` column here, which
on such CPUs converts element by element. Per shape, M and thread count: milliseconds (median of
round-robin runs of calls, ``timed_together`` of benches/bench_cpu_op.py), GB/s of the bf16 weight and its fraction of
the streaming bandwidth (the bound at M = 1), G weight-tokens/s, and the speed-up over torch. Weights are
cold: each side cycles through copies that together exceed the last-level cache; ours are on 2 MiB pages, where
the plugin moves a weight it routes to the kernel (``ternary_rs.serving.hugepages``), torch's on its own pages,
as vLLM holds them; the streaming bandwidth is measured on 2 MiB pages.

``vLLM's path`` says what vLLM would use on this CPU (``onednn`` where it accepts bf16; there the plugin
leaves the layer alone and this bench only shows the kernel).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_op import stream_bandwidth, timed_together  # noqa: E402

from ternary_rs.serving import hugepages, ops  # noqa: E402

LLC_BYTES = 512 << 20  # larger than any last-level cache this runs on (the AMX machine's L3 is 480 MiB)


def vllm_path() -> str:
    try:
        from vllm import _custom_ops as vops

        vops.create_onednn_mm(torch.zeros(64, 64, dtype=torch.bfloat16).t(), 32)
        return "onednn"
    except Exception:  # noqa: BLE001 - vLLM's own fallback condition
        return "torch F.linear (oneDNN refuses bf16 here)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048x151936,2560x128256,5120x96", help="KxN list (in x out)")
    ap.add_argument("--m", default="1,4,16,64")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds per (shape, M, threads)")
    ap.add_argument("--torch-max-m", type=int, default=16, help="skip torch above this M (minutes per call)")
    args = ap.parse_args()
    print(f"vLLM's path for dense bf16 layers on this CPU: {vllm_path()}; native dense op: "
          f"{ops.NATIVE_DENSE_UNAVAILABLE is None}")
    threads_list = [int(t) for t in args.threads.split(",")]
    bw = {t: stream_bandwidth(t) for t in threads_list}
    for t in threads_list:
        print(f"streaming read bandwidth, {t} thread(s): {bw[t]:.1f} GB/s")
    print(f"{'K x N':>14} {'M':>4} {'thr':>3} {'ours ms':>9} {'GB/s':>6} {'%bw':>5} {'Gwt/s':>6} "
          f"{'torch ms':>9} {'x torch':>7}")
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.lower().split("x"))
        nbytes = n * k * 2
        copies = max(1, -(-LLC_BYTES // nbytes))
        ws = [(torch.randn(n, k) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        # Ours where the plugin puts a routed weight (huge pages); torch's as vLLM holds it.
        ours_ws = [hugepages.copy_of(w) for w in ws]
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k).to(torch.bfloat16)
            for t in threads_list:
                torch.set_num_threads(t)
                fns = {"ours": (lambda i: ops.dense_linear(x, ours_ws[i]), copies, None)}
                if m <= args.torch_max_m:
                    fns["torch"] = (lambda i: torch.nn.functional.linear(x, ws[i]), copies, None)
                res = timed_together(fns, args.budget)
                ours = res["ours"][0]
                gbs = nbytes / ours / 1e9
                line = (f"{k:>6} x {n:<6} {m:>4} {t:>3} {ours * 1e3:>9.2f} {gbs:>6.1f} {gbs / bw[t] * 100:>5.1f} "
                        f"{m * n * k / ours / 1e9:>6.1f}")
                if "torch" in res:
                    line += f" {res['torch'][0] * 1e3:>9.2f} {res['torch'][0] / ours:>7.2f}"
                else:
                    line += f" {'-':>9} {'-':>7}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
