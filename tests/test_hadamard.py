"""The FWHT op (``torch.ops.ternary_rs.fwht``), the rotation description and the vLLM-side transforms.

Reference: ``scipy.linalg.hadamard`` (dense Sylvester matrix) in float64 — never the code under test.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.linalg import hadamard

import ternary_rs
from ternary_rs.core import hadamard as H
from ternary_rs.serving import ops
from ternary_rs.vllm import hadamard as VH


def scipy_reference(x, block, signs=None, inverse=False, gather=None):
    x = np.asarray(x, dtype=np.float64)
    if gather is not None:
        x = x[..., gather]
    if signs is not None and not inverse:
        x = x * signs
    h = hadamard(block).astype(np.float64) / math.sqrt(block)
    y = (x.reshape(*x.shape[:-1], -1, block) @ h.T).reshape(x.shape)
    if signs is not None and inverse:
        y = y * signs
    return y


def rand_signs(rng, n):
    return rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=n)


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block,width,rows", [(1, 3, 2), (2, 6, 1), (8, 64, 3), (128, 256, 5), (256, 768, 4),
                                              (1024, 2048, 2), (1024, 5120, 1), (64, 64, 300)])
def test_fwht_matches_scipy(dtype, block, width, rows):
    rng = np.random.default_rng(block + width)
    x = torch.from_numpy(rng.standard_normal((rows, width)).astype(np.float32)).to(dtype)
    s = rand_signs(rng, width)
    y = torch.ops.ternary_rs.fwht(x, block, torch.from_numpy(s), False, None)
    assert y.dtype == dtype and y.shape == x.shape
    want = scipy_reference(x.float().numpy(), block, s)
    np.testing.assert_allclose(y.float().numpy(), want, atol=TOL[dtype] * max(1.0, np.abs(want).max()), rtol=0)


def test_fwht_f32_close_and_signs_gather_inverse():
    rng = np.random.default_rng(1)
    width, block = 512, 128
    x = rng.standard_normal((7, width)).astype(np.float32)
    s = rand_signs(rng, width)
    g = rng.permutation(width).astype(np.int32)
    y = torch.ops.ternary_rs.fwht(torch.from_numpy(x), block, torch.from_numpy(s), False, torch.from_numpy(g))
    np.testing.assert_allclose(y.numpy(), scipy_reference(x, block, s, gather=g), atol=1e-5)
    yi = torch.ops.ternary_rs.fwht(torch.from_numpy(x), block, torch.from_numpy(s), True, None)
    np.testing.assert_allclose(yi.numpy(), scipy_reference(x, block, s, inverse=True), atol=1e-5)
    # No signs: plain normalized transform.
    y0 = torch.ops.ternary_rs.fwht(torch.from_numpy(x), block, None, False, None)
    np.testing.assert_allclose(y0.numpy(), scipy_reference(x, block), atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(log_block=st.integers(0, 10), blocks=st.integers(1, 4), rows=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_round_trip_is_identity(log_block, blocks, rows, seed):
    """H·D is orthogonal: forward (x·s then H) followed by inverse (H then ·s) gives x back."""
    block = 1 << log_block
    width = block * blocks
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((rows, width)).astype(np.float32))
    s = torch.from_numpy(rand_signs(rng, width))
    y = torch.ops.ternary_rs.fwht(x, block, s, False, None)
    back = torch.ops.ternary_rs.fwht(y, block, s, True, None)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)
    # Norm preserved (orthogonal transform).
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)


def test_higher_dims_and_noncontiguous_and_empty():
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.standard_normal((2, 3, 256)).astype(np.float32))
    y = torch.ops.ternary_rs.fwht(x, 64, None, False, None)
    np.testing.assert_allclose(y.numpy(), scipy_reference(x.numpy(), 64), atol=1e-5)
    xt = torch.from_numpy(rng.standard_normal((128, 6)).astype(np.float32)).T  # non-contiguous
    np.testing.assert_allclose(torch.ops.ternary_rs.fwht(xt, 32, None, False, None).numpy(),
                               scipy_reference(xt.numpy(), 32), atol=1e-5)
    assert torch.ops.ternary_rs.fwht(torch.empty(0, 64), 64, None, False, None).shape == (0, 64)


def test_many_rows_on_torch_pool_equal_rayon_bit_for_bit():
    """The op's CPU path splits many rows over torch's intra-op pool (``torch_pool=True``), conversions over
    the rayon pool: the same transform row by row, so the same bits (and a few rows stay on one thread)."""
    from ternary_rs import _core

    assert ops.NATIVE_CPU_UNAVAILABLE is None  # the torch pool is reachable once the native op is registered
    rng = np.random.default_rng(7)
    for rows, width, gather in ((64, 5120, True), (3, 17408, False), (1, 1024, False)):
        x = torch.from_numpy(rng.standard_normal((rows, width)).astype(np.float32)).bfloat16()
        signs = rand_signs(rng, width)
        g = rng.permutation(width).astype(np.uint32) if gather else None
        src = x.view(torch.int16).numpy().view(np.uint16)
        outs = []
        for pool in (True, False):
            out = torch.empty_like(x)
            _core.fwht(src, out.view(torch.int16).numpy().view(np.uint16), 1024, "bfloat16", False, signs, g,
                       torch_pool=pool)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), (rows, width)
        ref = scipy_reference(x.float().numpy(), 1024, signs, False, g)
        np.testing.assert_allclose(outs[0].float().numpy(), ref, atol=2e-2 * np.abs(ref).max())


def test_torch_fallback_matches_reference():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 1024)).astype(np.float32)
    s = rand_signs(rng, 1024)
    g = rng.permutation(1024).astype(np.int32)
    y = H.fwht_torch(torch.from_numpy(x), 256, torch.from_numpy(s), False, torch.from_numpy(g))
    np.testing.assert_allclose(y.numpy(), scipy_reference(x, 256, s, gather=g), atol=1e-5)
    yi = H.fwht_torch(torch.from_numpy(x), 256, torch.from_numpy(s), True)
    np.testing.assert_allclose(yi.numpy(), scipy_reference(x, 256, s, inverse=True), atol=1e-5)


def test_numpy_reference_is_scipy():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 512))
    s = rand_signs(rng, 512)
    np.testing.assert_allclose(H.reference_transform(x, 128, s), scipy_reference(x, 128, s), atol=1e-12)
    np.testing.assert_allclose(H.reference_transform(x, 128, s, inverse=True),
                               scipy_reference(x, 128, s, inverse=True), atol=1e-12)


@pytest.mark.parametrize("path", ["op", "python"])
@pytest.mark.parametrize(
    "width,block,signs,gather,inverse,message",
    [
        (96, 64, None, None, False, "not a positive multiple of the block size"),
        (96, 3, None, None, False, "must be a power of two"),
        (64, 64, np.full(32, 1.0, np.float32), None, False, "sign vector has 32 entries"),
        (64, 64, np.full(64, 0.5, np.float32), None, False, "not \\+1 or -1"),
        (8, 8, None, np.array([0, 0, 1, 2, 3, 4, 5, 6], np.int32), False, "not a permutation"),
        (8, 8, None, np.array([8, 1, 2, 3, 4, 5, 6, 7], np.int32), False, "not a permutation"),
        (8, 8, None, np.array([-1, 1, 2, 3, 4, 5, 6, 7], np.int32), False, "not a permutation"),
        (8, 8, None, np.arange(8, dtype=np.int32), True, "only to the forward"),
    ],
)
def test_bad_arguments_raise(path, width, block, signs, gather, inverse, message):
    """The native op and the Python path (``core.hadamard.fwht_cpu``) refuse the same arguments, saying why."""
    x = torch.zeros(2, width)
    fn = torch.ops.ternary_rs.fwht if path == "op" else H.fwht_cpu
    with pytest.raises((ValueError, RuntimeError, ternary_rs.TernaryError), match=message):
        fn(x, block, None if signs is None else torch.from_numpy(signs), inverse,
           None if gather is None else torch.from_numpy(gather))


def test_native_op_equals_python_path_bit_for_bit():
    """The CPU kernel is registered natively (no Python per call: ~8 µs instead of ~50 µs in a compiled
    graph) and computes exactly what the Python path computes — the same Rust transform, many rows on torch's
    pool — for every dtype, direction, gather, a strided input and one the kernel computes in float32."""
    assert ops.NATIVE_FWHT_UNAVAILABLE is None
    rng = np.random.default_rng(8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for rows, width, gather, inverse in ((1, 5120, True, False), (37, 2048, False, True), (300, 1024, True, False)):
            x = torch.from_numpy(rng.standard_normal((rows, width)).astype(np.float32)).to(dtype)
            s = torch.from_numpy(rand_signs(rng, width))
            g = torch.from_numpy(rng.permutation(width).astype(np.int32)) if gather else None
            y = torch.ops.ternary_rs.fwht(x, 1024, s, inverse, g)
            assert y.dtype == dtype and y.shape == x.shape
            assert torch.equal(y, H.fwht_cpu(x, 1024, s, inverse, g)), (dtype, rows, width)
    xt = torch.from_numpy(rng.standard_normal((2048, 3)).astype(np.float32)).T  # strided
    assert torch.equal(torch.ops.ternary_rs.fwht(xt, 512, None, False, None), H.fwht_cpu(xt.contiguous(), 512))
    # Signs in another dtype, gather as int64: converted, as the Python path does.
    s = torch.from_numpy(rand_signs(rng, 256))
    x = torch.randn(2, 256)
    g = torch.from_numpy(rng.permutation(256))
    assert torch.equal(torch.ops.ternary_rs.fwht(x, 256, s.to(torch.int8), False, g), H.fwht_cpu(x, 256, s, False, g))


def test_opcheck_and_compile():
    x = torch.randn(3, 256)
    s = torch.from_numpy(rand_signs(np.random.default_rng(5), 256))
    torch.library.opcheck(torch.ops.ternary_rs.fwht.default, (x, 128, s, False, None))

    @torch.compile(fullgraph=True, backend="eager")
    def f(v):
        return torch.ops.ternary_rs.fwht(v, 128, s, False, None) * 2

    torch.testing.assert_close(f(x), torch.ops.ternary_rs.fwht(x, 128, s, False, None) * 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype):
    rng = np.random.default_rng(6)
    x = torch.from_numpy(rng.standard_normal((37, 5120)).astype(np.float32)).to(dtype)
    s = torch.from_numpy(rand_signs(rng, 5120))
    g = torch.from_numpy(rng.permutation(5120).astype(np.int32))
    for inverse, gather in ((False, g), (True, None)):
        cpu = torch.ops.ternary_rs.fwht(x, 1024, s, inverse, gather)
        gpu = torch.ops.ternary_rs.fwht(x.cuda(), 1024, s.cuda(), inverse, None if gather is None else gather.cuda())
        torch.testing.assert_close(gpu.cpu().float(), cpu.float(), atol=TOL[dtype] * 4, rtol=0)


def test_gdn_permutation_is_reshape_transpose():
    nv, nk, hd = 6, 2, 3
    perm = H.gdn_tiled_to_grouped(nv, nk, hd)
    want = np.arange(nv * hd).reshape(nv // nk, nk, hd).transpose(1, 0, 2).ravel()
    np.testing.assert_array_equal(perm, want)


# ------------------------------------------------------------------------------------------------------
# The rotation description
# ------------------------------------------------------------------------------------------------------


def prism_kv(block=128, widths=(256, 512)):
    rng = np.random.default_rng(7)
    signs = [int(v) for w in widths for v in rng.choice([-1, 1], size=w)]
    return {
        "version": 1,
        "transform": "normalized-sylvester-walsh-hadamard",
        "axis": "input-last-dimension",
        "sign_mode": "explicit",
        "block_size": block,
        "sign_widths": list(widths),
        "sign_values": signs,
        "weight_names": ["blk.0.ffn_down.weight", "blk.0.ffn_up.weight", "output.weight"],
        "inverse_weight_names": ["token_embd.weight"],
        "gdn_v_grouped": True,
    }


MODULES = {
    "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj", 512),
    "blk.0.ffn_up.weight": ("model.layers.0.mlp.up_proj", 256),
    "output.weight": ("lm_head", 256),
    "token_embd.weight": ("model.embed_tokens", 256),
}


def test_spec_round_trip():
    kv = prism_kv()
    spec = H.HadamardSpec.from_prism(kv, MODULES.get)
    assert spec.block_size == 128
    assert spec.layers["model.layers.0.mlp.down_proj"] == (512, None)
    assert spec.inverse_embeddings == ("model.embed_tokens",)
    np.testing.assert_array_equal(spec.signs[256], np.asarray(kv["sign_values"][:256]))
    again = H.HadamardSpec.from_config(spec.to_config())
    assert again.layers == spec.layers and again.inverse_embeddings == spec.inverse_embeddings
    for w in spec.signs:
        np.testing.assert_array_equal(again.signs[w], spec.signs[w])


@pytest.mark.parametrize(
    "change,match",
    [
        ({"version": 3}, "version"),
        ({"version": 1, "tied_output": True}, "tied_output"),
        ({"transform": "random-orthogonal"}, "transform"),
        ({"axis": "output"}, "axis"),
        ({"block_size": 96}, "power of two"),
        ({"sign_values": [1] * 10}, "sign_values"),
        ({"weight_names": ["blk.9.ffn_down.weight"]}, "not a tensor"),
        ({"sign_widths": [256, 384]}, "multiple|sign"),
    ],
)
def test_prism_refusals(change, match):
    kv = prism_kv()
    kv.update(change)
    with pytest.raises(ternary_rs.ValidationError, match=match):
        H.HadamardSpec.from_prism(kv, MODULES.get)


def test_prism_missing_key_and_bad_sign():
    kv = prism_kv()
    del kv["block_size"]
    with pytest.raises(ternary_rs.ValidationError, match="block_size"):
        H.HadamardSpec.from_prism(kv, MODULES.get)
    kv = prism_kv()
    kv["sign_values"][3] = 0
    with pytest.raises(ternary_rs.ValidationError, match=r"sign_values\[3\]"):
        H.HadamardSpec.from_prism(kv, MODULES.get)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda c: c.update(version=99), "version"),
        (lambda c: c.update(extra_rotation=True), "unknown keys"),
        (lambda c: c.update(layers={}), "non-empty"),
        (lambda c: c["layers"]["lm_head"].update(width=999), "width 999"),
        (lambda c: c["layers"]["lm_head"].update(gdn_permute={"from": "x"}), "gdn_permute"),
        (lambda c: c.update(sign_values=c["sign_values"][:-1]), "sign"),
        (lambda c: c.update(block_size="128"), "integer"),
    ],
)
def test_checkpoint_config_refusals(mutate, match):
    cfg = H.HadamardSpec.from_prism(prism_kv(), MODULES.get).to_config()
    mutate(cfg)
    with pytest.raises(ternary_rs.ValidationError, match=match):
        H.HadamardSpec.from_config(cfg)


def test_refuse_if_rotated():
    H.refuse_if_rotated({"general.architecture": "qwen3"}, "the GGUF writer")
    with pytest.raises(ternary_rs.ValidationError, match="rotated"):
        H.refuse_if_rotated({"prism.hadamard.version": 1}, "the GGUF writer", "x.gguf")
    assert H.is_rotated({"model_type": "prism_hadamard_qwen35"})


# ------------------------------------------------------------------------------------------------------
# vLLM-side transforms (fake layers; the end-to-end run is in test_qwen35_vllm.py)
# ------------------------------------------------------------------------------------------------------


def gdn_spec_config(grouped: bool):
    kv = prism_kv(block=128, widths=(256, 512))
    kv["weight_names"] = ["blk.0.ssm_out.weight", "blk.0.attn_qkv.weight", "blk.0.attn_gate.weight",
                          "blk.0.ffn_down.weight"]
    mods = {
        "blk.0.ssm_out.weight": ("model.layers.0.linear_attn.out_proj", 512),
        "blk.0.attn_qkv.weight": ("model.layers.0.linear_attn.in_proj_qkv", 256),
        "blk.0.attn_gate.weight": ("model.layers.0.linear_attn.in_proj_z", 256),
        "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj", 512),
        "token_embd.weight": ("model.embed_tokens", 256),
    }
    perm = None if grouped else H.GdnPermute("grouped", "tiled", 4, 2, 128)
    spec = H.HadamardSpec.from_prism(kv, mods.get, lambda m: perm if m.endswith("out_proj") else None)
    return spec.to_config(), spec


def layer(input_size, per_partition=None):
    return SimpleNamespace(input_size=input_size, input_size_per_partition=per_partition or input_size)


def test_input_transform_fused_and_unlisted():
    cfg, spec = gdn_spec_config(grouped=True)
    t = VH.make_input_transform(cfg, "model.layers.0.linear_attn.in_proj_qkvz", layer(256), 0, 1)
    x = torch.randn(3, 256)
    want = scipy_reference(x.numpy(), 128, spec.signs[256].astype(np.float64))
    np.testing.assert_allclose(t(x).numpy(), want, atol=1e-5)
    # vLLM prefixes differ from checkpoint names only before "layers.N".
    assert VH.make_input_transform(cfg, "language_model.model.layers.0.linear_attn.in_proj_qkvz", layer(256), 0, 1)
    assert VH.make_input_transform(cfg, "model.layers.0.linear_attn.in_proj_ba", layer(256), 0, 1) is None
    assert VH.make_input_transform(cfg, "model.layers.1.mlp.down_proj", layer(512), 0, 1) is None
    with pytest.raises(ternary_rs.ValidationError, match="1024 inputs"):
        VH.make_input_transform(cfg, "model.layers.0.mlp.down_proj", layer(512 * 2), 0, 1)


def test_fused_layer_with_one_rotated_part_is_refused():
    cfg, _ = gdn_spec_config(grouped=True)
    cfg["layers"].pop("model.layers.0.linear_attn.in_proj_z")
    with pytest.raises(ternary_rs.ValidationError, match="unrotated parts"):
        VH.make_input_transform(cfg, "model.layers.0.linear_attn.in_proj_qkvz", layer(256), 0, 1)


@pytest.mark.parametrize("grouped", [True, False])
def test_out_proj_transform_keeps_y_equal(grouped):
    """y = W'·T(x) equals the dense model's W·x, with W = W'·H·D in the weight's own head order."""
    cfg, spec = gdn_spec_config(grouped)
    rng = np.random.default_rng(8)
    w_stored = rng.choice([-1.0, 0.0, 1.0], size=(16, 512))
    s = spec.signs[512].astype(np.float64)
    w_dense_weight_order = scipy_reference(w_stored, 128, s, inverse=True)  # W'·H·D
    x_grouped = rng.standard_normal((2, 512))
    if grouped:
        w_dense = w_dense_weight_order
    else:  # weight columns are in tiled order; the activation is grouped
        t2g = H.gdn_tiled_to_grouped(4, 2, 128)
        w_dense = np.empty_like(w_dense_weight_order)
        w_dense[:, t2g] = w_dense_weight_order  # column of grouped position i = tiled column t2g[i]
    t = VH.make_input_transform(cfg, "model.layers.0.linear_attn.out_proj", layer(512), 0, 1)
    got = t(torch.from_numpy(x_grouped).float()).double().numpy() @ w_stored.T
    np.testing.assert_allclose(got, x_grouped @ w_dense.T, atol=1e-4)


@pytest.mark.parametrize("tp,block", [(2, 128), (4, 128), (2, 1024), (4, 512)])
def test_row_parallel_slices(tp, block):
    """Per-rank partial sums of W'_rank·T_rank(x_rank) add up to the full W'·T(x), aligned or not."""
    rng = np.random.default_rng(tp * block)
    width = 1024
    signs = rng.choice([-1, 1], size=width)
    cfg = {
        "version": 1, "transform": "normalized-sylvester-walsh-hadamard", "block_size": block,
        "sign_widths": [width], "sign_values": [int(v) for v in signs],
        "layers": {"model.layers.0.mlp.down_proj": {"width": width}}, "inverse_embeddings": [],
    }
    w = rng.choice([-1.0, 0.0, 1.0], size=(8, width))
    x = torch.from_numpy(rng.standard_normal((3, width)).astype(np.float32))
    full = scipy_reference(x.numpy(), block, signs.astype(np.float64)) @ w.T
    k = width // tp
    total = np.zeros_like(full)
    for rank in range(tp):
        xs = x[:, rank * k:(rank + 1) * k]
        t = VH.make_input_transform(cfg, "model.layers.0.mlp.down_proj", layer(width, k), rank, tp,
                                    all_gather=lambda _local: x)
        assert (t.all_gather is None) == (k % block == 0)
        total += t(xs).double().numpy() @ w[:, rank * k:(rank + 1) * k].T
    np.testing.assert_allclose(total, full, atol=1e-4)


def test_embedding_transform():
    cfg, spec = gdn_spec_config(grouped=True)
    t = VH.make_embedding_transform(cfg, "model.embed_tokens")
    rows = torch.randn(5, 256, dtype=torch.bfloat16)
    want = scipy_reference(rows.float().numpy(), 128, spec.signs[256].astype(np.float64), inverse=True)
    np.testing.assert_allclose(t(rows).float().numpy(), want, atol=3e-2)
    assert VH.make_embedding_transform(cfg, "lm_head") is None
    with pytest.raises(ternary_rs.ValidationError, match="width 384"):
        t(torch.randn(2, 384))


def test_malformed_checkpoint_entry_refused_at_load():
    with pytest.raises(ternary_rs.ValidationError, match="version"):
        VH.make_input_transform({"version": 7}, "model.layers.0.mlp.down_proj", layer(512), 0, 1)
    with pytest.raises(ternary_rs.ValidationError):
        VH.make_embedding_transform(["not", "an", "object"], "model.embed_tokens")


def test_rotated_layer_served_dense_is_refused():
    cfg, _ = gdn_spec_config(grouped=True)
    for prefix in ("model.layers.0.mlp.down_proj", "language_model.model.layers.0.linear_attn.in_proj_qkvz",
                   "model.embed_tokens"):
        with pytest.raises(ternary_rs.ValidationError, match="served as a dense layer"):
            VH.refuse_dense(cfg, prefix)
    VH.refuse_dense(cfg, "model.layers.0.linear_attn.in_proj_ba")  # not rotated: fine dense
    VH.refuse_dense(cfg, "model.layers.0.self_attn.qkv_proj")


@pytest.mark.skipif(not hasattr(ternary_rs._core, "fwht_cuda"), reason="extension built without CUDA")
def test_cuda_launcher_validates_arguments_without_a_gpu():
    """The C launcher checks sizes and pointers before touching the device (cuda/fwht.h error codes)."""
    with pytest.raises(ValueError, match="-14"):  # null input/output
        ternary_rs._core.fwht_cuda(0, 0, 1, 1024, 1024, "bfloat16", False, 0, 0, 0)
    with pytest.raises(ValueError, match="-11"):  # width not a multiple of the block
        ternary_rs._core.fwht_cuda(8, 8, 1, 1000, 1024, "bfloat16", False, 0, 0, 0)
    with pytest.raises(ValueError, match="-12"):  # block not a power of two
        ternary_rs._core.fwht_cuda(8, 8, 1, 96, 96, "float32", False, 0, 0, 0)
    with pytest.raises(ValueError, match="dtype"):
        ternary_rs._core.fwht_cuda(8, 8, 1, 64, 64, "int8", False, 0, 0, 0)
