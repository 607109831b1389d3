"""``ternary_rs.decode(file_or_path, name)`` on real files: GGUF written by gguf-py's own writer (TQ1_0,
TQ2_0, Q1_0) and by a minimal GGUF v3 writer in this file (ids gguf-py 0.19 does not know: 42, 142, 143,
36), and safetensors checkpoints (BitNet with config.json, MLX packs, dense unpacked) written with the
``safetensors`` package. Expected values come from the NumPy references in ``tests/support/format_reference.py``.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import ternary_rs
from support import format_reference as ref

gguf = pytest.importorskip("gguf")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


def random_trits(rng, rows, cols):
    return rng.choice(np.array([-1, 0, 1], np.int8), size=(rows, cols))


def write_gguf(path, tensors):
    """Minimal GGUF v3 (little-endian, alignment 32, no metadata): tensors = [(name, [N, K], type id, bytes)]."""
    align = 32
    header = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 0))
    offset = 0
    offsets = []
    for name, shape, type_id, data in tensors:
        nb = name.encode()
        header += struct.pack("<Q", len(nb)) + nb + struct.pack("<I", len(shape))
        header += b"".join(struct.pack("<Q", d) for d in reversed(shape))  # ne[0] = K
        header += struct.pack("<IQ", type_id, offset)
        offsets.append(offset)
        offset += (len(data) + align - 1) // align * align
    header += b"\0" * (-len(header) % align)
    with open(path, "wb") as f:
        f.write(header)
        for (_, _, _, data), _off in zip(tensors, offsets):
            f.write(bytes(data))
            f.write(b"\0" * (-len(data) % align))


def test_gguf_written_by_gguf_py(tmp_path):
    rng = np.random.default_rng(1)
    trits = random_trits(rng, 8, 512)
    scales = rng.uniform(0.01, 1, size=(8, 2)).astype(np.float16)
    signs = np.where(random_trits(rng, 8, 256) >= 0, 1, -1).astype(np.int8)
    q1_scales = rng.uniform(0.01, 1, size=(8, 2)).astype(np.float16)
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    tq2 = ref.encode_tq2_0(trits, scales).reshape(8, -1)
    tq1 = ref.encode_tq1_0(trits, scales).reshape(8, -1)
    q1 = ref.encode_q1_0(signs, q1_scales).reshape(8, -1)
    w.add_tensor("blk.0.ffn_up.weight", tq2, raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
    w.add_tensor("blk.0.ffn_gate.weight", tq1, raw_dtype=gguf.GGMLQuantizationType.TQ1_0)
    w.add_tensor("blk.0.attn_q.weight", q1, raw_dtype=gguf.GGMLQuantizationType.Q1_0)
    w.add_tensor("output_norm.weight", np.ones(512, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    f = ternary_rs.open(path)
    for name in ("blk.0.ffn_up.weight", "blk.0.ffn_gate.weight"):
        t = ternary_rs.decode(f, name)
        assert t.shape == (8, 512) and t.group_size == 256
        np.testing.assert_array_equal(t.trits(), trits)
        np.testing.assert_array_equal(t.scales, scales)
    # decode by path, regrouped on the way
    t = ternary_rs.decode(str(path), "blk.0.ffn_up.weight", group_size=64)
    assert t.group_size == 64
    np.testing.assert_array_equal(t.dequantize("float32"), ref.dequantize(trits, scales))
    q = ternary_rs.decode(f, "blk.0.attn_q.weight")
    np.testing.assert_array_equal(q.trits(), signs)
    # gguf-py's own dequantizer agrees with ours on the file's bytes
    from gguf.quants import dequantize

    np.testing.assert_array_equal(
        ternary_rs.decode(f, "blk.0.ffn_gate.weight").dequantize("float32"),
        dequantize(f.raw("blk.0.ffn_gate.weight").reshape(8, -1), gguf.GGMLQuantizationType.TQ1_0))
    with pytest.raises(ternary_rs.ValidationError, match="output_norm"):
        ternary_rs.decode(f, "output_norm.weight")  # 1-D float norm: not a [N, K] ternary weight
    f.close()


def test_gguf_prism_and_bitnet_cpp_types(tmp_path):
    rng = np.random.default_rng(2)
    # [8, 512]: the two id-42 variants' byte spans (1088 vs 1152) differ by more than the alignment,
    # which is how a reader tells them apart.
    trits = random_trits(rng, 8, 512)
    s128 = rng.uniform(0.01, 1, size=(8, 4)).astype(np.float16)
    s64 = np.repeat(s128, 2, axis=1)
    tensors = [
        ("pq2", [8, 512], 142, ref.encode_consecutive(trits, s128, 128)),
        ("ptq1", [8, 512], 143, ref.encode_ptq1_0(trits, s128)),
        ("q2_g128", [8, 512], 42, ref.encode_consecutive(trits, s128, 128)),
        ("q2_g64", [8, 512], 42, ref.encode_consecutive(trits, s64, 64)),
        ("i2s", [8, 512], 36, ref.encode_i2_s(trits, np.float32(0.375))),
        # id 39 is bitnet.cpp TL2 and upstream MXFP4 (17 B / 32): sized as MXFP4 so the reader accepts it
        ("tl2", [4, 256], 39, np.zeros(4 * 256 // 32 * 17, np.uint8)),
        ("tail", [32], 0, np.zeros(32, np.float32).view(np.uint8)),
    ]
    path = tmp_path / "prism.gguf"
    write_gguf(path, tensors)
    f = ternary_rs.open(path)
    for name in ("pq2", "ptq1", "q2_g128"):
        t = ternary_rs.decode(f, name)
        assert t.group_size == 128, name
        np.testing.assert_array_equal(t.trits(), trits)
        np.testing.assert_array_equal(t.scales, s128)
    t = ternary_rs.decode(f, "q2_g64")
    assert t.group_size == 64
    np.testing.assert_array_equal(t.dequantize("float32"), ref.dequantize(trits, s64))
    t = ternary_rs.decode(f, "i2s")
    np.testing.assert_array_equal(t.trits(), trits)
    assert (t.scales == np.float16(0.375)).all()
    with pytest.raises(ternary_rs.UnsupportedTypeError, match="TL2"):
        ternary_rs.decode(f, "tl2")
    with pytest.raises(ternary_rs.UnsupportedTypeError, match="TL2"):
        ternary_rs.decode(f, "tl2", format="TL2")
    f.close()


@pytest.mark.parametrize("linear_class", [None, "bitlinear", "autobitlinear"])
def test_bitnet_safetensors_checkpoint(tmp_path, linear_class):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    rng = np.random.default_rng(3)
    trits = random_trits(rng, 16, 128)
    stored = 0.0625 if linear_class == "autobitlinear" else 16.0
    qc = {"quant_method": "bitnet"}
    if linear_class:
        qc["linear_class"] = linear_class
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    save_file({
        "model.layers.0.mlp.down_proj.weight": torch.from_numpy(ref.pack_bitnet(trits)),
        "model.layers.0.mlp.down_proj.weight_scale": torch.tensor([stored], dtype=torch.bfloat16),
    }, str(tmp_path / "model.safetensors"))
    t = ternary_rs.decode(tmp_path, "model.layers.0.mlp.down_proj.weight")
    assert t.shape == (16, 128)
    np.testing.assert_array_equal(t.trits(), trits)
    assert (t.scales == np.float16(0.0625)).all()  # 1/16 under bitlinear, 0.0625 directly under autobitlinear
    # The explicit override wins over config.json.
    other = "autobitlinear" if linear_class != "autobitlinear" else "bitlinear"
    t2 = ternary_rs.decode(tmp_path, "model.layers.0.mlp.down_proj.weight", linear_class=other)
    assert (t2.scales == ref.bitnet_scale(stored, other)).all()


def test_mlx_and_dense_safetensors(tmp_path):
    pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(4)
    trits = random_trits(rng, 8, 256)
    scales = rng.uniform(0.01, 1, size=(8, 2)).astype(np.float16)
    dense = ref.dequantize(trits, scales)
    safetensors_numpy.save_file({
        "language_model.layers.0.mlp.up_proj.weight": ref.pack_mlx(trits),
        "language_model.layers.0.mlp.up_proj.scales": scales,
        "language_model.layers.0.mlp.up_proj.biases": -scales,
        "model.layers.0.mlp.up_proj.weight": dense.astype(np.float16),
        "model.layers.1.mlp.up_proj.weight": dense.astype(np.float32),
        "model.layers.2.mlp.up_proj.weight": np.where(trits == 0, 0.3, dense).astype(np.float16),
    }, str(tmp_path / "model.safetensors"))
    f = ternary_rs.open(tmp_path / "model.safetensors")
    t = ternary_rs.decode(f, "language_model.layers.0.mlp.up_proj.weight")
    assert t.group_size == 128
    np.testing.assert_array_equal(t.trits(), trits)
    np.testing.assert_array_equal(t.scales, scales)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        d = ternary_rs.decode(f, name)
        np.testing.assert_array_equal(d.trits(), trits)
        np.testing.assert_array_equal(d.scales, scales)
    with pytest.raises(ternary_rs.ValidationError, match=r"layers\.2.*not ternary"):
        ternary_rs.decode(f, "model.layers.2.mlp.up_proj.weight")
    f.close()
