"""Benchmark torch.ops.ternary_rs.ternary_linear (CPU, Rust SIMD kernel) against torch bf16 linear.

Decode shapes of a 27B model (in_features → out_features), M = 1, 4, 16, 128, on one and two threads
(``torch.set_num_threads`` and ``ternary_rs.set_num_threads`` together), all measured side by side in
one run. Reported per row: best-of-N wall time, GB/s of *packed* ternary weights (2 bits/weight: the
bytes the kernel streams, plus f16 scales not counted), G weights/s, and the speed ratio vs
``torch.nn.functional.linear`` on a bf16 weight of the same shape. Both the default exact mode (f32
accumulation) and the opt-in int8-activation mode are timed.

Usage: python benches/bench_cpu_op.py [--shapes 5120x6144,...] [--m 1,4,16,128] [--threads 1,2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import ternary_rs
from ternary_rs import _ops_cpu, ops

SHAPES = [(5120, 6144), (5120, 17408), (17408, 5120), (5120, 151936)]
GROUP = 128


def random_canonical(n: int, k: int, g: int):
    """Random canonical codes without code 3 (bytes with a 3 get that lane's high bit cleared)."""
    q = torch.randint(0, 256, (n, k // 4), dtype=torch.uint8)
    threes = q & (q >> 1) & 0x55
    q = q & ~(threes << 1)
    s = (torch.rand(n, k // g) * 0.05 + 0.01).half()
    return q, s


def best_time(fn, budget_s: float = 0.6, min_reps: int = 3, max_reps: int = 200) -> float:
    fn()  # warm up (allocations, page faults, thread pool)
    best, spent, reps = float("inf"), 0.0, 0
    while reps < min_reps or (spent < budget_s and reps < max_reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN list (in x out)")
    ap.add_argument("--m", default="1,4,16,128")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--budget", type=float, default=0.6, help="seconds of timing per measurement")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.m.split(",")]
    threads = [int(v) for v in args.threads.split(",")]

    print(f"CPU: {platform.processor() or platform.machine()}, kernel variant: {_ops_cpu.kernel_variant()} "
          f"(available: {', '.join(_ops_cpu.available_variants())}), torch {torch.__version__}, g = {GROUP}")
    hdr = (f"{'K->N':>13} {'M':>4} {'thr':>3} | {'torch bf16':>10} {'Gw/s':>6} | {'exact':>9} {'GB/s':>6} "
           f"{'Gw/s':>6} {'x torch':>7} | {'int8':>9} {'GB/s':>6} {'x torch':>7}")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for k, n in shapes:
        q, s = random_canonical(n, k, GROUP)
        qk, sk = ops.prepare_weight(q, s, GROUP)
        del q
        w_dense = torch.randn(n, k, dtype=torch.bfloat16)
        packed_bytes = n * k / 4
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            for t in threads:
                torch.set_num_threads(t)
                ternary_rs.set_num_threads(t)
                t_torch = best_time(lambda: torch.nn.functional.linear(x, w_dense), args.budget)
                with _ops_cpu.kernel_options(int8=False):
                    t_exact = best_time(lambda: ops.ternary_linear(x, qk, sk, n, k, GROUP, None), args.budget)
                with _ops_cpu.kernel_options(int8=True):
                    t_int8 = best_time(lambda: ops.ternary_linear(x, qk, sk, n, k, GROUP, None), args.budget)
                row = dict(k=k, n=n, m=m, threads=t, torch_ms=t_torch * 1e3, exact_ms=t_exact * 1e3,
                           int8_ms=t_int8 * 1e3, exact_gbps=packed_bytes / t_exact / 1e9,
                           int8_gbps=packed_bytes / t_int8 / 1e9, exact_vs_torch=t_torch / t_exact,
                           int8_vs_torch=t_torch / t_int8)
                rows.append(row)
                print(f"{f'{k}->{n}':>13} {m:>4} {t:>3} | {t_torch * 1e3:>8.2f}ms {n * k / t_torch / 1e9:>6.2f} | "
                      f"{t_exact * 1e3:>7.2f}ms {row['exact_gbps']:>6.2f} {n * k / t_exact / 1e9:>6.1f} "
                      f"{row['exact_vs_torch']:>6.2f}x | {t_int8 * 1e3:>7.2f}ms {row['int8_gbps']:>6.2f} "
                      f"{row['int8_vs_torch']:>6.2f}x", flush=True)
        del w_dense, qk, sk
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
