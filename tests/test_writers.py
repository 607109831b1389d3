"""The streaming writers, checked with independent readers: gguf-py's GGUFReader for GGUF (metadata
and tensors; for type ids gguf-py cannot name, the tensor-info fields it parses plus raw bytes), and
`safetensors.safe_open` for safetensors."""

from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT
from gguf.quants import quantize
from safetensors import safe_open

import ternary_rs
from ternary_rs.sinks.writers import GGUFWriter, SafetensorsWriter

VT_NAMES = {
    "u8": VT.UINT8, "i8": VT.INT8, "u16": VT.UINT16, "i16": VT.INT16, "u32": VT.UINT32, "i32": VT.INT32,
    "f32": VT.FLOAT32, "bool": VT.BOOL, "string": VT.STRING, "u64": VT.UINT64, "i64": VT.INT64,
    "f64": VT.FLOAT64,
}

# key -> (value, explicit type or None to infer, the gguf-py types GGUFReader must report)
METADATA = {
    "general.architecture": ("llama", None, [VT.STRING]),
    "inferred.int": (-7, None, [VT.INT32]),
    "inferred.float": (0.25, None, [VT.FLOAT32]),
    "inferred.bool": (True, None, [VT.BOOL]),
    "inferred.strings": (["a", "bé", ""], None, [VT.ARRAY, VT.STRING]),
    "inferred.ints": ([1, 2, 3], None, [VT.ARRAY, VT.INT32]),
    "inferred.np_u16": (np.uint16(65535), None, [VT.UINT16]),
    "x.u8": (200, "u8", [VT.UINT8]),
    "x.i8": (-100, "i8", [VT.INT8]),
    "x.u16": (60000, "u16", [VT.UINT16]),
    "x.i16": (-30000, "i16", [VT.INT16]),
    "x.u32": (4_000_000_000, "u32", [VT.UINT32]),
    "x.i32": (-5, "i32", [VT.INT32]),
    "x.f32": (1.5, "f32", [VT.FLOAT32]),
    "x.bool": (False, "bool", [VT.BOOL]),
    "x.string": ("chat {{ template }}", "string", [VT.STRING]),
    "x.u64": (2**64 - 1, "u64", [VT.UINT64]),
    "x.i64": (-(2**63), "i64", [VT.INT64]),
    "x.f64": (1e-310, "f64", [VT.FLOAT64]),
    "x.i8s": ([-128, 0, 127], "array[i8]", [VT.ARRAY, VT.INT8]),
    "x.f32s": (np.array([0.5, -1.0], dtype=np.float32), "array[f32]", [VT.ARRAY, VT.FLOAT32]),
    "x.u64s": ([2**64 - 1], "array[u64]", [VT.ARRAY, VT.UINT64]),
    "x.empty": ([], "array[string]", [VT.ARRAY, VT.STRING]),
    "x.bools": ([True, False], "array[bool]", [VT.ARRAY, VT.BOOL]),
}


class InfoOnlyReader(gguf.GGUFReader):
    """GGUFReader that parses tensor infos but does not build tensors (gguf-py raises on type ids it
    does not know, such as 42, 142 and 143)."""

    def _build_tensors(self, start_offs, fields):
        self.data_start = start_offs
        self.tensor_fields = fields


def ternary_tensors(ternary_weights):
    w = ternary_weights(4, 512)
    return {
        "blk.0.attn_q.weight": (quantize(w, Q.TQ2_0), Q.TQ2_0, (4, 512)),
        "blk.0.attn_k.weight": (quantize(w, Q.TQ1_0), Q.TQ1_0, (4, 512)),
        "blk.0.attn_norm.weight": (np.linspace(0, 1, 512, dtype=np.float32), Q.F32, (512,)),
        "blk.0.ffn_norm.weight": (np.linspace(0, 1, 64, dtype=np.float16).reshape(2, 32), Q.F16, (2, 32)),
        "blk.0.q8": (quantize(w[:, :64], Q.Q8_0), Q.Q8_0, (4, 64)),
    }


