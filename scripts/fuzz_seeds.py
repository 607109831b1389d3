"""Seed corpora for the fuzz targets (scripts/fuzz.sh), built from the test corpora.

    python3 scripts/fuzz_seeds.py OUT_DIR

writes ``OUT_DIR/<target>/<name>`` for every Rust target (``ternary_core::fuzzing::TARGETS``):

* ``gguf_open`` / ``safetensors_open`` / ``safetensors_index``: every malformed file of
  ``tests/test_corrupt_files.py`` plus valid files written by gguf-py, safetensors and ternary_rs;
* ``decode_<format>``: a selector byte (shape, see ``fuzzing::block_input``) followed by tensor data
  encoded by ternary_rs (and gguf-py's quantizers where it has the format), plus all-zero/all-0xFF data;
* ``regressions``: the files under ``rust/ternary-core/fuzz/regressions/<target>/`` are added too.

Inputs larger than ``MAX_SEED_BYTES`` are skipped (libFuzzer's -max_len would cut them anyway).
"""

from __future__ import annotations

import json
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
MAX_SEED_BYTES = 64 << 10
# Mirrors ternary_core::fuzzing::INDEX_SHARDS: the shards the index target's inputs may point at.
INDEX_SHARDS = {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                "c": "model-00002-of-00002.safetensors"}
# (target, format name for ternary_rs.encode, values per block, selector bits that pick the shape)
BLOCK_TARGETS = {
    "decode_tq1_0": ("TQ1_0", 256), "decode_tq2_0": ("TQ2_0", 256), "decode_q2_0": ("Q2_0", 64),
    "decode_pq2_0": ("PQ2_0", 128), "decode_ptq1_0": ("PTQ1_0", 128), "decode_q1_0": ("Q1_0", 128),
    "decode_stq1_0": ("STQ1_0", 256),
}


def _put(out: Path, target: str, name: str, data: bytes) -> None:
    if len(data) <= MAX_SEED_BYTES:
        d = out / target
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)


