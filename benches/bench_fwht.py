"""FWHT benchmark: ``torch.ops.ternary_rs.fwht`` (Rust, CPU) against two plain-torch ways of doing the same
Bonsai 2 activation rotation, measured side by side in one run:

* ``torch-butterfly``: :func:`ternary_rs.core.hadamard.fwht_torch` (log2(b) reshape/stack stages),
* ``torch-matmul``: ``(x·s).view(-1, b) @ H_b/√b`` (dense Hadamard matrix, what a naive port does).

Shapes are Bonsai 2's input widths (5120, 6144, 17408; block 1024) for decode (1 row) to prefill batches.
Prints median times and the speed-up of the Rust op over each torch way. On a GPU machine the CUDA op is
timed the same way against the same torch baselines.

    python benches/bench_fwht.py [--threads N] [--rows 1,16,256] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import ternary_rs
from ternary_rs import ops  # noqa: F401 - registers torch.ops.ternary_rs.fwht
from ternary_rs.core import hadamard as H


def timed(fn, repeat: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="ternary_rs threads (0 = all cores)")
    ap.add_argument("--rows", default="1,16,256")
    ap.add_argument("--widths", default="5120,6144,17408")
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    ternary_rs.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    block = args.block
    hmat = torch.from_numpy(H.sylvester(block)).to(torch.float32) / math.sqrt(block)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"threads={ternary_rs.get_num_threads()} torch_threads={torch.get_num_threads()} dtype={args.dtype} "
          f"block={block}")
    print(f"{'dev':5} {'rows':>5} {'width':>6} {'ternary_rs':>11} {'butterfly':>11} {'matmul':>11} "
          f"{'x butterfly':>11} {'x matmul':>9}")
    for dev in devices:
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        hm = hmat.to(dev)
        for rows in (int(r) for r in args.rows.split(",")):
            for width in (int(w) for w in args.widths.split(",")):
                x = torch.randn(rows, width, device=dev).to(dtype)
                s = (torch.randint(0, 2, (width,), device=dev) * 2 - 1).to(torch.float32)

                def ours():
                    return torch.ops.ternary_rs.fwht(x, block, s, False, None)

                def butterfly():
                    return H.fwht_torch(x, block, s)

                def matmul():
                    y = (x.to(torch.float32) * s).view(-1, block) @ hm
                    return y.view(rows, width).to(dtype)

                torch.testing.assert_close(ours().float(), matmul().float(), atol=0.05, rtol=0.02)
                t_ours, t_bf, t_mm = (timed(f, args.repeat, sync) for f in (ours, butterfly, matmul))
                print(f"{dev:5} {rows:5d} {width:6d} {t_ours * 1e6:9.1f}us {t_bf * 1e6:9.1f}us "
                      f"{t_mm * 1e6:9.1f}us {t_bf / t_ours:10.2f}x {t_mm / t_ours:8.2f}x")


if __name__ == "__main__":
    main()