@pytest.mark.parametrize("alignment", [32, 64, 256])
def test_gguf_writer_output_reads_back_in_gguf_py(tmp_path, ternary_weights, alignment):
    path = tmp_path / "w.gguf"
    tensors = ternary_tensors(ternary_weights)
    with GGUFWriter(path, alignment=alignment) as w:
        for key, (value, t, _) in METADATA.items():
            w.add_metadata(key, value, type=t)
        for name, (data, qt, shape) in tensors.items():
            w.add_tensor_info(name, shape, int(qt), data.nbytes)
        for name, (data, _, _) in tensors.items():
            flat = data.reshape(-1).view(np.uint8)
            w.write_tensor_data(name, flat[:7])  # in chunks
            w.write_tensor_data(name, flat[7:])
    ref = gguf.GGUFReader(str(path))
    assert ref.alignment == alignment
    for key, (value, _, types) in METADATA.items():
        field = ref.fields[key]
        if key == "x.empty":  # gguf-py lists no element type for an empty array; read its part
            assert field.types == [VT.ARRAY] and int(field.parts[3][0]) == VT.STRING
            assert int(field.parts[4][0]) == 0
            continue
        assert field.types == types, key
        want = value.tolist() if isinstance(value, np.ndarray) else value
        if types[-1] == VT.FLOAT32:
            want = np.float32(want).tolist()
        got = field.contents()
        assert got == (int(want) if isinstance(want, np.integer) else want), key
    if alignment != 32:
        assert ref.fields["general.alignment"].contents() == alignment
    assert [t.name for t in ref.tensors] == list(tensors)
    for t in ref.tensors:
        data, qt, shape = tensors[t.name]
        assert t.tensor_type == qt
        assert tuple(int(d) for d in t.shape[::-1]) == shape
        assert t.data_offset % alignment == 0
        np.testing.assert_array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), data.reshape(-1).view(np.uint8))
    # And ternary_rs reads its own output the same way.
    with ternary_rs.open(path) as f:
        for t in ref.tensors:
            assert f.tensors[t.name].offset == t.data_offset


def test_nested_arrays_round_trip(tmp_path):
    path = tmp_path / "nested.gguf"
    nested = [[1, 2], [3], []]
    with GGUFWriter(path) as w:
        w.add_metadata("nested.u8", nested, type="array[array[u8]]")
        w.add_metadata("nested.mixed", [["a", "b"], [1.5]])  # inner types inferred per element
    with ternary_rs.open(path) as f:
        assert f.metadata["nested.u8"] == nested
        assert f.metadata["nested.mixed"] == [["a", "b"], [1.5]]
        assert f.metadata_types["nested.u8"] == "array[array]"
    ref = gguf.GGUFReader(str(path))
    assert ref.fields["nested.u8"].types[:2] == [VT.ARRAY, VT.ARRAY]
    # gguf-py keeps the raw parts: value type, element type, count, then (inner type, count, items…)…
    flat = [int(x) for p in ref.fields["nested.u8"].parts[2:] for x in np.asarray(p).reshape(-1)]
    assert flat == [int(VT.ARRAY), int(VT.ARRAY), 3, int(VT.UINT8), 2, 1, 2, int(VT.UINT8), 1, 3, int(VT.UINT8), 0]