def _ternary(rng, rows: int, cols: int, group: int, binary: bool = False):
    import ternary_rs

    t = rng.integers(0, 2, size=(rows, cols)) * 2 if binary else rng.integers(0, 3, size=(rows, cols))
    codes = t.astype(np.uint8).reshape(rows, cols // 4, 4)
    q = (codes[..., 0] | codes[..., 1] << 2 | codes[..., 2] << 4 | codes[..., 3] << 6).astype(np.uint8)
    s = rng.uniform(0.01, 2.0, size=(rows, cols // group)).astype(np.float16)
    return ternary_rs.TernaryTensor(q, s, group)


def _stq1_0_ternary(rng, rows: int, cols: int):
    """A tensor STQ1_0 can hold (random trits mostly cannot): every group of 4 lanes 16 apart in a 64-value
    chunk is one of its 32 codebook patterns, i.e. one zero and three ±1."""
    import ternary_rs

    t = rng.choice(np.array([-1, 1], np.int8), size=(rows, cols))
    r, c, g = np.indices((rows, cols // 64, 16))
    t[r, 64 * c + g + 16 * rng.integers(0, 4, size=(rows, cols // 64, 16))] = 0
    codes = (t + 1).astype(np.uint8).reshape(rows, cols // 4, 4)
    q = (codes[..., 0] | codes[..., 1] << 2 | codes[..., 2] << 4 | codes[..., 3] << 6).astype(np.uint8)
    s = rng.uniform(0.01, 2.0, size=(rows, cols // 256)).astype(np.float16)
    return ternary_rs.TernaryTensor(q, s, 256)


def container_seeds(out: Path, tmp: Path) -> None:
    import gguf
    from safetensors.numpy import save_file

    import test_corrupt_files as corrupt

    for i, (blob, _) in enumerate(corrupt.CORRUPT_GGUF.values()):
        _put(out, "gguf_open", f"corrupt-{i:03d}", blob)
    for i, (blob, _) in enumerate(corrupt.CORRUPT_SAFETENSORS.values()):
        _put(out, "safetensors_open", f"corrupt-{i:03d}", blob)

    rng = np.random.default_rng(0)
    # gguf-py files: metadata of every type, float tensors and its own TQ1_0/TQ2_0 quantization.
    for i, qtype in enumerate((None, gguf.GGMLQuantizationType.TQ1_0, gguf.GGMLQuantizationType.TQ2_0)):
        p = tmp / f"g{i}.gguf"
        w = gguf.GGUFWriter(str(p), "llama")
        w.add_uint32("llama.block_count", 1)
        w.add_float32("x.f", 0.5)
        w.add_bool("x.b", True)
        w.add_string("x.s", "ternary")
        w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
        w.add_array("x.ints", [1, 2, 3])
        w.add_tensor("f32", np.arange(16, dtype=np.float32).reshape(4, 4))
        w.add_tensor("f16", np.arange(8, dtype=np.float16))
        if qtype is not None:
            x = (rng.integers(-1, 2, size=(2, 256)) * 0.5).astype(np.float32)
            q = gguf.quants.quantize(x, qtype)
            w.add_tensor("q", q, raw_shape=q.shape, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        _put(out, "gguf_open", f"gguf-py-{i}", p.read_bytes())
    # ternary_rs's own writer, with the PrismML types gguf-py does not have.
    import ternary_rs
    from ternary_rs.sinks.writers import GGUFWriter

    p = tmp / "ours.gguf"
    w = GGUFWriter(p)
    w.add_metadata("general.architecture", "qwen3", "string")
    tensors = [(fmt, ternary_rs.encode(_ternary(rng, 2, 256, 128 if fmt in ("PQ2_0", "PTQ1_0") else 256), fmt))
               for fmt in ("PQ2_0", "PTQ1_0", "TQ2_0")]
    tensors.append(("STQ1_0", ternary_rs.encode(_stq1_0_ternary(rng, 2, 256), "STQ1_0")))
    type_ids = {"PQ2_0": 142, "PTQ1_0": 143, "TQ2_0": 35, "STQ1_0": 43}
    for fmt, data in tensors:
        w.add_tensor_info(f"t.{fmt}", (2, 256), type_ids[fmt], len(bytes(memoryview(data))))
    for fmt, data in tensors:
        w.write_tensor_data(f"t.{fmt}", data)
    w.close()
    _put(out, "gguf_open", "ternary_rs-writer", p.read_bytes())

    for i, tensors in enumerate(({"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 3), np.int8)},
                                 {"w.qweight": np.full((4, 8), 0x55, np.uint8),
                                  "w.scales": np.ones((4, 1), np.float16)},
                                 {})):
        p = tmp / f"s{i}.safetensors"
        save_file(tensors, str(p), metadata={"format": "pt"})
        _put(out, "safetensors_open", f"safetensors-{i}", p.read_bytes())

    indexes = [
        {"metadata": {"total_size": 16}, "weight_map": INDEX_SHARDS},
        {"weight_map": {"a": INDEX_SHARDS["a"]}},
        {"weight_map": {"a": INDEX_SHARDS["a"], "c": INDEX_SHARDS["c"]}},
        {"weight_map": {"a": INDEX_SHARDS["c"]}},
        {"weight_map": {"a": "missing.safetensors"}},
        {"weight_map": {"a": "../" + INDEX_SHARDS["a"]}},
        {"weight_map": {"a": 3}},
        {"metadata": {}},
        {"weight_map": {}},
    ]
    for i, index in enumerate(indexes):
        _put(out, "safetensors_index", f"index-{i}", json.dumps(index).encode())
    _put(out, "safetensors_index", "broken", b"{broken")


def decoder_seeds(out: Path) -> None:
    import gguf

    import ternary_rs

    rng = np.random.default_rng(1)
    for target, (fmt, block) in BLOCK_TARGETS.items():
        for sel in (0x00, 0x05, 0x0F, 0x3A, 0x4F):
            rows, bpr = 1 + (sel & 1), 1 + ((sel >> 1) & 1)
            t = (_stq1_0_ternary(rng, rows, bpr * block) if fmt == "STQ1_0"
                 else _ternary(rng, rows, bpr * block, block, binary=fmt == "Q1_0"))
            _put(out, target, f"valid-{sel:02x}", bytes([sel]) + bytes(memoryview(ternary_rs.encode(t, fmt))))
        for fill in (0x00, 0xFF, 0x55):
            _put(out, target, f"fill-{fill:02x}", bytes([0x03]) + bytes([fill]) * 600)
    for sel in (0x00, 0x0F, 0x2F):
        x = (rng.integers(-1, 2, size=(1 + (sel & 1), 256 * (1 + ((sel >> 1) & 1)))) * 0.25).astype(np.float32)
        for target, q in (("decode_tq1_0", gguf.GGMLQuantizationType.TQ1_0),
                          ("decode_tq2_0", gguf.GGMLQuantizationType.TQ2_0)):
            _put(out, target, f"gguf-py-{sel:02x}", bytes([sel]) + gguf.quants.quantize(x, q).tobytes())
    for sel in (0x00, 0x07, 0x21, 0x4B):  # I2_S: rows 1+(sel&1), cols 128·(1+(sel>>1&3))
        rows, cols = 1 + (sel & 1), 128 * (1 + ((sel >> 1) & 3))
        t = _ternary(rng, rows, cols, 128)
        t = ternary_rs.TernaryTensor(t.qweight, np.full_like(t.scales, 0.75), 128)
        _put(out, "decode_i2_s", f"valid-{sel:02x}", bytes([sel]) + bytes(memoryview(ternary_rs.encode(t, "I2_S"))))
    for sel in (0x00, 0x05, 0x27):  # BitNet: 4 bytes weight_scale, then [rows/4, cols]
        rows, cols = 4 * (1 + (sel & 1)), 32 * (1 + ((sel >> 1) & 3))
        codes = rng.integers(0, 3, size=(rows // 4, cols)).astype(np.uint8)
        packed = codes | rng.integers(0, 3, size=codes.shape).astype(np.uint8) << 2
        _put(out, "decode_bitnet", f"valid-{sel:02x}", bytes([sel]) + struct.pack("<f", 2.0) + packed.tobytes())
    for sel in (0x10, 0x35, 0x5F, 0x90):  # MLX: selector 0x10 sets bias = -scale
        rows, cols = 1 + (sel & 1), 32 * (1 + ((sel >> 1) & 3))
        w = rng.integers(0, 3, size=rows * cols).astype(np.uint8).reshape(-1, 4)
        words = (w[:, 0] | w[:, 1] << 2 | w[:, 2] << 4 | w[:, 3] << 6).astype(np.uint8)
        scales = rng.uniform(0.1, 1, size=64).astype(np.float16)
        _put(out, "decode_mlx", f"valid-{sel:02x}", bytes([sel]) + words.tobytes() + scales.tobytes())
    for sel in (0x80, 0x88, 0x90, 0xA5, 0x00):  # dense: 0x80 builds t·a groups from the data
        _put(out, "decode_dense", f"seed-{sel:02x}", bytes([sel]) + rng.integers(0, 256, 1100, dtype=np.uint8).tobytes())


def regression_seeds(out: Path) -> None:
    root = ROOT / "rust/ternary-core/fuzz/regressions"
    if root.is_dir():
        for d in sorted(p for p in root.iterdir() if p.is_dir()):
            for f in sorted(d.iterdir()):
                _put(out, d.name, f"regression-{f.name}", f.read_bytes())


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        container_seeds(out, Path(tmp))
    decoder_seeds(out)
    regression_seeds(out)
    for d in sorted(out.iterdir()):
        print(f"{d.name}: {sum(1 for _ in d.iterdir())} seeds")


if __name__ == "__main__":
    main()
