"""GPU benchmark of the fused ternary kernels vs cuBLAS bf16 (``torch.nn.functional.linear``), side by side.

For the 27B-class shapes (in -> out) 5120->6144, 5120->17408, 17408->5120, 5120->151936 and M = 1, 4, 16, 64,
512, 2048 it prints, per row: the kernel the plan picked (and its K-splits), µs per call, effective GB/s
(bytes the op must move: ternary codes + f16 scales + x + y, plus the f32 split-K partials it writes and
reads back when the plan splits K), that as a fraction of the datasheet HBM bandwidth (H200: 4.8 TB/s,
override with --hbm-tbps) and of the achievable peak measured in the same run (a device-to-device copy
of 1 GiB, read + write), the cuBLAS bf16 time and the speed-up over it. Targets checked at the end:
M <= 16 at >= 85 % of HBM, >= 6x cuBLAS at M = 1, >= 0.8x cuBLAS at M >= 512.

Timing: each side runs as one CUDA graph of many calls (launch overhead as in vLLM's captured decode),
rotating over enough weight copies (> 2x L2) that weights come from HBM, timed with CUDA events; the
median of several replays is reported. A correctness spot check against the dequantized bf16 weight
runs first for every shape. First of all it times the per-call host overhead of the natively registered
op at 1x1024->1024 against the Python path and the bare launcher. Uses only torch and ternary_rs (runs on
the bare GPU machine).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from ternary_rs import _core
from ternary_rs.serving import _ops_cuda, ops

SHAPES = [(5120, 6144), (5120, 17408), (17408, 5120), (5120, 151936)]
M_VALUES = [1, 4, 16, 64, 512, 2048]
ROTATE_BYTES = 256 << 20  # weights cycled per graph: several times the H200's 60 MB L2


def random_layer(n: int, k: int, g: int, device: str):
    gen = torch.Generator(device=device).manual_seed(n * 31 + k)
    codes = torch.randint(0, 3, (n, k // 4, 4), generator=gen, device=device, dtype=torch.uint8)
    packed = (codes << torch.tensor([0, 2, 4, 6], device=device, dtype=torch.uint8)).sum(-1).to(torch.uint8)
    scales = (torch.rand(n, k // g, generator=gen, device=device) * 0.02 + 0.001).to(torch.float16)
    return packed, scales


def dequantize_bf16(packed: torch.Tensor, scales: torch.Tensor, g: int) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], device=packed.device, dtype=torch.uint8)
    codes = ((packed[..., None] >> shifts) & 3).reshape(packed.shape[0], -1).to(torch.bfloat16) - 1
    return (codes * scales.to(torch.bfloat16).repeat_interleave(g, dim=1)).contiguous()


def relative_error(x, q_k, s_k, w_bf16, n: int, k: int, g: int) -> float:
    """Relative error of ``ops.ternary_linear`` on the prepared weight against fp32 ``x @ W.T``."""
    y = ops.ternary_linear(x, q_k, s_k, n, k, g)
    ref = torch.nn.functional.linear(x.float(), w_bf16.float())
    return float((y.float() - ref).norm() / ref.norm())


def time_graph(fn, copies: int, calls: int, replays: int, device: str = "cuda") -> float:
    """Median µs per call of `calls` invocations fn(i % copies) captured in one CUDA graph (on the CPU, for
    the --device cpu dry run of this script's logic: plain wall-clock timing)."""
    if device != "cuda":
        times = []
        for _ in range(replays):
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i % copies)
            times.append((time.perf_counter() - t0) * 1e6 / calls)
        return statistics.median(times)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(copies, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(i % copies)
    graph.replay()  # warm-up replay
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    torch.cuda.empty_cache()
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Achievable DRAM bandwidth (bytes/s): a 1 GiB device-to-device copy (read + write), median of 5."""
    if device != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / statistics.median(times)


def dispatch_overhead(calls: int = 2000, rounds: int = 5) -> dict:
    """Host µs per eager call at 1x1024->1024 (launch-bound: the kernel itself takes a few µs): the
    native op, the Python path it replaced, and the launcher called directly from Python with everything
    preallocated (one PyO3 call + one kernel launch: the floor). Rounds interleave the three; min per side."""
    n = k = 1024
    g = 128
    packed, scales = random_layer(n, k, g, "cuda")
    q_k, s_k = ops.prepare_weight(packed, scales, g)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    stream = torch.cuda.current_stream().cuda_stream
    plan = _core.cuda_plan(1, n, k, g, sm)
    partials = torch.empty(max(plan["partial_floats"], 1), dtype=torch.float32, device="cuda")
    counters = torch.zeros(max(plan["counters"], 8 * sm + 64), dtype=torch.int32, device="cuda")
    sides = {
        "native op": lambda: torch.ops.ternary_rs.ternary_linear(x, q_k, s_k, n, k, g),
        "Python path": lambda: _ops_cuda.ternary_linear(x, q_k, s_k, n, k, g),
        "launcher": lambda: _core.cuda_ternary_linear(
            x.data_ptr(), q_k.data_ptr(), s_k.data_ptr(), 0, y.data_ptr(), partials.data_ptr(), partials.numel(),
            counters.data_ptr(), counters.numel(), 1, n, k, g, "bfloat16", sm, stream),
    }
    best = {name: math.inf for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    best["native overhead"] = best["native op"] - best["launcher"]
    print("per-call host time at 1x1024->1024 (min of interleaved rounds): " + ", ".join(
        f"{name} {us:.2f} us" for name, us in best.items()) + " (goal: native overhead <= 5 us)")
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the fraction column")
    ap.add_argument("--m", type=int, nargs="*", default=M_VALUES)
    ap.add_argument("--quick", action="store_true", help="fewer calls per graph")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--device", default="cuda", help="cpu: dry run of this script's logic on small shapes")
    ap.add_argument("--gemv-max-m", type=int, default=None, help="GEMV cut-off for the main rows (default: built-in 8)")
    ap.add_argument("--no-alt", action="store_true",
                    help="skip the extra rows that time M = 16 on the other kernel (decode GEMV with cut-off 16)")
    args = ap.parse_args()
    dev = args.device
    shapes, ms = SHAPES, args.m
    if dev == "cpu":
        shapes, ms = [(256, 96), (512, 320)], [1, 16, 64]
    elif not torch.cuda.is_available():
        print("bench_gpu: no CUDA device", file=sys.stderr)
        return 2
    if not _core.cuda_available():
        print("bench_gpu: this ternary_rs build has no CUDA kernels", file=sys.stderr)
        return 2
    if args.gemv_max_m is not None:
        _ops_cuda.set_gemv_max_m(args.gemv_max_m)
    if dev == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, sm_count = props.name, props.multi_processor_count
    else:
        name, sm_count = "CPU (dry run)", 132
    g = args.group_size
    hbm = args.hbm_tbps * 1e12
    peak = copy_bandwidth(dev)
    print(f"device: {name}, {sm_count} SMs; torch {torch.__version__}; g = {g}; "
          f"HBM {args.hbm_tbps} TB/s datasheet, {peak / 1e12:.2f} TB/s achievable (D2D copy, same run)")
    overhead = dispatch_overhead() if dev == "cuda" else None
    header = (f"{'K->N':>14} {'M':>5} {'plan':>12} {'ternary us':>11} {'GB/s':>8} {'%HBM':>6} {'%copy':>6} "
              f"{'cuBLAS us':>10} {'cuBLAS GB/s':>11} {'speed-up':>9}")
    print(header)
    rows = []
    for k, n in shapes:
        packed, scales = random_layer(n, k, g, dev)
        q_k, s_k = ops.prepare_weight(packed, scales, g)
        w_bf16 = dequantize_bf16(packed, scales, g)
        del packed, scales
        # Correctness spot check of both kernels' paths on this shape.
        for m in (1, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            rel = relative_error(x, q_k, s_k, w_bf16, n, k, g)
            if not rel < 1e-2:
                print(f"bench_gpu: WRONG RESULT for K={k} N={n} M={m}: relative error {rel:.3g}", file=sys.stderr)
                return 1
        tern_bytes_w = q_k.numel() + s_k.numel() * 2
        t_copies = max(1, min(64, math.ceil(ROTATE_BYTES / tern_bytes_w)))
        b_copies = max(1, min(8, math.ceil(ROTATE_BYTES / (w_bf16.numel() * 2))))
        tq = [q_k] + [q_k.clone() for _ in range(t_copies - 1)]
        ts = [s_k] + [s_k.clone() for _ in range(t_copies - 1)]
        wb = [w_bf16] + [w_bf16.clone() for _ in range(b_copies - 1)]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            out_bytes = m * n * 2
            calls = 4 if out_bytes > (256 << 20) else (8 if args.quick else 32)
            if m <= 16 and not args.quick:
                calls = 200
            replays = 5
            c_us = time_graph(lambda i: torch.nn.functional.linear(x, wb[i]), b_copies, calls, replays, dev)
            c_gbps = (n * k * 2 + m * k * 2 + m * n * 2) / (c_us * 1e-6) / 1e9
            # Main row with the configured cut-off; for 8 < M <= 16 also the other kernel (tuning data).
            variants = [None]
            if 8 < m <= 16 and not args.no_alt:
                variants.append(16 if _core.cuda_plan(m, n, k, g, sm_count)["kernel"] != "gemv" else 8)
            if m >= 512 and not args.no_alt:
                variants.append("dequant")  # dequantize to bf16 + cuBLAS (opt-in path), timed for comparison
            for alt in variants:
                prev = None
                if alt == "dequant":
                    prev_deq = _ops_cuda.set_dequant_min_m(m)
                elif alt is not None:
                    prev = _ops_cuda.set_gemv_max_m(alt)
                try:
                    if alt is not None:  # the other kernel must agree with the reference too
                        rel = relative_error(x, q_k, s_k, w_bf16, n, k, g)
                        if not rel < 1e-2:
                            print(f"bench_gpu: WRONG RESULT ({alt}) K={k} N={n} M={m}: {rel:.3g}", file=sys.stderr)
                            return 1
                    plan = _core.cuda_plan(m, n, k, g, sm_count)
                    # Each dequantizing call holds a temporary W in the graph's pool: fewer calls for huge W.
                    n_calls = min(calls, 4) if alt == "dequant" and n * k * 2 > (256 << 20) else calls
                    t_us = time_graph(lambda i: ops.ternary_linear(x, tq[i], ts[i], n, k, g), t_copies, n_calls,
                                      replays, dev)
                finally:
                    if prev is not None:
                        _ops_cuda.set_gemv_max_m(prev)
                    if alt == "dequant":
                        _ops_cuda.set_dequant_min_m(prev_deq)
                # Split-K partials: each f32 partial is written once and read back once by the reducer.
                partial_bytes = 2 * 4 * plan["partial_floats"] if plan["splits"] > 1 and alt != "dequant" else 0
                moved = tern_bytes_w + m * k * 2 + m * n * 2 + partial_bytes
                gbps = moved / (t_us * 1e-6) / 1e9
                row = dict(k=k, n=n, m=m, kernel="deq+cuBLAS" if alt == "dequant" else plan["kernel"],
                           splits=plan["splits"], partial_bytes=partial_bytes, ternary_us=t_us,
                           gbps=gbps, hbm_fraction=gbps * 1e9 / hbm, copy_fraction=gbps * 1e9 / peak,
                           cublas_us=c_us, cublas_gbps=c_gbps, speedup=c_us / t_us, alternative=alt is not None)
                rows.append(row)
                tag = "deq+cuBLAS*" if alt == "dequant" else (
                    plan["kernel"] + "/" + str(plan["splits"]) + ("*" if alt is not None else ""))
                print(f"{f'{k}->{n}':>14} {m:>5} {tag:>12} {t_us:>11.1f} "
                      f"{gbps:>8.0f} {100 * row['hbm_fraction']:>5.0f}% {100 * row['copy_fraction']:>5.0f}% "
                      f"{c_us:>10.1f} {c_gbps:>11.0f} "
                      f"{row['speedup']:>8.2f}x", flush=True)
        tq = ts = wb = q_k = s_k = w_bf16 = None  # free this shape's copies before the next
        if dev == "cuda":
            torch.cuda.empty_cache()

    print("\n(* = alternative path for this M, timed for tuning: the other kernel around the GEMV cut-off, or "
          "deq+cuBLAS = dequantize to bf16 + cuBLAS, opt-in via _ops_cuda.set_dequant_min_m; not counted below)")
    print("targets:")
    rows_main = [r for r in rows if not r["alternative"]]
    checks = [
        ("M <= 16 at >= 85% of HBM", [r for r in rows_main if r["m"] <= 16], lambda r: r["hbm_fraction"] >= 0.85),
        ("M = 1 >= 6x cuBLAS bf16", [r for r in rows_main if r["m"] == 1], lambda r: r["speedup"] >= 6.0),
        ("M >= 512 >= 0.8x cuBLAS bf16", [r for r in rows_main if r["m"] >= 512], lambda r: r["speedup"] >= 0.8),
    ]
    for name, sel, ok in checks:
        passed = sum(bool(ok(r)) for r in sel)
        worst = ", ".join(f"{r['k']}->{r['n']} M={r['m']}" for r in sel if not ok(r)) or "-"
        print(f"  {name}: {passed}/{len(sel)} rows meet it; missing: {worst}")
    best: dict[tuple[int, int, int], dict] = {}
    for r in rows:
        key = (r["k"], r["n"], r["m"])
        if key not in best or r["ternary_us"] < best[key]["ternary_us"]:
            best[key] = r
    sel = [r for r in best.values() if r["m"] >= 512]
    if sel:
        ok = [r for r in sel if r["speedup"] >= 0.8]
        print(f"  M >= 512 >= 0.8x cuBLAS bf16, faster of the fused GEMM and deq+cuBLAS per row: {len(ok)}/{len(sel)}; "
              "paths: " + ", ".join(f"{r['k']}->{r['n']} M={r['m']}: {r['kernel']} {r['speedup']:.2f}x" for r in sel))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "dispatch_overhead_us": overhead, "native": ops.NATIVE_CUDA_UNAVAILABLE is None},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