def test_prism_and_unknown_type_ids_are_written_raw(tmp_path):
    """Types 142 (PQ2_0), 143 (PTQ1_0), 42 (either Q2_0) and 36 (I2_S): gguf-py cannot name them, so
    compare the tensor infos it parses and the raw bytes at its offsets."""
    rng = np.random.default_rng(1)
    specs = [  # name, torch shape, type id, nbytes from docs/formats.md#ggml-type-ids
        ("pq2", (3, 256), 142, 3 * 2 * 34),
        ("ptq1", (3, 256), 143, 3 * 2 * 28),
        ("q2_g128", (16, 2048), 42, 16 * 16 * 34),
        ("q2_g64", (16, 2048), 42, 16 * 32 * 18),
        ("i2s", (8, 128), 36, 8 * 128 // 4 + 32),
        ("norm", (256,), 0, 1024),
    ]
    data = {n: rng.integers(0, 256, nb, dtype=np.uint8) for n, _, _, nb in specs}
    path = tmp_path / "prism.gguf"
    with GGUFWriter(path, alignment=64) as w:
        w.add_metadata("general.architecture", "qwen35")
        w.add_metadata("tokenizer.ggml.token_type", [1, 2, 3], type="array[i32]")
        for name, shape, tid, nb in specs:
            w.add_tensor_info(name, shape, tid, nb)
        for name, *_ in specs:
            w.write_tensor_data(name, data[name])
    ref = InfoOnlyReader(str(path))
    assert ref.fields["general.architecture"].contents() == "qwen35"
    assert ref.fields["tokenizer.ggml.token_type"].contents() == [1, 2, 3]
    raw = np.fromfile(path, dtype=np.uint8)
    for field, (name, shape, tid, nb) in zip(ref.tensor_fields, specs):
        _, name_b, n_dims, dims, type_id, offset = field.parts
        assert bytes(name_b).decode() == name
        assert int(n_dims[0]) == len(shape) and tuple(int(d) for d in dims[::-1]) == shape
        assert int(type_id[0]) == tid
        start = ref.data_start + int(offset[0])
        assert start % 64 == 0
        np.testing.assert_array_equal(raw[start:start + nb], data[name])
    with ternary_rs.open(path) as f:
        assert [f.tensors[n].type for n, *_ in specs] == ["PQ2_0", "PTQ1_0", "Q2_0_G128", "Q2_0", "I2_S", "F32"]


def test_gguf_writer_refuses_misuse_and_cleans_up(tmp_path):
    path = tmp_path / "bad.gguf"
    w = GGUFWriter(path)
    with pytest.raises(ValueError, match="inconsistent"):
        w.add_tensor_info("t", (4, 256), "TQ2_0", 100)
    w.add_tensor_info("a", (4,), "F32", 16)
    w.add_tensor_info("b", (4,), "F32", 16)
    with pytest.raises(ValueError, match="next tensor to write is 'a'"):
        w.write_tensor_data("b", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="exceed"):
        w.write_tensor_data("a", np.zeros(5, np.float32))
    w.write_tensor_data("a", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="after tensor data"):
        w.add_metadata("late", 1)
    with pytest.raises(ValueError, match="received 0 of its 16 bytes"):
        w.close()
    w.abort()
    assert not path.exists()
    with pytest.raises(ValueError, match="power of two"):
        GGUFWriter(tmp_path / "x.gguf", alignment=48)
    with pytest.raises(ValueError, match="empty list"):
        GGUFWriter(tmp_path / "y.gguf").add_metadata("k", [])
    with pytest.raises(ValueError):
        GGUFWriter(tmp_path / "z.gguf").add_metadata("k", 300, type="u8")
    with pytest.raises(RuntimeError), GGUFWriter(tmp_path / "ctx.gguf") as w:
        w.add_tensor_info("a", (4,), "F32", 16)
        raise RuntimeError("boom")
    assert not (tmp_path / "ctx.gguf").exists()


def test_safetensors_writer_output_matches_safe_open(tmp_path, rng):
    arrays = {
        "w.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "w.f64": rng.standard_normal(2),
        "w.bf16": rng.standard_normal((2, 4)).astype(ml_dtypes.bfloat16),
        "w.f16": rng.standard_normal((4,)).astype(np.float16),
        "w.i64": np.array([-1, 2**62], dtype=np.int64),
        "w.i32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "w.u32": np.array([2**32 - 1], dtype=np.uint32),
        "w.qweight": rng.integers(0, 256, (4, 8), dtype=np.uint8),
        "w.i8": np.array([-128, 127], dtype=np.int8),
        "w.bool": np.array([True, False, True]),
        "w.empty": np.zeros((0,), np.float32),
    }
    path = tmp_path / "out.safetensors"
    spec = [(k, v.dtype, v.shape) for k, v in arrays.items()]
    spec[0] = ("w.f32", "F32", (3, 5))  # names work as well as NumPy dtypes
    with SafetensorsWriter(path, spec, metadata={"format": "pt"}) as w:
        for k, v in arrays.items():
            flat = v.reshape(-1)
            w.write(k, flat[: flat.size // 2])
            w.write(k, flat[flat.size // 2:])
    with safe_open(str(path), framework="np") as ref:
        assert ref.metadata() == {"format": "pt"}
        assert set(ref.keys()) == set(arrays)
        for k, v in arrays.items():
            if k == "w.bf16":  # safetensors' NumPy backend has no bfloat16; compare the bits
                assert ref.get_slice(k).get_dtype() == "BF16"
                continue
            np.testing.assert_array_equal(ref.get_tensor(k), v)
    with safe_open(str(path), framework="pt") as ref:
        import torch

        got = ref.get_tensor("w.bf16").view(torch.int16).numpy()
        np.testing.assert_array_equal(got, arrays["w.bf16"].view(np.int16))


def test_safetensors_writer_refuses_misuse(tmp_path):
    path = tmp_path / "bad.safetensors"
    w = SafetensorsWriter(path, [("a", "F32", (2,)), ("b", "U8", (3,))])
    with pytest.raises(ValueError, match="next tensor to write is 'a'"):
        w.write("b", b"abc")
    w.write("a", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="exceed"):
        w.write("b", b"abcd")
    with pytest.raises(ValueError, match="received 0 of its 3 bytes"):
        w.close()
    w.abort()
    assert not path.exists()
    with pytest.raises(ValueError, match="duplicate"):
        SafetensorsWriter(tmp_path / "d.safetensors", [("a", "F32", (1,)), ("a", "F32", (1,))])
    with pytest.raises(TypeError, match="unknown safetensors dtype"):
        SafetensorsWriter(tmp_path / "e.safetensors", [("a", "F17", (1,))])


def test_torch_tensors_are_accepted(tmp_path):
    import torch

    t = torch.linspace(-1, 1, 8, dtype=torch.bfloat16)
    path = tmp_path / "t.safetensors"
    with SafetensorsWriter(path, [("t", "BF16", (8,))]) as w:
        w.write("t", t)
    with safe_open(str(path), framework="pt") as ref:
        assert torch.equal(ref.get_tensor("t"), t)


def test_copying_read_only_views_between_files(tmp_path, ternary_weights):
    """The converter's pattern: stream read-only mapped views from one file into a new one."""
    src = tmp_path / "src.gguf"
    tensors = ternary_tensors(ternary_weights)
    with GGUFWriter(src) as w:
        for name, (data, qt, shape) in tensors.items():
            w.add_tensor_info(name, shape, int(qt), data.nbytes)
        for name, (data, _, _) in tensors.items():
            w.write_tensor_data(name, data)
    dst = tmp_path / "dst.gguf"
    with ternary_rs.open(src) as f, GGUFWriter(dst, alignment=128) as w:
        for info in f.tensors.values():
            w.add_tensor_info(info.name, info.shape, info.type_id, info.nbytes)
        for name in f.tensors:
            view = f.raw(name)
            assert not view.flags.writeable
            w.write_tensor_data(name, view)
    ref = gguf.GGUFReader(str(dst))
    assert ref.alignment == 128
    for t in ref.tensors:
        np.testing.assert_array_equal(np.asarray(t.data).view(np.uint8).reshape(-1),
                                      tensors[t.name][0].reshape(-1).view(np.uint8))
