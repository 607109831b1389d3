"""ternary_rs.open on GGUF files written by llama.cpp's own Python writer (gguf-py's GGUFWriter),
compared field by field with gguf-py's GGUFReader: metadata values and types, tensor names, shapes,
types, offsets and raw bytes; both byte orders; several alignments."""

from __future__ import annotations

import gc
import struct
import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT
from gguf.quants import quantize

import ternary_rs

# gguf-py value type -> the type name ternary_rs reports.
TYPE_NAMES = {
    VT.UINT8: "u8", VT.INT8: "i8", VT.UINT16: "u16", VT.INT16: "i16", VT.UINT32: "u32",
    VT.INT32: "i32", VT.FLOAT32: "f32", VT.BOOL: "bool", VT.STRING: "string", VT.ARRAY: "array",
    VT.UINT64: "u64", VT.INT64: "i64", VT.FLOAT64: "f64",
}

# Metadata of every value type: key -> (value, gguf-py type, array element type).
METADATA = {
    "m.u8": (255, VT.UINT8, None),
    "m.i8": (-128, VT.INT8, None),
    "m.u16": (65535, VT.UINT16, None),
    "m.i16": (-32768, VT.INT16, None),
    "m.u32": (4_000_000_000, VT.UINT32, None),
    "m.i32": (-2_000_000_000, VT.INT32, None),
    "m.f32": (0.1, VT.FLOAT32, None),
    "m.bool": (True, VT.BOOL, None),
    "m.bool_false": (False, VT.BOOL, None),
    "m.string": ("héllo ✓ wörld", VT.STRING, None),
    "m.empty_string": ("", VT.STRING, None),
    "m.u64": (2**64 - 1, VT.UINT64, None),
    "m.i64": (-(2**63), VT.INT64, None),
    "m.f64": (-1.5e300, VT.FLOAT64, None),
    "tokenizer.ggml.tokens": (["<s>", "</s>", "▁the", "", "ü"], VT.ARRAY, VT.STRING),
    "tokenizer.ggml.scores": ([0.0, -1.25, 3.5], VT.ARRAY, VT.FLOAT32),
    "m.i8s": ([-1, 0, 1, 127, -128], VT.ARRAY, VT.INT8),
    "m.u64s": ([0, 2**64 - 1], VT.ARRAY, VT.UINT64),
    "m.bools": ([True, False, True], VT.ARRAY, VT.BOOL),
    "m.f64s": ([1e-300, 2.5], VT.ARRAY, VT.FLOAT64),
    "m.nested": ([[1, 2, 3], [4]], VT.ARRAY, VT.ARRAY),
}


def expected_value(value, vtype, sub):
    """What a reader must return, computed from the value we wrote (f32 rounds to float32)."""
    if vtype == VT.FLOAT32:
        return float(np.float32(value))
    if vtype == VT.ARRAY and sub == VT.FLOAT32:
        return [float(np.float32(v)) for v in value]
    return value


