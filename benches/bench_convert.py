"""Conversion benchmark: a synthetic 27B-shaped ternary GGUF (PQ2_0) -> vLLM directory.

Writes a qwen3-shaped GGUF with 27B-like dimensions (hidden 5120, ffn 17408, 64 layers, vocab 151936,
40 heads / 8 KV heads of 128) and random valid codes with the streaming GGUF writer, then, side by side
in this run:

* ``copy``: ``shutil.copyfile`` of the GGUF (the I/O floor on this disk),
* ``convert``: ``ternary-rs convert`` in a subprocess (GGUF -> vLLM dir: decode, shard, SHA-256 manifest),

and prints wall time, packed GB/s, peak RSS of the converter and the convert/copy ratio. Everything is
deleted afterwards unless ``--keep``. Check free disk first: about 2.2x the GGUF size is needed.

    python benches/bench_convert.py [--layers 64] [--dir /tmp] [--threads N] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPE = dict(hidden=5120, intermediate=17408, vocab=151936, heads=40, kv_heads=8, head_dim=128)
PQ2_0_ID, PQ2_0_BLOCK, PQ2_0_BYTES = 142, 128, 34
# Pool of random valid blocks reused across tensors (content does not matter to the converter).
POOL_BLOCKS = 1 << 20


def _valid_code_bytes() -> np.ndarray:
    """The 81 bytes whose four 2-bit fields are all in {0, 1, 2}."""
    return np.array([a | b << 2 | c << 4 | d << 6 for a in range(3) for b in range(3) for c in range(3)
                     for d in range(3)], dtype=np.uint8)


def _block_pool(rng) -> np.ndarray:
    pool = np.empty((POOL_BLOCKS, PQ2_0_BYTES), dtype=np.uint8)
    scales = rng.uniform(0.005, 0.05, POOL_BLOCKS).astype(np.float16)
    pool[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    pool[:, 2:] = _valid_code_bytes()[rng.integers(0, 81, size=(POOL_BLOCKS, 32), dtype=np.uint8)]
    return pool.reshape(-1)


def tensor_list(layers: int) -> list[tuple[str, tuple[int, ...], int]]:
    s = SHAPE
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    out = [("token_embd.weight", (s["vocab"], s["hidden"]), PQ2_0_ID)]
    for b in range(layers):
        out += [
            (f"blk.{b}.attn_norm.weight", (s["hidden"],), 0),
            (f"blk.{b}.attn_q.weight", (q, s["hidden"]), PQ2_0_ID),
            (f"blk.{b}.attn_k.weight", (kv, s["hidden"]), PQ2_0_ID),
            (f"blk.{b}.attn_v.weight", (kv, s["hidden"]), PQ2_0_ID),
            (f"blk.{b}.attn_q_norm.weight", (s["head_dim"],), 0),
            (f"blk.{b}.attn_k_norm.weight", (s["head_dim"],), 0),
            (f"blk.{b}.attn_output.weight", (s["hidden"], q), PQ2_0_ID),
            (f"blk.{b}.ffn_norm.weight", (s["hidden"],), 0),
            (f"blk.{b}.ffn_gate.weight", (s["intermediate"], s["hidden"]), PQ2_0_ID),
            (f"blk.{b}.ffn_up.weight", (s["intermediate"], s["hidden"]), PQ2_0_ID),
            (f"blk.{b}.ffn_down.weight", (s["hidden"], s["intermediate"]), PQ2_0_ID),
        ]
    out += [("output_norm.weight", (s["hidden"],), 0), ("output.weight", (s["vocab"], s["hidden"]), PQ2_0_ID)]
    return out


def write_gguf(path: Path, layers: int) -> int:
    from ternary_rs.demo import demo_tokenizer, qwen3_metadata
    from ternary_rs.sinks.writers import GGUFWriter

    s = SHAPE
    rng = np.random.default_rng(0)
    pool = _block_pool(rng)
    tokens, types, merges = demo_tokenizer()
    # filler vocabulary: ordinary (type 1) byte-level tokens, like most of a real Qwen vocabulary
    tokens = tokens + [f"tok{i}" for i in range(s["vocab"] - len(tokens))]
    types = types + [1] * (s["vocab"] - len(types))
    w = GGUFWriter(path)
    for key, value, vtype in qwen3_metadata("bench 27B-shaped", s, layers, 40960, tokens, types, merges):
        w.add_metadata(key, value, vtype)
    tensors = tensor_list(layers)
    sizes = {}
    for name, shape, tid in tensors:
        n = int(np.prod(shape))
        sizes[name] = n // PQ2_0_BLOCK * PQ2_0_BYTES if tid == PQ2_0_ID else 4 * n
        w.add_tensor_info(name, shape, tid, sizes[name])
    for name, shape, tid in tensors:
        if tid == 0:
            w.write_tensor_data(name, np.ones(shape, dtype=np.float32))
            continue
        nbytes = sizes[name]
        reps = -(-nbytes // pool.size)
        data = np.tile(pool, reps)[:nbytes] if reps > 1 else pool[:nbytes]
        w.write_tensor_data(name, data)
    w.close()
    return sum(v for k, v in sizes.items())


def _poll_memory(proc, interval: float = 0.05) -> dict[str, int]:
    """Peak VmRSS / RssAnon / RssFile (bytes) of a running process, read from /proc."""
    peaks = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                key, _, value = line.partition(":")
                if key in peaks:
                    peaks[key] = max(peaks[key], int(value.split()[0]) * 1024)
        except (OSError, ValueError):
            pass
        time.sleep(interval)
    return peaks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--threads", type=int)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ternary_rs-bench-", dir=args.dir))
    try:
        src = root / "bench-27b-PQ2_0.gguf"
        t0 = time.perf_counter()
        tensor_bytes = write_gguf(src, args.layers)
        t_write = time.perf_counter() - t0
        size = src.stat().st_size
        free = shutil.disk_usage(root).free
        print(f"synthetic GGUF: {args.layers} layers, {size / 1e9:.2f} GB ({tensor_bytes / 1e9:.2f} GB tensors), "
              f"written in {t_write:.1f} s; free disk {free / 1e9:.1f} GB")
        if free < 1.3 * size:
            print("not enough free disk for the output; stopping")
            return 1

        t0 = time.perf_counter()
        shutil.copyfile(src, root / "copy.gguf")
        t_copy = time.perf_counter() - t0
        os.remove(root / "copy.gguf")

        cmd = [sys.executable, "-m", "ternary_rs", "-v", "convert", str(src), str(root / "out"), "--no-progress"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peaks = _poll_memory(proc)
        out, err = proc.communicate()
        t_conv = time.perf_counter() - t0
        if proc.returncode:
            print(out, err)
            return 1
        out_bytes = sum(p.stat().st_size for p in (root / "out").iterdir())
        for line in err.splitlines():
            if line.startswith("ternary-rs:"):
                print("  " + line)
        print(f"copy    : {t_copy:7.2f} s  {size / t_copy / 1e9:6.2f} GB/s  (I/O floor)")
        print(f"convert : {t_conv:7.2f} s  {size / t_conv / 1e9:6.2f} GB/s packed input, "
              f"{out_bytes / 1e9:.2f} GB written")
        print(f"memory  : peak anonymous (heap) RSS {peaks['RssAnon'] / 2**30:.2f} GiB; peak total RSS "
              f"{peaks['VmRSS'] / 2**30:.2f} GiB (includes clean, reclaimable pages of the memory-mapped source)")
        print(f"ratio convert/copy: {t_conv / t_copy:.2f}x  (includes SHA-256 of source and output for the manifest)")
        return 0
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
