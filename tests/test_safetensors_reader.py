"""ternary_rs.open on safetensors files and sharded checkpoints written by the `safetensors` package,
compared with `safetensors.safe_open`; offsets checked against a plain parse of the JSON header; an
MLX-style file with a tensor at an offset not aligned to its dtype; model directories."""

from __future__ import annotations

import gc
import json
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_file_torch

import ternary_rs


def header_offsets(path):
    """{name: (dtype, shape, absolute start, nbytes)} from the file's own JSON header."""
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), 8 + n + v["data_offsets"][0],
                v["data_offsets"][1] - v["data_offsets"][0]) for k, v in header.items()}


def numpy_tensors(rng):
    return {
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.layers.0.mlp.up_proj.qweight": rng.integers(0, 256, (8, 2), dtype=np.uint8),
        "model.layers.0.mlp.up_proj.scales": rng.standard_normal((8, 1)).astype(np.float16),
        "f64": rng.standard_normal(3),
        "i8": rng.integers(-128, 128, (5,), dtype=np.int8),
        "i16": rng.integers(-1000, 1000, (2, 2), dtype=np.int16),
        "u16": rng.integers(0, 60000, (3,), dtype=np.uint16),
        "i32": rng.integers(-(2**31), 2**31, (4,), dtype=np.int32),
        "u32": rng.integers(0, 2**32, (1, 3), dtype=np.uint32),
        "i64": np.array([-(2**63), 2**63 - 1], dtype=np.int64),
        "u64": np.array([0, 2**64 - 1], dtype=np.uint64),
        "bool": np.array([[True, False], [False, True]]),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def check_against_safe_open(f, path, want=None):
    offsets = header_offsets(path)
    with safe_open(str(path), framework="pt") as ref:
        for name in ref.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
            info = f.tensors[name]
            sl = ref.get_slice(name)
            assert info.type == sl.get_dtype()
            assert info.shape == tuple(sl.get_shape())
            assert info.type_id is None and info.ggml_ne is None
            assert info.file == str(path)
            assert (info.type, info.shape, info.offset, info.nbytes) == offsets[name]
            t = ref.get_tensor(name)
            ref_bytes = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
            np.testing.assert_array_equal(f.raw(name), ref_bytes)
            if want is not None and name in want:
                np.testing.assert_array_equal(f.tensor(name), want[name])


def test_single_file_matches_safe_open(tmp_path, rng):
    want = numpy_tensors(rng)
    path = tmp_path / "model.safetensors"
    save_file(want, str(path), metadata={"format": "pt", "note": "ünïcode"})
    with ternary_rs.open(path) as f:
        assert f.format == "safetensors" and f.gguf_version is None and f.alignment is None
        assert f.metadata == {"format": "pt", "note": "ünïcode"}
        assert set(f.tensors) == set(want)
        # File order = data offset order.
        offs = [i.offset for i in f.tensors.values()]
        assert offs == sorted(offs)
        check_against_safe_open(f, path, want)
        assert f.tensor("scalar").shape == ()
        assert f.tensor("empty").shape == (0, 4)


def test_torch_only_dtypes(tmp_path):
    """BF16 and the F8 dtypes (written with safetensors.torch) come back as ml_dtypes arrays."""
    src = torch.linspace(-3, 3, 24).reshape(4, 6)
    tensors = {
        "bf16": src.to(torch.bfloat16),
        "f8_e4m3": src.to(torch.float8_e4m3fn),
        "f8_e5m2": src.to(torch.float8_e5m2),
        "f16": src.to(torch.float16),
    }
    path = tmp_path / "t.safetensors"
    save_file_torch(tensors, str(path))
    with ternary_rs.open(path) as f:
        check_against_safe_open(f, path)
        assert [f.tensors[k].type for k in ("bf16", "f8_e4m3", "f8_e5m2", "f16")] == ["BF16", "F8_E4M3", "F8_E5M2", "F16"]
        bf = f.tensor("bf16")
        assert bf.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(bf.astype(np.float32), tensors["bf16"].float().numpy())
        e4 = f.tensor("f8_e4m3")
        np.testing.assert_array_equal(e4.astype(np.float32), tensors["f8_e4m3"].float().numpy())


def write_sharded(tmp_path, rng, n_shards=3):
    want = numpy_tensors(rng)
    names = list(want)
    weight_map = {}
    for s in range(n_shards):
        shard = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: want[k] for k in names[s::n_shards]}
        save_file(part, str(tmp_path / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    index = {"metadata": {"total_size": int(sum(v.nbytes for v in want.values()))}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return want, weight_map


def test_sharded_checkpoint_matches_safe_open(tmp_path, rng):
    want, weight_map = write_sharded(tmp_path, rng)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8}))
    for target in (tmp_path, tmp_path / "model.safetensors.index.json"):
        with ternary_rs.open(target) as f:
            assert f.format == "safetensors"
            assert set(f.tensors) == set(want)
            assert f.files == sorted(str(tmp_path / s) for s in set(weight_map.values()))
            assert f.index_metadata == {"total_size": sum(v.nbytes for v in want.values())}
            assert f.config == {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8}
            assert f.metadata == {"format": "pt"}
            for name, info in f.tensors.items():
                assert info.file == str(tmp_path / weight_map[name])
            for shard in set(weight_map.values()):
                with safe_open(str(tmp_path / shard), framework="pt") as ref:
                    for name in ref.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                        np.testing.assert_array_equal(f.tensor(name), want[name])
                check_against_safe_open(_OneShard(f, tmp_path / shard), tmp_path / shard, want)