def build_gguf(path, ternary_weights, alignment=None, big_endian=False):
    """A GGUF with metadata of every type and F32/F16/BF16/Q8_0/TQ1_0/TQ2_0/I8/I32 tensors, written by
    gguf-py. Returns {name: the array handed to the writer}."""
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (value, vtype, sub) in METADATA.items():
        w.add_key_value(key, value, vtype, sub_type=sub if sub != VT.ARRAY else None)
    tq = ternary_weights(3, 512)
    tensors = {
        "token_embd.weight": np.arange(24, dtype=np.float32).reshape(4, 6) / 7,
        "blk.0.attn_norm.weight": np.linspace(-1, 1, 32, dtype=np.float16),
        "blk.0.attn_q.weight": quantize(tq, Q.TQ2_0),
        "blk.0.attn_k.weight": quantize(tq, Q.TQ1_0),
        "blk.0.ffn_up.weight": quantize(tq[:, :64], Q.Q8_0),
        # As uint16 so gguf-py byte-swaps it for a big-endian file (it leaves uint8 data alone).
        "blk.0.bf16.weight": quantize(tq[:2, :16], Q.BF16).view(np.uint16),
        "blk.0.i8": np.array([[-3, 4], [5, -6]], dtype=np.int8),
        "blk.0.i32": np.arange(5, dtype=np.int32),
        "output.weight": np.ones((2, 8), dtype=np.float32),
    }
    raw_types = {
        "blk.0.attn_q.weight": Q.TQ2_0, "blk.0.attn_k.weight": Q.TQ1_0,
        "blk.0.ffn_up.weight": Q.Q8_0, "blk.0.bf16.weight": Q.BF16,
    }
    for name, arr in tensors.items():  # gguf-py byte-swaps native arrays itself for a big-endian file
        w.add_tensor(name, arr, raw_dtype=raw_types.get(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(params=[(None, False), (64, False), (256, False), (1, False), (None, True), (64, True)],
                ids=["align32", "align64", "align256", "align1", "big-endian", "big-endian-align64"])
def sample(request, tmp_path, ternary_weights):
    alignment, big = request.param
    path = tmp_path / "sample.gguf"
    arrays = build_gguf(path, ternary_weights, alignment, big)
    return path, arrays, alignment or 32, big


def test_header_fields_match_gguf_py(sample):
    path, _, alignment, big = sample
    ref = gguf.GGUFReader(str(path))
    with ternary_rs.open(path) as f:
        assert f.format == "gguf"
        assert f.gguf_version == int(ref.fields["GGUF.version"].parts[0][0]) == 3
        assert f.alignment == ref.alignment == alignment
        assert f.byte_order == ("big" if big else "little")
        assert len(f.tensors) == int(ref.fields["GGUF.tensor_count"].parts[0][0])
        assert len(f.metadata) == int(ref.fields["GGUF.kv_count"].parts[0][0])


def test_metadata_matches_gguf_py(sample):
    path, _, alignment, _ = sample
    ref = gguf.GGUFReader(str(path))
    with ternary_rs.open(path) as f:
        ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(f.metadata) == ref_keys
        for key in ref_keys:
            field = ref.fields[key]
            want_type = TYPE_NAMES[field.types[0]]
            if field.types[0] == VT.ARRAY:
                want_type = f"array[{TYPE_NAMES[field.types[1]]}]" if len(field.types) > 1 else "array"
            got_type = f.metadata_types[key]
            assert got_type.startswith(want_type), (key, got_type, want_type)
            got = f.metadata[key]
            if key == "m.nested":  # gguf-py's contents() flattens nested arrays; compare with what was written
                assert got == METADATA[key][0]
                assert got_type == "array[array]"
                continue
            assert got == field.contents(), key
            assert type(got) is type(field.contents()), key
            if key in METADATA:
                assert got == expected_value(*METADATA[key]), key
        assert f.metadata["general.architecture"] == "llama"
        if alignment != 32:
            assert f.metadata["general.alignment"] == alignment
            assert f.metadata_types["general.alignment"] == "u32"


def test_tensors_match_gguf_py(sample):
    path, _, alignment, _ = sample
    ref = gguf.GGUFReader(str(path))
    with ternary_rs.open(path) as f:
        assert list(f.tensors) == [t.name for t in ref.tensors]
        for t in ref.tensors:
            info = f.tensors[t.name]
            assert info.ggml_ne == tuple(int(d) for d in t.shape)
            assert info.shape == tuple(int(d) for d in t.shape[::-1])
            assert info.type_id == int(t.tensor_type)
            assert info.type == t.tensor_type.name
            assert info.offset == t.data_offset
            assert info.offset % alignment == 0
            assert info.nbytes == t.n_bytes
            assert info.file == str(path)
            raw = f.raw(t.name)
            assert raw.dtype == np.uint8 and raw.shape == (t.n_bytes,)
            np.testing.assert_array_equal(raw, np.asarray(t.data).view(np.uint8).reshape(-1))


def test_plain_tensors_decode_to_the_written_values(sample):
    path, arrays, _, big = sample
    with ternary_rs.open(path) as f:
        for name in ("token_embd.weight", "blk.0.attn_norm.weight", "blk.0.i8", "blk.0.i32", "output.weight"):
            got = f.tensor(name)
            want = arrays[name]
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, want)
            assert got.dtype.byteorder in ((">",) if big and got.dtype.itemsize > 1 else ("=", "<", "|"))
        bf16 = f.tensor("blk.0.bf16.weight")
        assert bf16.dtype.name == "bfloat16" and bf16.shape == (2, 16)
        want = gguf.quants.dequantize(arrays["blk.0.bf16.weight"].view(np.uint8), Q.BF16)
        np.testing.assert_array_equal(bf16.astype(np.float32), want)
        with pytest.raises(ternary_rs.UnsupportedTypeError, match="TQ2_0"):
            f.tensor("blk.0.attn_q.weight")


def test_ternary_blocks_round_trip_through_gguf_py_codec(sample):
    """The TQ1_0/TQ2_0 bytes ternary_rs hands out dequantize (with gguf-py's codec) to the weights."""
    path, arrays, _, _ = sample
    with ternary_rs.open(path) as f:
        for name, qt in (("blk.0.attn_q.weight", Q.TQ2_0), ("blk.0.attn_k.weight", Q.TQ1_0)):
            info = f.tensors[name]
            assert info.type == qt.name and info.shape == (3, 512)
            rows = f.raw(name).reshape(info.shape[0], -1)
            np.testing.assert_array_equal(rows, arrays[name])


def test_views_outlive_the_file_object(tmp_path, ternary_weights):
    path = tmp_path / "v.gguf"
    arrays = build_gguf(path, ternary_weights)
    f = ternary_rs.open(path)
    raw = f.raw("blk.0.attn_q.weight")
    emb = f.tensor("token_embd.weight")
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.raw("blk.0.attn_q.weight")
    del f
    gc.collect()
    np.testing.assert_array_equal(raw.reshape(3, -1), arrays["blk.0.attn_q.weight"])
    np.testing.assert_array_equal(emb, arrays["token_embd.weight"])
    assert not raw.flags.writeable and not emb.flags.writeable
    with pytest.raises(ValueError):
        raw[0] = 1
    with pytest.raises(ValueError):
        emb[0, 0] = 1


def test_open_reads_only_the_header(tmp_path):
    """A 4 GiB sparse file opens without touching its data: the header is all that is parsed."""
    path = tmp_path / "sparse.gguf"
    n = 1 << 30  # 1 Gi F32 values = 4 GiB
    name = b"big"
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    header += struct.pack("<Q", len(name)) + name + struct.pack("<IQQIQ", 2, n // 1024, 1024, 0, 0)
    data_start = (len(header) + 31) // 32 * 32
    with open(path, "wb") as fh:
        fh.write(header.ljust(data_start, b"\0"))
        fh.truncate(data_start + 4 * n)
    t0 = time.perf_counter()
    with ternary_rs.open(path) as f:
        info = f.tensors["big"]
        assert (info.shape, info.nbytes, info.offset) == ((1024, n // 1024), 4 * n, data_start)
    # Generous bound (reading 4 GiB would take seconds); the benchmark measures the real number.
    assert time.perf_counter() - t0 < 2.0


def test_id_42_variants_and_prism_types_are_named(tmp_path):
    """Type 42 at g64/18 B (upstream Q2_0) vs g128/34 B (first-gen Prism "Q2_0" → Q2_0_G128), told
    apart by byte span; 142/143/36/41 by id. Sizes from docs/formats.md#ggml-type-ids."""
    from ternary_rs.sinks.writers import GGUFWriter

    path = tmp_path / "prism.gguf"
    specs = [
        ("q2_g64", (8, 4096), 42, 8 * 4096 // 64 * 18, "Q2_0"),
        ("q2_g128", (8, 4096), 42, 8 * 4096 // 128 * 34, "Q2_0_G128"),
        ("pq2", (2, 256), 142, 2 * 2 * 34, "PQ2_0"),
        ("ptq1", (2, 256), 143, 2 * 2 * 28, "PTQ1_0"),
        ("q1", (2, 128), 41, 2 * 18, "Q1_0"),
        ("i2s", (4, 128), 36, 4 * 128 // 4 + 32, "I2_S"),
    ]
    rng = np.random.default_rng(0)
    payload = {n: rng.integers(0, 256, nb, dtype=np.uint8) for n, _, _, nb, _ in specs}
    with GGUFWriter(path) as w:
        for name, shape, tid, nbytes, _ in specs:
            w.add_tensor_info(name, shape, tid, nbytes)
        for name, *_ in specs:
            w.write_tensor_data(name, payload[name])
    with ternary_rs.open(path) as f:
        for name, shape, tid, nbytes, tname in specs:
            info = f.tensors[name]
            assert (info.type, info.type_id, info.nbytes, info.shape) == (tname, tid, nbytes, shape)
            np.testing.assert_array_equal(f.raw(name), payload[name])


def test_version_2_files_read_like_version_3(tmp_path, ternary_weights):
    """GGUF v2 has v3's layout (v3 only added big-endian support): patch the version of a gguf-py file."""
    v3 = tmp_path / "v3.gguf"
    build_gguf(v3, ternary_weights)
    blob = bytearray(v3.read_bytes())
    assert struct.unpack_from("<I", blob, 4)[0] == 3
    struct.pack_into("<I", blob, 4, 2)
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(bytes(blob))
    ref = gguf.GGUFReader(str(v2))
    assert int(ref.fields["GGUF.version"].parts[0][0]) == 2
    with ternary_rs.open(v2) as f2, ternary_rs.open(v3) as f3:
        assert f2.gguf_version == 2
        assert f2.metadata == f3.metadata
        assert f2.tensors.keys() == f3.tensors.keys()
        for t in ref.tensors:
            assert f2.tensors[t.name].offset == t.data_offset
            np.testing.assert_array_equal(f2.raw(t.name), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_type_table_matches_gguf_py_quant_sizes(tmp_path):
    """Every type of gguf-py 0.19's GGML_QUANT_SIZES: one block per row, two rows. ternary_rs's writer
    accepts exactly (block bytes × 2) and its reader reports the same size and name as GGUFReader."""
    from ternary_rs.sinks.writers import GGUFWriter

    path = tmp_path / "all_types.gguf"
    sizes = gguf.GGML_QUANT_SIZES
    with GGUFWriter(path) as w:
        for qt, (block, type_size) in sizes.items():
            w.add_tensor_info(f"t.{qt.name}", (2, block), int(qt), 2 * type_size)
        for qt, (_, type_size) in sizes.items():
            w.write_tensor_data(f"t.{qt.name}", np.full(2 * type_size, int(qt), np.uint8))
    ref = gguf.GGUFReader(str(path))
    with ternary_rs.open(path) as f:
        assert len(f.tensors) == len(sizes) == len(ref.tensors)
        for t in ref.tensors:
            info = f.tensors[t.name]
            assert (info.type, info.type_id, info.nbytes) == (t.tensor_type.name, int(t.tensor_type), t.n_bytes)
            assert info.offset == t.data_offset
