"""Open-and-list benchmark: ternary_rs.open vs gguf-py's GGUFReader and safetensors.safe_open.

Builds, in a temporary directory, a GGUF with many small tensors (plus a 32k-entry vocabulary, as real
model files carry) and a sharded safetensors checkpoint with the same tensors, then times "open the
file and list every tensor's name, shape and type" for each reader, side by side in one run, and
prints the ratios. A second GGUF / checkpoint with the same tensors but 10x the data shows that
opening costs the same whatever the data size (only the header is parsed).

    python benches/bench_open.py [--tensors 3000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

import ternary_rs


def build_gguf(path: Path, n_tensors: int, cols: int, vocab: int) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(vocab)])
    w.add_array("tokenizer.ggml.scores", [float(-i) for i in range(vocab)])
    w.add_uint32("llama.block_count", n_tensors // 10)
    data = np.ones((16, cols), dtype=np.float16)
    for i in range(n_tensors):
        w.add_tensor(f"blk.{i // 10}.t{i % 10}.weight", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build_safetensors(d: Path, n_tensors: int, cols: int, n_shards: int = 4) -> None:
    d.mkdir()
    names = [f"model.layers.{i // 10}.t{i % 10}.weight" for i in range(n_tensors)]
    data = np.ones((16, cols), dtype=np.float16)
    weight_map = {}
    for s in range(n_shards):
        shard = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = names[s::n_shards]
        save_file({k: data for k in part}, str(d / shard))
        weight_map.update({k: shard for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def time_it(fn, repeats: int) -> float:
    """Best of `repeats` wall-clock runs (the minimum is the least disturbed by other processes on a
    shared machine; every reader here is single-threaded)."""
    fn()  # warm the page cache and imports
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def ternary_list(path):
    def run():
        with ternary_rs.open(path) as f:
            return [(i.name, i.shape, i.type) for i in f.tensors.values()]

    return run


def gguf_py_list(path):
    def run():
        r = gguf.GGUFReader(str(path))
        return [(t.name, tuple(t.shape), t.tensor_type) for t in r.tensors]

    return run


def safe_open_list(d: Path):
    def run():
        out = []
        index = json.loads((d / "model.safetensors.index.json").read_text())
        for shard in sorted(set(index["weight_map"].values())):
            with safe_open(str(d / shard), framework="np") as f:
                for k in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                    s = f.get_slice(k)
                    out.append((k, tuple(s.get_shape()), s.get_dtype()))
        return out

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=3000)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        small, big = tmp / "small.gguf", tmp / "big.gguf"
        build_gguf(small, args.tensors, 64, args.vocab)
        build_gguf(big, args.tensors, 640, args.vocab)
        st_small, st_big = tmp / "st_small", tmp / "st_big"
        build_safetensors(st_small, args.tensors, 64)
        build_safetensors(st_big, args.tensors, 640)
        assert len(ternary_list(small)()) == len(gguf_py_list(small)()) == args.tensors
        assert sorted(ternary_list(st_small)()) == sorted(
            (n, s, t) for n, s, t in safe_open_list(st_small)())

        def size(p):
            return sum(f.stat().st_size for f in ([p] if p.is_file() else p.iterdir()))

        print(f"{args.tensors} tensors, GGUF vocab {args.vocab}, best of {args.repeats} runs (open + list every tensor)")
        print(f"{'case':44s} {'data':>9s} {'ternary_rs':>11s} {'reference':>11s} {'ratio':>8s}")
        rows = []
        for label, path, ref in (
            ("GGUF vs gguf.GGUFReader", small, gguf_py_list),
            ("GGUF 10x data vs gguf.GGUFReader", big, gguf_py_list),
            ("sharded safetensors vs safe_open", st_small, safe_open_list),
            ("sharded safetensors 10x data vs safe_open", st_big, safe_open_list),
        ):
            t_ours = time_it(ternary_list(path), args.repeats)
            t_ref = time_it(ref(path), args.repeats)
            rows.append((label, t_ours))
            print(f"{label:44s} {size(path) / 2**20:7.1f}MB {t_ours * 1e3:9.2f}ms {t_ref * 1e3:9.2f}ms {t_ref / t_ours:7.1f}x")
        print(f"ternary_rs open time, 10x data / 1x data: GGUF {rows[1][1] / rows[0][1]:.2f}, "
              f"safetensors {rows[3][1] / rows[2][1]:.2f} (1.0 = independent of data size)")


if __name__ == "__main__":
    main()
