"""Codec throughput on a 27B-shaped layer (Bonsai 2 / qwen35: hidden 5120, ssm inner 6144, FFN 17408),
side by side with the PyPI ``gguf`` package's NumPy ``dequantize`` in the same run.

Measured, each as packed source bytes per second (best of ``--repeat``):

* TQ2_0 → canonical       (ours, 1 thread and all threads)   vs gguf-py ``dequantize(TQ2_0)``
* PTQ1_0 → canonical      (ours)                             vs gguf-py ``dequantize(TQ1_0)`` (same base-3
  packing at group 256; gguf-py has no PTQ1_0)
* canonical → bf16 dense  (ours)                             vs gguf-py ``dequantize(TQ2_0)`` (f32) + bf16 cast

gguf-py decodes the same whole matrices (``--gguf-rows N`` limits it to the first N rows of each; it is slow
and memory-hungry); ratios compare weights/s on the rows both decoded. Outputs are freshly allocated on both
sides, as in real use (first-touch page faults are part of the cost). canonical → bf16 writes 16× the bytes
it reads, so it is also timed against merely writing its output with NumPy (into a reused buffer, and into a
fresh one), and with ``out=`` into a reused buffer: the ratios those allow are its physical bound here.

    python benches/bench_codecs.py            # full layer (4 matrices, ~240 M weights)
    python benches/bench_codecs.py --quick    # two smaller matrices
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ternary_rs
from ternary_rs.core.tensor import TernaryTensor, decode_bytes, encode

LAYER = [(5120, 6144), (6144, 5120), (17408, 5120), (5120, 17408)]  # [N, K] = [out, in]
QUICK = [(5120, 6144), (6144, 5120)]


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def random_canonical(rows: int, cols: int, group: int, rng) -> TernaryTensor:
    # Every valid canonical byte is 4 codes in 0..2: 81 possibilities, drawn uniformly.
    valid = np.array([a | b << 2 | c << 4 | d << 6 for a in range(3) for b in range(3) for c in range(3)
                      for d in range(3)], np.uint8)
    q = valid[rng.integers(0, 81, size=(rows, cols // 4), dtype=np.uint8)]
    s = rng.uniform(0.01, 0.1, size=(rows, cols // group)).astype(np.float16)
    return TernaryTensor(q, s, validate=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gguf-rows", type=int, default=0, help="rows gguf-py decodes per matrix (0 = all)")
    args = ap.parse_args()

    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize as gguf_dequantize

    try:
        import ml_dtypes

        bf16 = ml_dtypes.bfloat16
    except ImportError:  # pragma: no cover
        bf16 = None

    shapes = QUICK if args.quick else LAYER
    all_threads = ternary_rs.get_num_threads()
    rng = np.random.default_rng(0)
    totals: dict[str, dict[str, float]] = {}
    writes: dict[str, float] = {}  # label -> seconds over all shapes (canonical -> bf16's write bound)
    written = 0  # bf16 values those write

    def add(key: str, col: str, nbytes: int, values: int, seconds: float) -> None:
        d = totals.setdefault(key, {})
        for k, v in (("_bytes", nbytes), ("_values", values), ("_s", seconds)):
            d[col + k] = d.get(col + k, 0) + v

    print(f"threads available: {all_threads}; matrices [N, K]: {shapes}; "
          f"gguf-py rows per matrix: {args.gguf_rows or 'all'}")
    for rows, cols in shapes:
        t256 = random_canonical(rows, cols, 256, rng)
        t128 = random_canonical(rows, cols, 128, rng)
        tq2 = encode(t256, "TQ2_0")
        ptq1 = encode(t128, "PTQ1_0")
        tq1 = encode(t256, "TQ1_0")
        sl = min(args.gguf_rows, rows) if args.gguf_rows > 0 else rows
        tq2_s, ptq1_s, tq1_s = (x[: x.size // rows * sl] for x in (tq2, ptq1, tq1))
        t256_s = TernaryTensor(t256.qweight[:sl], t256.scales[:sl], validate=False)

        cases = {
            "TQ2_0 -> canonical": (
                lambda: decode_bytes("TQ2_0", tq2, (rows, cols)), tq2.size,
                lambda: decode_bytes("TQ2_0", tq2_s, (sl, cols)),
                lambda: gguf_dequantize(tq2_s.reshape(sl, -1), QT.TQ2_0), tq2_s.size),
            "PTQ1_0 -> canonical": (
                lambda: decode_bytes("PTQ1_0", ptq1, (rows, cols)), ptq1.size,
                lambda: decode_bytes("PTQ1_0", ptq1_s, (sl, cols)),
                lambda: gguf_dequantize(tq1_s.reshape(sl, -1), QT.TQ1_0), tq1_s.size),
            "canonical -> bf16": (
                lambda: t256.dequantize("bfloat16"), t256.nbytes,
                lambda: t256_s.dequantize("bfloat16"),
                (lambda: gguf_dequantize(tq2_s.reshape(sl, -1), QT.TQ2_0).astype(bf16)) if bf16 is not None
                else (lambda: gguf_dequantize(tq2_s.reshape(sl, -1), QT.TQ2_0)), tq2_s.size),
        }
        # The output of canonical -> bf16 is 16x its input: writing it bounds the codec. Timed in the
        # same run: our decode into a reused buffer (``out=``), and NumPy merely writing that many bytes
        # into a reused buffer and into a fresh one (the kernel zeroes fresh pages first). Our decode
        # into a fresh output is the table's "ours 1t" row.
        out16 = np.empty((rows, cols), np.uint16)
        written += rows * cols
        ternary_rs.set_num_threads(1)
        for label, fn in (("ours, out= reused", lambda: t256.dequantize("bfloat16", out=out16)),
                          ("numpy fill, reused", lambda: out16.fill(1)),
                          ("numpy empty + fill", lambda: np.empty((rows, cols), np.uint16).fill(1))):
            writes[label] = writes.get(label, 0.0) + best(fn, args.repeat)
        ternary_rs.set_num_threads(0)
        for key, (ours_full, full_bytes, ours_slice, theirs, slice_bytes) in cases.items():
            ref_s = best(theirs, 1 if sl * cols > 8_000_000 else args.repeat)  # gguf-py: seconds per call
            add(key, "gguf", slice_bytes, sl * cols, ref_s)
            ours_slice_bytes = full_bytes // rows * sl
            for label, n in (("1t", 1), ("all", 0)):
                ternary_rs.set_num_threads(n)
                add(key, label + "_slice", ours_slice_bytes, sl * cols, best(ours_slice, args.repeat))
                add(key, label, full_bytes, rows * cols, best(ours_full, args.repeat))
        ternary_rs.set_num_threads(0)

    gb = 1e9
    print(f"\n{'codec':22s} {'gguf-py':>9s} {'ours 1t':>9s} {'ours all':>9s} {'1t/gguf':>9s} "
          f"{'all/gguf':>9s} {'all/1t':>7s}")
    for key, d in totals.items():
        g = d["gguf_bytes"] / d["gguf_s"]
        one = d["1t_bytes"] / d["1t_s"]
        al = d["all_bytes"] / d["all_s"]
        # Ratios in weights/s on the rows both sides decoded (packed bytes/weight differ slightly
        # between PTQ1_0 and TQ1_0).
        gv = d["gguf_values"] / d["gguf_s"]
        one_sl = d["1t_slice_values"] / d["1t_slice_s"]
        all_sl = d["all_slice_values"] / d["all_slice_s"]
        print(f"{key:22s} {g / gb:9.3f} {one / gb:9.3f} {al / gb:9.3f} {one_sl / gv:8.0f}x {all_sl / gv:8.0f}x "
              f"{al / one:6.2f}x")
    print("\n(GB/s of packed source bytes; 'ours' on whole matrices; ratios in weights/s on the same first"
          " rows gguf-py decoded; all/1t on whole matrices.)")
    d = totals["canonical -> bf16"]
    writes["ours, fresh output"] = d["1t_s"]
    gguf_s = d["gguf_s"] * written / d["gguf_values"]  # gguf-py seconds for the whole matrices
    print(f"\ncanonical -> bf16 against the cost of writing its output ({2 * written / 1e6:.0f} MB of "
          "bf16), 1 thread:")
    for label in ("ours, out= reused", "ours, fresh output", "numpy fill, reused", "numpy empty + fill"):
        sec = writes[label]
        print(f"  {label:20s} {sec * 1e3:8.2f} ms  {2 * written / sec / 1e9:6.2f} GB/s written  "
              f"gguf-py / this = {gguf_s / sec:5.1f}x")


if __name__ == "__main__":
    main()
