"""The CUDA weight layout (Rust ``gpu_layout``) against an independent NumPy implementation of its spec.

Spec (rust/ternary-core/src/kernels/gpu_layout.rs, cuda/ternary_frag.h): W[N, K] is cut into 64 (K) x 32 (N)
chunks stored strip-major; in a chunk lane l owns 16 bytes = four little-endian u32 words, word w holds 16
2-bit codes, code q at bits 2q is W[32 nb + 8 nt + l // 4, 64 kb + 16 w + 8 j + 2 (l % 4) + h] with
r = q % 8, h = q // 8, nt = r // 2, j = r % 2. Padding codes are 1 (weight 0). Scales become f16
[ceil(k_pad / g), n_pad], zero-padded. Nothing here needs a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ternary_rs
from ternary_rs import _core
from ternary_rs.serving import _ops_cuda


def canonical_codes(qweight: np.ndarray) -> np.ndarray:
    """uint8 [N, K/4] -> codes [N, K] (2 bits per code, least significant first along K)."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)
    return ((qweight[:, :, None] >> shifts) & 3).reshape(qweight.shape[0], -1)


def reference_layout(qweight: np.ndarray, scales: np.ndarray, g: int):
    codes = canonical_codes(qweight)
    n, k = codes.shape
    n_pad, k_pad = -(-n // 32) * 32, -(-k // 64) * 64
    padded = np.ones((n_pad, k_pad), dtype=np.uint32)
    padded[:n, :k] = codes
    lane = np.arange(32)[:, None, None]
    w = np.arange(4)[None, :, None]
    q = np.arange(16)[None, None, :]
    r, h = q % 8, q // 8
    nt, j = r // 2, r % 2
    dn = 8 * nt + lane // 4 + 0 * w  # [32, 4, 16]
    dk = 16 * w + 8 * j + 2 * (lane % 4) + h
    nb = np.arange(n_pad // 32)[:, None, None, None, None]
    kb = np.arange(k_pad // 64)[None, :, None, None, None]
    gathered = padded[nb * 32 + dn[None, None], kb * 64 + dk[None, None]]  # [NB, KB, 32, 4, 16]
    words = (gathered << (2 * np.arange(16, dtype=np.uint32))).sum(axis=-1, dtype=np.uint64).astype("<u4")
    q_out = words.view(np.uint8).reshape(n_pad // 32, -1)
    groups_pad = -(-k_pad // g)
    s_out = np.zeros((groups_pad, n_pad), dtype=np.float16)
    s_out[: k // g, :n] = scales.T
    return q_out, s_out


def random_canonical(rng, n, k, g):
    codes = rng.integers(0, 3, size=(n, k), dtype=np.uint8)
    packed = (codes.reshape(n, k // 4, 4) << np.array([0, 2, 4, 6], dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)
    scales = rng.uniform(0.01, 2.0, size=(n, k // g)).astype(np.float16)
    return packed, scales


@pytest.mark.parametrize(
    "n,k,g", [(32, 64, 64), (1, 32, 32), (45, 96, 32), (100, 384, 128), (7, 256, 256), (130, 512, 64), (64, 2048, 128)]
)
def test_rust_layout_matches_numpy_reference(n, k, g):
    rng = np.random.default_rng(n * 7919 + k)
    qw, sc = random_canonical(rng, n, k, g)
    q_k, s_k = _core.gpu_layout(qw, sc.view(np.uint16), g)
    q_ref, s_ref = reference_layout(qw, sc, g)
    np.testing.assert_array_equal(q_k, q_ref)
    np.testing.assert_array_equal(s_k.view(np.float16), s_ref)
    assert q_k.shape == _ops_cuda.gpu_shapes(n, k, g)[0]
    assert s_k.shape == _ops_cuda.gpu_shapes(n, k, g)[1]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 97),
    g=st.sampled_from([32, 64, 128, 256]),
    groups=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_layout_property(n, g, groups, seed):
    k = g * groups
    qw, sc = random_canonical(np.random.default_rng(seed), n, k, g)
    q_k, s_k = _core.gpu_layout(qw, sc.view(np.uint16), g)
    q_ref, s_ref = reference_layout(qw, sc, g)
    np.testing.assert_array_equal(q_k, q_ref)
    np.testing.assert_array_equal(s_k.view(np.float16), s_ref)


def test_prepare_weight_on_cpu_tensors_keeps_device_and_dtypes():
    rng = np.random.default_rng(3)
    qw, sc = random_canonical(rng, 50, 192, 64)
    q_t, s_t = _ops_cuda.prepare_weight(torch.from_numpy(qw), torch.from_numpy(sc), 64)
    assert q_t.dtype == torch.uint8 and s_t.dtype == torch.float16
    q_ref, s_ref = reference_layout(qw, sc, 64)
    np.testing.assert_array_equal(q_t.numpy(), q_ref)
    np.testing.assert_array_equal(s_t.numpy(), s_ref)


def test_dense_weight_roundtrip_through_layout():
    """Decoding the layout with the spec's formula gives back W (trit x scale) exactly."""
    rng = np.random.default_rng(11)
    n, k, g = 37, 160, 32
    qw, sc = random_canonical(rng, n, k, g)
    q_k, s_k = _core.gpu_layout(qw, sc.view(np.uint16), g)
    words = q_k.reshape(-1).view("<u4").reshape(q_k.shape[0], -1, 32, 4)  # [NB, KB, lane, w]
    dense = np.zeros((q_k.shape[0] * 32, words.shape[1] * 64), dtype=np.float32)
    for q in range(16):
        r, h = q % 8, q // 8
        nt, j = r // 2, r % 2
        code = (words >> (2 * q)) & 3
        for lane in range(32):
            rows = np.arange(words.shape[0])[:, None] * 32 + 8 * nt + lane // 4
            for w in range(4):
                cols = np.arange(words.shape[1])[None, :] * 64 + 16 * w + 8 * j + 2 * (lane % 4) + h
                dense[rows, cols] = code[:, :, lane, w].astype(np.float32) - 1
    scales = s_k.view(np.float16).astype(np.float32)
    k_idx = np.arange(dense.shape[1])
    w_gpu = dense * scales[k_idx // g, :].T
    codes = canonical_codes(qw).astype(np.float32) - 1
    w_ref = codes * np.repeat(sc.astype(np.float32), g, axis=1)
    np.testing.assert_array_equal(w_gpu[:n, :k], w_ref)
    assert not w_gpu[n:].any() and not w_gpu[:, k:].any()


def test_bad_inputs_raise_clear_errors():
    qw = np.full((4, 16), 0x55, dtype=np.uint8)
    sc = np.ones((4, 1), dtype=np.float16).view(np.uint16)
    qw[2, 3] = 0b11_01_01_01  # code 3 at element k = 15 of row 2
    with pytest.raises(ternary_rs.ValidationError, match="code 3"):
        _core.gpu_layout(qw, sc, 64)
    with pytest.raises(ValueError, match="scales shape"):
        _core.gpu_layout(np.full((4, 16), 0x55, dtype=np.uint8), np.ones((4, 2), dtype=np.uint16), 64)
    with pytest.raises(ValueError, match="group_size 48"):
        _ops_cuda.prepare_weight(torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1, dtype=torch.float16), 48)
    nan = np.full((4, 1), np.nan, dtype=np.float16).view(np.uint16)
    with pytest.raises(ternary_rs.ValidationError, match="non-finite"):
        _core.gpu_layout(np.full((4, 16), 0x55, dtype=np.uint8), nan, 64)


def test_cuda_entry_points_do_not_crash_without_a_gpu():
    count = _core.cuda_device_count()
    assert count >= 0
    if not _core.cuda_available():
        assert count == 0
        with pytest.raises(RuntimeError, match="without its CUDA kernels"):
            _ops_cuda.ternary_linear(torch.zeros(1, 64), None, None, 32, 64, 64)
        return
    plan = _core.cuda_plan(1, 6144, 5120, 128, 132)
    assert plan["kernel"] == "gemv" and plan["splits"] >= 1
    big = _core.cuda_plan(2048, 6144, 5120, 128, 132)
    assert big["kernel"] == "gemm128" and big["partial_floats"] == 0
    with pytest.raises(ValueError, match="multiple of the group size"):
        _core.cuda_plan(1, 32, 100, 64, 132)
    with pytest.raises(ValueError, match="null or misaligned"):
        _core.cuda_ternary_linear(0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 32, 64, 64, "bfloat16", 1, 0)
    with pytest.raises(ValueError, match="dtype"):
        _core.cuda_ternary_linear(0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 32, 64, 64, "float32", 1, 0)
    # Split-K with a workspace smaller than planned is refused before launching (addresses never touched).
    need = _core.cuda_plan(1, 64, 4096, 128, 132)
    assert need["splits"] > 1
    fake = 1 << 20
    with pytest.raises(ValueError, match="split-K needs"):
        _core.cuda_ternary_linear(fake, fake, fake, 0, fake, fake, need["partial_floats"] - 1, fake, need["counters"],
                                  1, 64, 4096, 128, "bfloat16", 132, 0)
    # The GEMV cut-off moves M = 16 between the 16-row mma tile and the decode kernel.
    assert _core.cuda_plan(16, 4096, 4096, 128, 132)["kernel"] == "gemm16"
    assert _ops_cuda.set_gemv_max_m(16) == 8
    try:
        assert _core.cuda_plan(16, 4096, 4096, 128, 132)["kernel"] == "gemv"
        with pytest.raises(ValueError):
            _ops_cuda.set_gemv_max_m(17)
    finally:
        assert _ops_cuda.set_gemv_max_m(8) == 16
    with pytest.raises(ValueError, match="null or misaligned"):
        _core.cuda_dequantize(0, 0, 0, 32, 64, 64, "float16", 0)
    assert _ops_cuda.set_dequant_min_m(0) == 0
    # Argument checks run before anything touches a device.
    q_k, s_k = _ops_cuda.prepare_weight(torch.full((40, 24), 0x55, dtype=torch.uint8), torch.ones(40, 3, dtype=torch.float16), 32)
    with pytest.raises(ValueError, match="prepared CUDA layout"):
        _ops_cuda.ternary_linear(torch.zeros(2, 96), q_k[:1], s_k, 40, 96, 32)
    with pytest.raises(ValueError, match="features"):
        _ops_cuda.ternary_linear(torch.zeros(2, 64), q_k, s_k, 40, 96, 32)


@pytest.mark.skipif(not _core.cuda_available(), reason="this build has no CUDA kernels (built without the cuda feature)")
@pytest.mark.parametrize("m", [1, 64])
def test_launch_path_without_a_device_reports_the_cuda_error(monkeypatch, m):
    """Python -> PyO3 -> C launcher with a real argument list, on a machine the runtime sees no device on:
    the launch must fail cleanly with the CUDA error (no crash), after every host-side check passed."""
    if _core.cuda_device_count() != 0 or torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/test_cuda.py covers the launch path for real")

    class _Stream:
        cuda_stream = 0

    monkeypatch.setattr(_ops_cuda.torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(_ops_cuda.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_ops_cuda, "_sm_count", lambda device: 132)
    monkeypatch.setattr(_ops_cuda, "_counters", {})
    rng = np.random.default_rng(5)
    n, k, g = 64, 4096, 128  # long K, few strips: split-K, so partials and counters are passed too
    qw, sc = random_canonical(rng, n, k, g)
    q_k, s_k = _ops_cuda.prepare_weight(torch.from_numpy(qw), torch.from_numpy(sc), g)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    assert _core.cuda_plan(m, n, k, g, 132)["splits"] > 1
    with pytest.raises(RuntimeError, match="ternary CUDA kernel error"):
        _ops_cuda.ternary_linear(x, q_k, s_k, n, k, g, torch.zeros(n, dtype=torch.bfloat16))
    assert _ops_cuda._counters, "split-K counters were set up before the launch"
