"""Other safetensors sources -> vLLM: MLX 2-bit packs and transformers BitNet packs, written here with
plain NumPy from docs/formats.md#mlx-2bit, docs/formats.md#bitnet-packing; the expected output is ``tests/support/contract_writer.py``'s."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import ternary_rs
from support import contract_writer as cw
from support.models import build_tiny_model

pytest.importorskip("torch")

LINEAR = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
          "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def assert_same_tensors(conv, ref) -> None:
    """``conv`` holds exactly the tensors of the reference directory ``ref``, bit for bit."""
    _, ours = cw.read_contract(conv)
    _, theirs = cw.read_contract(ref)
    assert set(ours) == set(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    build_tiny_model(root / "hf", arch="qwen3", group_size=128)
    return root, root / "hf"


def _ternary_parts(w: np.ndarray, g: int):
    codes, scales = cw.ternarize_groups(w, g)
    return codes, scales


def test_mlx_2bit_pack(hf):
    root, src = hf
    d = root / "mlx"
    shutil.copytree(src, d)
    tensors = load_file(d / "model.safetensors")
    out = {}
    for name, w in tensors.items():
        if name.endswith(cw.DEFAULT_TERNARY_SUFFIXES):
            codes, scales = _ternary_parts(w, 128)
            n, k = codes.shape
            c = codes.reshape(n, k // 16, 16).astype(np.uint32)
            words = np.zeros((n, k // 16), dtype=np.uint32)
            for j in range(16):  # code j of a word at bits 2j, least significant first
                words |= c[..., j] << np.uint32(2 * j)
            base = name[: -len(".weight")]
            out[name] = words
            out[base + ".scales"] = scales
            out[base + ".biases"] = (-scales.astype(np.float32)).astype(np.float16)
        else:
            out[name] = w
    save_file(out, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"] = {"group_size": 128, "bits": 2}
    (d / "config.json").write_text(json.dumps(cfg))

    r = ternary_rs.inspect(d)
    assert r["is_ternary"] and r["by_type"]["MLX"]["tensors"] == 16
    conv = ternary_rs.convert(d, root / "mlx-vllm", progress=False)
    ref = cw.write_contract(src, root / "mlx-ref", group_size=128)
    assert_same_tensors(conv, ref)
    assert "quantization" not in json.loads((conv / "config.json").read_text())
    assert ternary_rs.verify(conv).ok


def test_bitnet_pack_autobitlinear(hf):
    root, src = hf
    d = root / "bitnet"
    shutil.copytree(src, d)
    tensors = load_file(d / "model.safetensors")
    rng = np.random.default_rng(0)
    expected_dense = {}
    out = {}
    for name, w in tensors.items():
        if name.endswith(LINEAR):
            n, k = w.shape
            t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
            s = np.float32(2.0 ** -int(rng.integers(4, 8)))  # exact in fp16
            r = n // 4
            packed = np.zeros((r, k), dtype=np.uint8)
            for i in range(4):  # rows i·R + r at bits 2i (transformers' pack_weights)
                packed |= ((t[i * r:(i + 1) * r] + 1).astype(np.uint8) << (2 * i)).astype(np.uint8)
            out[name] = packed
            out[name + "_scale"] = np.array([s], dtype=np.float32)
            expected_dense[name] = (t.astype(np.float32) * s).astype(np.float16)
        else:
            out[name] = w
            expected_dense[name] = w
    save_file(out, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitnet", "linear_class": "autobitlinear",
                                  "quantization_mode": "offline"}
    (d / "config.json").write_text(json.dumps(cfg))

    conv = ternary_rs.convert(d, root / "bitnet-vllm", progress=False)
    dense_dir = root / "bitnet-dense"
    dense_dir.mkdir()
    save_file(expected_dense, str(dense_dir / "model.safetensors"))
    shutil.copy(src / "config.json", dense_dir / "config.json")
    ref = cw.write_contract(dense_dir, root / "bitnet-ref", group_size=128)
    assert_same_tensors(conv, ref)
    qc = json.loads((conv / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "ternary" and qc["group_size"] == 128


def test_gguf_to_gguf_retype_and_lossy_refusal(tmp_path):
    from ternary_rs.demo import write_demo_gguf

    src = tmp_path / "demo-PQ2_0.gguf"
    written = write_demo_gguf(src, "PQ2_0", seed=3)
    ptq = ternary_rs.convert(src, tmp_path / "demo-PTQ1_0.gguf", to="gguf", gguf_type="PTQ1_0", progress=False)
    a = ternary_rs.convert(src, tmp_path / "a", progress=False, use_transformers=False)
    b = ternary_rs.convert(ptq, tmp_path / "b", progress=False, use_transformers=False)
    _, ta = cw.read_contract(a)
    _, tb = cw.read_contract(b)
    assert set(ta) == set(tb)
    for name in ta:
        np.testing.assert_array_equal(ta[name], tb[name], err_msg=name)
    # the demo's HF-order tensors, read back with plain NumPy (qwen3: no row permutation)
    arch = ternary_rs.arch.ARCHES["qwen3"]
    for gname, t in written.items():
        prefix = arch.hf_name(gname, 2)[: -len(".weight")]
        np.testing.assert_array_equal(ta[prefix + ".qweight"], t.qweight)
        np.testing.assert_array_equal(ta[prefix + ".scales"], t.scales)
    # metadata carried over, file type updated only for upstream types
    r = ternary_rs.inspect(ptq)
    assert r["by_type"]["PTQ1_0"]["tensors"] == len(written) and not r["problems"]
    # g128 scales differ inside 256-blocks: TQ2_0 would lose information -> refused, nothing written
    with pytest.raises(ternary_rs.TernaryError, match="attn|ffn|token_embd|output"):
        ternary_rs.convert(src, tmp_path / "lossy.gguf", to="gguf", gguf_type="TQ2_0", progress=False)
    assert not (tmp_path / "lossy.gguf").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_ternary_rs_dir_via_index_regrouped(hf):
    root, src = hf
    first = ternary_rs.convert(src, root / "first", progress=False, shard_size="100KB")
    index = first / "model.safetensors.index.json"
    again = ternary_rs.convert(index, root / "again-g64", group_size=64, progress=False)
    ref = cw.write_contract(src, root / "ref-g64", group_size=64)
    qc, ours = cw.read_contract(again)
    _, theirs = cw.read_contract(ref)
    assert qc["group_size"] == 64 and set(ours) == set(theirs)
    for name in theirs:
        if name.endswith(".scales"):  # an all-zero sub-group repeats its g128 scale here (contract writer: 0)
            prefix = name[: -len(".scales")]
            np.testing.assert_array_equal(ours[prefix + ".qweight"], theirs[prefix + ".qweight"])
            np.testing.assert_array_equal(cw.dequantize(ours[prefix + ".qweight"], ours[name], 64),
                                          cw.dequantize(theirs[prefix + ".qweight"], theirs[name], 64), err_msg=name)
            nonzero = (cw.unpack_codes_lsb_first(theirs[prefix + ".qweight"]) != 1).reshape(
                ours[name].shape[0], ours[name].shape[1], 64).any(axis=-1)
            np.testing.assert_array_equal(ours[name][nonzero], theirs[name][nonzero], err_msg=name)
        else:
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    # a larger group than the source's would requantize: refused, naming the tensor
    with pytest.raises(ternary_rs.TernaryError, match=r"proj|embed|lm_head"):
        ternary_rs.convert(index, root / "again-g256", group_size=256, progress=False)
    assert not (root / "again-g256").exists()
