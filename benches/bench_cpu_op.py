"""Benchmark torch.ops.ternary_rs.ternary_linear (CPU) against torch bf16 ``F.linear`` and the memory limit.

Everything is measured side by side in one run, on 1 and 2 threads (``torch.set_num_threads``: the native
op runs on torch's intra-op pool, like ``F.linear``):

* **streaming read bandwidth** of this machine (``torch.sum`` over 1 GiB of f32) on 2 MiB pages, where the
  prepared weights live (``ternary_rs.serving.hugepages``): the physical limit a decode GEMV at M = 1 is
  bounded by; also printed on torch's 4 KiB pages (TLB misses every 4 KiB: lower). The ``%bw`` base is
  that sum timed again in the same rounds as each row's calls (column ``bw``): a VM's bandwidth can drift
  by tens of per cent between the start of a run and its last shape;
* per shape (in_features × out_features; the 27B decode shapes by default) and M: G weights/s,
  G weight-tokens/s and GB/s of the packed weight (codes + scales: the bytes the kernel streams), the
  fraction of the streaming bandwidth, and the ratio to torch bf16 ``F.linear`` of the same shape, for
  the default bf16 mode (int8 per group) and the exact mode; for M > 1 the int8 time over the int8 time
  at M = 1 of the same shape, timed in the same rounds (``xM1``: medians, ``xM1min``: minima; the
  continuous-batching goal is <= 1.5 at M = 8 and <= 2.5 at M = 16);
* weights are **cold** (and on huge pages, as ``ops.prepare_weight`` places them; bf16 on torch's own pages, as
  vLLM holds them): each shape cycles through enough copies to exceed the last-level cache several
  times (a decoding model streams every layer from DRAM), for ternary and for bf16 alike; ``--hot``
  instead reuses one copy (the condition of llama.cpp's ``test-backend-ops perf``, whose weights stay in
  cache), printed as extra rows;
* **per-call overhead** at 1×1024→1024: the native op through torch's dispatcher vs the same kernel called
  directly (``_core``), and the old Python dispatch path for comparison, in interleaved rounds (min per
  side); plus a native call with almost no work next to ``torch.add`` (what any op call costs).

* the ternary modes and torch bf16 of one (shape, M, threads) are timed **round-robin** in one loop, each
  round timing a ~10 ms run of back-to-back calls per side (``timed_together``; the ``--hot`` rows in a loop of their own, so cold calls do not evict their
  weights): ``x bf16`` is the ratio of medians, ``x min`` the ratio of the fastest calls (the AMX unit
  here is shared with a sibling hardware thread, so phases differ by up to 5x);
* ``--variants amx,avx512`` times the int8 mode once per kernel variant (rows ``int8/amx``,
  ``int8/avx512``: AMX-INT8 tiles against the VNNI kernel on the same data); by default only the best.
* ``--layouts rows4,lanes16``: the int8 mode on each weight layout, side by side (rows ``int8`` = rows4,
  ``int8/lanes16``; each ``xM1`` against M = 1 in its own layout); by default rows4 and the layout
  ``ops.prepare_weight(int8_only=True)`` picks on this machine (``_ops_cpu.int8_layout()``).

Usage: python benches/bench_cpu_op.py [--shapes 5120x17408,...] [--m 1,2,4,8,16,128,512] [--threads 1,2]
                                      [--hot] [--budget 1.0] [--variants amx,avx512]
                                      [--layouts rows4,lanes16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import ternary_rs
from ternary_rs import _core
from ternary_rs.serving import _ops_cpu, hugepages, ops

SHAPES = [(5120, 17408), (17408, 5120), (5120, 6144), (5120, 151936)]
GROUP = 128
COLD_BYTES = 1 << 30  # cycle through at least this much weight data per shape (≫ the 300 MB L3 here)


def random_canonical(n: int, k: int, g: int):
    """Random canonical codes without code 3 (bytes with a 3 get that lane's high bit cleared)."""
    q = torch.randint(0, 256, (n, k // 4), dtype=torch.uint8)
    threes = q & (q >> 1) & 0x55
    q = q & ~(threes << 1)
    s = (torch.rand(n, k // g) * 0.05 + 0.01).half()
    return q, s


def timed(fn, copies: int, budget_s: float, min_calls: int = 8) -> float:
    """Median seconds per call of ``fn(i)`` cycling i over the copies, after one warm pass."""
    for i in range(copies):
        fn(i)
    times, spent, i = [], 0.0, 0
    while len(times) < min_calls or spent < budget_s:
        t0 = time.perf_counter()
        fn(i % copies)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        i += 1
        if len(times) >= 2000:
            break
    times.sort()
    return times[len(times) // 2]


MAX_RUN_CALLS = 1000  # calls per timed run, however fast one is


def timed_together(fns: dict, budget_s: float, min_rounds: int = 3, run_s: float = 0.01) -> dict:
    """Round-robin timing: ``fns`` maps a name to ``(fn, copies, setup)``; every round times one **run** of
    each: its untimed ``setup()`` if any, then ``fn(i)`` called back to back for about ``run_s`` seconds
    (at least once; i cycling on over its copies from round to round). Returns name -> (median, min)
    seconds per call, over the rounds.

    Interleaving matters here: AMX throughput on this machine swings by up to 5x within seconds (the tile
    unit is shared with a sibling hardware thread outside this VM), and a VM's memory bandwidth jumps
    between levels, so timing one side after the other compares different phases. Both sides of a ratio
    see the same phases this way, and the ratio of the minima estimates the uncontended one.

    Runs rather than single calls because a decoding model calls its layers back to back: one call timed
    alone right after another side's 1 GiB read ran 5-10 % slower than the same call among others
    (Zen 5, 5120 -> 17408 at M = 1, one thread: 33-35 vs 36-38 GB/s; after 25 ms asleep 31-32)."""
    reps = {}
    for name, (fn, copies, setup) in fns.items():
        spent = 0.0
        for i in range(copies):
            if setup:
                setup()
            t0 = time.perf_counter()
            fn(i)
            spent += time.perf_counter() - t0
        reps[name] = min(MAX_RUN_CALLS, max(1, round(run_s * copies / max(spent, 1e-9))))
    times = {name: [] for name in fns}
    spent, r = 0.0, 0
    at = dict.fromkeys(fns, 0)
    while r < min_rounds or spent < budget_s:
        for name, (fn, copies, setup) in fns.items():
            if setup:
                setup()
            n, i0 = reps[name], at[name]
            t0 = time.perf_counter()
            for i in range(i0, i0 + n):
                fn(i % copies)
            dt = time.perf_counter() - t0
            at[name] = (i0 + n) % copies
            times[name].append(dt / n)
            spent += dt
        r += 1
        if r >= 2000:
            break
    return {name: (sorted(v)[len(v) // 2], min(v)) for name, v in times.items()}


def stream_bandwidth(threads: int, huge_pages: bool = True) -> float:
    """GB/s of ``torch.sum`` over 1 GiB of f32: on huge pages (where the prepared weights are) or, with
    ``huge_pages=False``, on torch's own allocation."""
    torch.set_num_threads(threads)
    if huge_pages:
        a = hugepages.empty((1 << 28,), torch.float32)  # 1 GiB
        a.fill_(1.0)
    else:
        a = torch.ones(1 << 28, dtype=torch.float32)
    t = timed(lambda i: a.sum(), 1, 1.0, min_calls=5)
    return a.numel() * 4 / t / 1e9


def overhead(threads: int, rounds: int = 15, reps: int = 2000) -> dict:
    """Per-call cost at 1x1024->1024: the native op vs the same kernel called directly (``_core``, no torch
    dispatch, no output allocation), in interleaved rounds (min per side: one side's quiet phase must not
    be compared with the other's busy one). Also a native call with almost no work (1x128->4: dispatch,
    argument checks and the output allocation) next to the same tiny kernel called directly and torch's
    own ``add`` of two small tensors, also through ``torch.ops.aten`` (the generic op-call path ours takes). The direct calls run on the ternary-rs pool, set to the same thread
    count as torch's."""
    torch.set_num_threads(threads)
    ternary_rs.set_num_threads(threads)
    n = k = 1024
    q, s = random_canonical(n, k, GROUP)
    qk, sk = ops.prepare_weight(q, s, GROUP)
    x = torch.randn(1, k, dtype=torch.bfloat16)
    y = torch.empty(1, n, dtype=torch.bfloat16)
    tq, ts = ops.prepare_weight(*random_canonical(4, 128, GROUP), GROUP)
    tx = torch.randn(1, 128, dtype=torch.bfloat16)
    op = torch.ops.ternary_rs.ternary_linear.default
    args = (x.data_ptr(), "bfloat16", 1, k, qk.data_ptr(), sk.data_ptr(), n, GROUP, 0, y.data_ptr())
    ty = torch.empty(1, 4, dtype=torch.bfloat16)
    tiny_args = (tx.data_ptr(), "bfloat16", 1, 128, tq.data_ptr(), ts.data_ptr(), 4, GROUP, 0, ty.data_ptr())
    sides = {
        "native": lambda: op(x, qk, sk, n, k, GROUP, None, 0),
        "direct": lambda: _core.ternary_gemm_cpu(*args),
        "python_path": lambda: _ops_cpu.ternary_linear(x, qk, sk, n, k, GROUP, None, 0),
        "native_tiny": lambda: op(tx, tq, ts, 4, 128, GROUP, None, 0),
        "direct_tiny": lambda: _core.ternary_gemm_cpu(*tiny_args),
        "torch_add": lambda: torch.add(tx, tx),
        "torch_ops_add": lambda: torch.ops.aten.add.Tensor(tx, tx),  # the same torch.ops call path as ours
    }
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(rounds):
        for name, fn in sides.items():
            for _ in range(reps // 20):
                fn()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / reps)
    ternary_rs.set_num_threads(0)
    us = {name: v * 1e6 for name, v in best.items()}
    return {"native_us": us["native"], "kernel_direct_us": us["direct"],
            "native_overhead_us": us["native"] - us["direct"], "python_path_us": us["python_path"],
            "native_tiny_us": us["native_tiny"], "direct_tiny_us": us["direct_tiny"],
            "tiny_overhead_us": us["native_tiny"] - us["direct_tiny"], "torch_add_us": us["torch_add"],
            "torch_ops_add_us": us["torch_ops_add"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN list (in x out)")
    ap.add_argument("--m", default="1,2,4,8,16,128,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per measurement")
    ap.add_argument("--hot", action="store_true", help="also time one cache-resident copy per shape")
    ap.add_argument("--no-bf16", action="store_true", help="skip torch bf16 (it is slow at large M)")
    ap.add_argument("--variants", default="", help="int8 mode once per kernel variant, e.g. amx,avx512")
    ap.add_argument("--layouts", default=None, help="int8 weight layouts, e.g. rows4,lanes16 (default: rows4 "
                    "and this machine's int8 layout)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.m.split(",")]
    threads = [int(v) for v in args.threads.split(",")]
    kernel_variants = [v for v in args.variants.split(",") if v]
    layouts = [v for v in (args.layouts or f"rows4,{_ops_cpu.int8_layout()}").split(",") if v]
    layouts = list(dict.fromkeys(layouts))

    print(f"CPU: {platform.processor() or platform.machine()}, kernel variant {_ops_cpu.kernel_variant()}, "
          f"native dispatch: {ops.NATIVE_CPU_UNAVAILABLE is None}, torch {torch.__version__}, g = {GROUP}")
    bandwidth = {t: stream_bandwidth(t) for t in threads}
    small_pages = {t: stream_bandwidth(t, huge_pages=False) for t in threads}
    for t, bw in bandwidth.items():
        print(f"streaming read bandwidth, {t} thread(s): {bw:.1f} GB/s on huge pages "
              f"(THP {hugepages.thp_mode()}; the %bw base), {small_pages[t]:.1f} GB/s on torch's own pages")
    results = {"bandwidth_GBps": bandwidth, "bandwidth_small_pages_GBps": small_pages, "overhead": {}, "rows": []}
    # The %bw base, timed in the same rounds as every row's calls (the figures above are the start's).
    stream = hugepages.empty((1 << 28,), torch.float32)
    stream.fill_(1.0)
    for t in threads:
        results["overhead"][t] = o = overhead(t)
        print(f"per-call at 1x1024->1024, {t} thread(s): native op {o['native_us']:.2f} us, kernel called "
              f"directly {o['kernel_direct_us']:.2f} us (dispatch overhead {o['native_overhead_us']:.2f} us), "
              f"old Python path {o['python_path_us']:.2f} us; with almost no work (1x128->4): native "
              f"{o['native_tiny_us']:.2f} us, direct {o['direct_tiny_us']:.2f} us (overhead {o['tiny_overhead_us']:.2f} us), "
              f"torch.add of two such x {o['torch_add_us']:.2f} us, through torch.ops.aten.add.Tensor "
              f"{o['torch_ops_add_us']:.2f} us (goal: overhead <= 5 us)")

    hdr = (f"{'K x N':>14} {'M':>4} {'thr':>3} {'mode':>16} {'ms':>9} {'Gw/s':>7} {'Gwt/s':>7} {'GB/s':>6} "
           f"{'bw':>5} {'%bw':>5} {'bf16 ms':>9} {'x bf16':>7} {'x min':>6} {'xM1':>6} {'xM1min':>6}")
    print(hdr)
    for k, n in shapes:
        q, s = random_canonical(n, k, GROUP)
        copies_of = {}
        for layout in layouts:
            qk, sk = _ops_cpu.prepare_weight(q, s, GROUP, layout)
            packed = qk.numel() + 2 * sk.numel()
            copies = max(1, -(-COLD_BYTES // packed))
            copies_of[layout] = ([qk] + [hugepages.copy_of(qk) for _ in range(copies - 1)],
                                 [sk] + [hugepages.copy_of(sk) for _ in range(copies - 1)])
        tq = copies_of.get("rows4", next(iter(copies_of.values())))[0]
        dense = None
        if not args.no_bf16:
            w = torch.randn(n, k, dtype=torch.bfloat16)
            bf_copies = max(1, -(-COLD_BYTES // (w.numel() * 2)))
            dense = [w] + [w.clone() for _ in range(bf_copies - 1)]
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            for th in threads:
                torch.set_num_threads(th)
                ternary_rs.set_num_threads(th)
                fns = {}
                if dense is not None and (m <= 16 or n * k <= 1 << 27):
                    fns["bf16"] = (lambda i: torch.nn.functional.linear(x, dense[i % len(dense)]), len(dense), None)
                # (mode name, activations, copies, kernel variant, layout)
                copies = len(tq)
                variants = [(f"int8/{v}", ops.AUTO, copies, v, "rows4") for v in kernel_variants] or [
                    ("int8", ops.AUTO, copies, "auto", "rows4")]
                variants = [v for v in variants if "rows4" in layouts]
                variants += [(f"int8/{lay}", ops.AUTO, len(copies_of[lay][0]), "auto", lay)
                             for lay in layouts if lay != "rows4"]
                if "rows4" in layouts and not (m > 16 and m != ms[-1]):  # the f32 path; keep the run short
                    variants.append(("exact", ops.EXACT, copies, "auto", "rows4"))
                hot_variants = [(f"{name} hot", act, 1, v, lay) for name, act, _, v, lay in variants
                                if act == ops.AUTO] if args.hot else []

                def entries(vs):
                    return {mode: (lambda i, act=act, lay=lay: torch.ops.ternary_rs.ternary_linear(
                                x, copies_of[lay][0][i], copies_of[lay][1][i], n, k, GROUP, None, act),
                                   cps, lambda kernel=kernel: _ops_cpu.set_kernel_variant(kernel))
                            for mode, act, cps, kernel, lay in vs}
                # Cold rows (and bf16, also cold) round-robin together; cache-resident ("hot") rows in a
                # loop of their own, or the cold calls between them would evict their weights.
                fns.update(entries(variants))
                if m > 1:  # M = 1 in the same rounds: the goal is time(M) / time(1) (x M1 columns)
                    x1 = x[:1].clone()
                    for lay in layouts:
                        fns[f"m1/{lay}"] = (lambda i, lay=lay: torch.ops.ternary_rs.ternary_linear(
                            x1, copies_of[lay][0][i], copies_of[lay][1][i], n, k, GROUP, None, ops.AUTO),
                            len(copies_of[lay][0]), None)
                fns["stream"] = (lambda i: stream.sum(), 1, None)
                got = timed_together(fns, args.budget * len(fns))
                bw_here = stream.numel() * 4 / got.pop("stream")[0] / 1e9
                if hot_variants:
                    got.update(timed_together(entries(hot_variants), args.budget * len(hot_variants)))
                variants += hot_variants
                _ops_cpu.set_kernel_variant("auto")
                t_bf16, t_bf16_min = got.get("bf16", (None, None))
                for mode, act, _cps, _kernel, lay in variants:
                    t, t_min = got[mode]
                    t_m1, t_m1_min = got.get(f"m1/{lay}", (None, None))
                    packed = copies_of[lay][0][0].numel() + 2 * copies_of[lay][1][0].numel()
                    row = {"k": k, "n": n, "m": m, "threads": th, "mode": mode, "layout": lay, "seconds": t,
                           "G_weights_per_s": n * k / t / 1e9, "G_weight_tokens_per_s": m * n * k / t / 1e9,
                           "packed_GBps": packed / t / 1e9, "bandwidth_GBps": bw_here,
                           "fraction_of_bandwidth": packed / t / 1e9 / bw_here,
                           "fraction_of_start_bandwidth": packed / t / 1e9 / bandwidth[th],
                           "bf16_seconds": t_bf16, "speedup_vs_bf16": (t_bf16 / t) if t_bf16 else None,
                           "min_seconds": t_min, "bf16_min_seconds": t_bf16_min,
                           "speedup_vs_bf16_min": (t_bf16_min / t_min) if t_bf16 else None,
                           "time_vs_m1": (t / t_m1) if t_m1 else None,
                           "time_vs_m1_min": (t_min / t_m1_min) if t_m1 else None}
                    results["rows"].append(row)
                    m1 = (f"{t / t_m1:6.2f} {t_min / t_m1_min:6.2f}" if t_m1 and act == ops.AUTO
                          else f"{'-':>6} {'-':>6}")
                    bf = (f"{t_bf16 * 1e3:9.3f} {t_bf16 / t:7.2f} {t_bf16_min / t_min:6.2f}" if t_bf16
                          else f"{'-':>9} {'-':>7} {'-':>6}")
                    print(f"{k:>6} x {n:<6} {m:>4} {th:>3} {mode:>16} {t * 1e3:9.3f} {row['G_weights_per_s']:7.1f} "
                          f"{row['G_weight_tokens_per_s']:7.1f} {row['packed_GBps']:6.2f} {bw_here:5.1f} "
                          f"{100 * row['fraction_of_bandwidth']:5.1f} {bf} {m1}", flush=True)
        tq = dense = copies_of = None  # free this shape's copies before the next
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