class _OneShard:
    """The tensors of one shard of an open checkpoint, for check_against_safe_open."""

    def __init__(self, f, shard):
        self.tensors = {k: v for k, v in f.tensors.items() if v.file == str(shard)}
        self.raw, self.tensor = f.raw, f.tensor


def write_mlx_style(path):
    """A header written by hand (like MLX does) so F32 and F16 tensors start at odd offsets."""
    u8 = np.arange(3, dtype=np.uint8)
    f32 = np.array([[1.5, -2.25], [3.0, 1e-3]], dtype=np.float32)
    f16 = np.array([0.5, -7.0, 65504.0], dtype=np.float16)
    header = {
        "__metadata__": {"format": "mlx"},
        "a_u8": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b_f32": {"dtype": "F32", "shape": [2, 2], "data_offsets": [3, 19]},
        "c_f16": {"dtype": "F16", "shape": [3], "data_offsets": [19, 25]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + u8.tobytes() + f32.tobytes() + f16.tobytes())
    return {"a_u8": u8, "b_f32": f32, "c_f16": f16}


def test_unaligned_mlx_style_tensors_are_read_by_copy(tmp_path):
    path = tmp_path / "mlx.safetensors"
    want = write_mlx_style(path)
    with ternary_rs.open(path) as f:
        assert f.tensors["b_f32"].offset % 4 == 3
        assert f.metadata == {"format": "mlx"}
        for name, arr in want.items():
            got = f.tensor(name)
            assert got.dtype == arr.dtype and got.flags.aligned
            np.testing.assert_array_equal(got, arr)
        check_against_safe_open(f, path, want)


def test_directory_with_single_file_and_config(tmp_path, rng):
    want = numpy_tensors(rng)
    save_file(want, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with ternary_rs.open(tmp_path) as f:
        assert f.path == str(tmp_path)
        assert f.config == {"model_type": "llama"}
        assert f.metadata == {}
        assert "empty" in f and len(f) == len(want)
        assert "safetensors" in repr(f)


def test_gguf_directory_and_missing_config(tmp_path):
    from ternary_rs.sinks.writers import GGUFWriter

    with GGUFWriter(tmp_path / "m.gguf") as w:
        w.add_metadata("general.architecture", "llama")
    with ternary_rs.open(tmp_path) as f:
        assert f.format == "gguf" and f.config is None and f.tensors == {}


def test_views_outlive_the_file_object(tmp_path, rng):
    want, _ = write_sharded(tmp_path, rng)
    f = ternary_rs.open(tmp_path)
    views = {name: f.tensor(name) for name in want}
    raws = {name: f.raw(name) for name in want}
    f.close()
    del f
    gc.collect()
    for name, arr in want.items():
        np.testing.assert_array_equal(views[name], arr)
        assert raws[name].nbytes == arr.nbytes
        assert not raws[name].flags.writeable


def test_aligned_tensors_are_zero_copy(tmp_path, rng):
    want = numpy_tensors(rng)
    path = tmp_path / "z.safetensors"
    save_file(want, str(path))
    with ternary_rs.open(path) as f:
        a = f.tensor("model.embed_tokens.weight")
        b = f.tensor("model.embed_tokens.weight")
        assert np.shares_memory(a, b)  # both view the same mapped bytes
        assert np.shares_memory(a, f.raw("model.embed_tokens.weight"))
        assert not a.flags.writeable and not a.flags.owndata


def test_missing_tensor_name(tmp_path, rng):
    path = tmp_path / "m.safetensors"
    save_file(numpy_tensors(rng), str(path))
    with ternary_rs.open(path) as f, pytest.raises(KeyError, match="nope"):
        f.raw("nope")


# Every dtype of safetensors 0.8 with its size in bits (the Rust crate's Dtype::bitsize).
ALL_DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}


def test_every_safetensors_dtype_is_listed(tmp_path):
    """A hand-written header with one 4x8 tensor of each dtype (sub-byte ones packed)."""
    header, offset, blobs = {}, 0, []
    for i, (dtype, bits) in enumerate(ALL_DTYPE_BITS.items()):
        n = 4 * 8 * bits // 8
        header[f"t{i:02d}.{dtype}"] = {"dtype": dtype, "shape": [4, 8], "data_offsets": [offset, offset + n]}
        blobs.append(bytes([i]) * n)
        offset += n
    text = json.dumps(header).encode()
    path = tmp_path / "all.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    with ternary_rs.open(path) as f:
        assert [i.type for i in f.tensors.values()] == list(ALL_DTYPE_BITS)
        for i, (name, info) in enumerate(f.tensors.items()):
            assert info.shape == (4, 8) and info.nbytes == 4 * ALL_DTYPE_BITS[info.type]
            assert (f.raw(name) == i).all()
        np.testing.assert_array_equal(f.tensor("t17.F32"), np.frombuffer(bytes([17]) * 128, np.float32).reshape(4, 8))
        with pytest.raises(ternary_rs.UnsupportedTypeError, match="F4"):
            f.tensor("t01.F4")
    with safe_open(str(path), framework="np") as ref:  # the reference accepts the same header
        assert sorted(ref.keys()) == sorted(header)
