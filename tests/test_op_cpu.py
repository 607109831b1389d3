"""torch.ops.ternary_rs.ternary_linear on the CPU (Rust SIMD kernel) against an independent float64
reference: the weight is dequantized here with NumPy straight from the canonical bytes of
FORMATS.md (codes t+1, four per byte LSB-first along K; W = t · scale[n, k // g]) — never from the
kernel's own layout code.

Documented tolerance (see ``_ops_cpu``): exact mode accumulates in f32, so
``|y − y64| ≤ 4·K·2⁻²⁴·Σₖ|x_k·W[n,k]|`` before the final rounding to x's dtype, which adds at most half
an ulp of the output (bf16: 2⁻⁸ relative, fp16: 2⁻¹¹). The int8 mode adds ``max|x|/254 · Σₖ|W[n,k]|``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ternary_rs
from ternary_rs import _ops_cpu, ops

OP = torch.ops.ternary_rs.ternary_linear
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
OUT_EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
GROUPS = [32, 64, 128, 256]


def make_weight(rng, n, k, g):
    """Random canonical tensors: uint8 [N, K/4] codes in {0, 1, 2}, float16 [N, K/g] scales."""
    codes = rng.integers(0, 3, size=(n, k), dtype=np.uint8)
    packed = (codes.reshape(n, k // 4, 4) << np.array([0, 2, 4, 6], dtype=np.uint8)).sum(axis=2, dtype=np.uint8)
    scales = rng.uniform(0.005, 0.2, size=(n, k // g)).astype(np.float16)
    return torch.from_numpy(packed), torch.from_numpy(scales)


def dequantize64(qweight: torch.Tensor, scales: torch.Tensor, g: int) -> np.ndarray:
    """float64 W[N, K] from canonical bytes (FORMATS.md), independent of the kernel."""
    q = qweight.numpy()
    n = q.shape[0]
    codes = (q[:, :, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3
    t = codes.reshape(n, -1).astype(np.float64) - 1.0
    return t * np.repeat(scales.numpy().astype(np.float64), g, axis=1)


def reference(x: torch.Tensor, w64: np.ndarray, bias: torch.Tensor | None):
    """(y64, Σ|x·w|) in float64; bias enters as the x-dtype value the op sees."""
    x64 = x.to(torch.float64).reshape(-1, x.shape[-1]).numpy()
    y = x64 @ w64.T
    mag = np.abs(x64) @ np.abs(w64).T
    if bias is not None:
        y = y + bias.to(x.dtype).to(torch.float64).numpy()
    return y, mag


def assert_close(y: torch.Tensor, y64: np.ndarray, mag: np.ndarray, k: int, extra=0.0):
    got = y.to(torch.float64).reshape(y64.shape).numpy()
    tol = OUT_EPS[y.dtype] * np.abs(y64) + 4 * k * 2.0**-24 * mag + extra + 1e-30
    err = np.abs(got - y64)
    bad = np.argwhere(~(err <= tol))
    assert bad.size == 0, f"{len(bad)} outputs off, first {tuple(bad[0])}: {got[tuple(bad[0])]} vs {y64[tuple(bad[0])]}"


def run_op(x, qk, sk, n, k, g, bias=None):
    return OP(x, qk, sk, n, k, g, bias)


SHAPES = [
    # (M, N, K, g)
    (1, 1, 32, 32),
    (1, 3, 64, 64),
    (1, 7, 128, 128),
    (1, 33, 256, 256),
    (2, 1031, 96, 32),
    (5, 64, 384, 128),
    (15, 17, 512, 256),
    (16, 33, 160, 32),
    (17, 7, 192, 64),
    (64, 40, 1024, 128),
    (300, 9, 512, 256),
    (3, 1100, 1024, 64),  # large enough to run multithreaded
    (20, 1040, 1056, 32),  # GEMM path multithreaded, K an odd multiple of 32
]


@pytest.mark.parametrize("m,n,k,g", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(m, n, k, g, dtype, with_bias):
    rng = np.random.default_rng(m * 7919 + n * 31 + k + g)
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype) if with_bias else None
    y = run_op(x, qk, sk, n, k, g, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    y64, mag = reference(x, dequantize64(q, s, g), bias)
    assert_close(y, y64, mag, k)


@pytest.mark.parametrize("variant", _ops_cpu.available_variants())
@pytest.mark.parametrize("int8", [False, True])
def test_each_variant_matches_scalar_and_reference(variant, int8):
    rng = np.random.default_rng(5)
    for m, n, k, g in [
        (1, 37, 320, 32), (1, 38, 320, 32), (3, 9, 512, 64), (4, 9, 512, 64), (16, 21, 384, 128),
        (33, 6, 768, 256), (2, 1030, 1024, 128),
    ]:
        q, s = make_weight(rng, n, k, g)
        qk, sk = ops.prepare_weight(q, s, g)
        dtype = DTYPES[(m + n) % 3]  # bf16 takes the AVX512_BF16 dot-product GEMV where available
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
        with _ops_cpu.kernel_options("scalar", int8):
            want = run_op(x, qk, sk, n, k, g)
        with _ops_cpu.kernel_options(variant, int8):
            got = run_op(x, qk, sk, n, k, g)
        y64, mag = reference(x, dequantize64(q, s, g), None)
        extra = 0.0
        if int8:
            # Each activation moves by at most half a quantization step of max|x|/127.
            amax = x.abs().amax(dim=1, keepdim=True).double().numpy()
            extra = amax / 254.0 * np.abs(dequantize64(q, s, g)).sum(axis=1)[None, :] * 1.0001
        assert_close(got, y64, mag, k, extra)
        # Same math, different summation order: agree to f32 accumulation error plus one output rounding.
        np.testing.assert_allclose(
            got.float().numpy(), want.float().numpy(), rtol=2 * OUT_EPS[dtype] + 1e-5, atol=1e-5 * float(mag.max())
        )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 70),
    groups=st.integers(1, 6),
    g=st.sampled_from(GROUPS),
    dtype=st.sampled_from(DTYPES),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_shapes(m, n, groups, g, dtype, with_bias, seed):
    rng = np.random.default_rng(seed)
    k = groups * g
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    x = torch.from_numpy((rng.standard_normal((m, k)) * rng.uniform(0.01, 100)).astype(np.float32)).to(dtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype) if with_bias else None
    y64, mag = reference(x, dequantize64(q, s, g), bias)
    assert_close(run_op(x, qk, sk, n, k, g, bias), y64, mag, k)


def test_input_ranks_and_non_contiguous_x():
    rng = np.random.default_rng(1)
    n, k, g = 24, 256, 64
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    w64 = dequantize64(q, s, g)
    x3 = torch.from_numpy(rng.standard_normal((2, 3, k)).astype(np.float32)).to(torch.bfloat16)
    y3 = run_op(x3, qk, sk, n, k, g)
    assert y3.shape == (2, 3, n)
    y64, mag = reference(x3, w64, None)
    assert_close(y3, y64, mag, k)
    y1 = run_op(x3[1, 2], qk, sk, n, k, g)
    assert y1.shape == (n,)
    torch.testing.assert_close(y1, y3[1, 2], rtol=0, atol=0)
    # Strided views: every other row of a bigger buffer, and a transposed buffer.
    big = torch.from_numpy(rng.standard_normal((8, k)).astype(np.float32))
    xs = big[::2]
    xt = torch.from_numpy(rng.standard_normal((k, 5)).astype(np.float32)).t()
    for x in (xs, xt):
        assert not x.is_contiguous()
        y64, mag = reference(x, w64, None)
        assert_close(run_op(x, qk, sk, n, k, g), y64, mag, k)
    # M = 0 rows.
    assert run_op(torch.empty(0, k), qk, sk, n, k, g).shape == (0, n)


def test_results_do_not_depend_on_thread_count():
    rng = np.random.default_rng(2)
    n, k, g = 2048, 1024, 128
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    old = ternary_rs.get_num_threads()
    try:
        for m in (1, 24):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            ternary_rs.set_num_threads(1)
            one = run_op(x, qk, sk, n, k, g)
            ternary_rs.set_num_threads(2)
            two = run_op(x, qk, sk, n, k, g)
            assert torch.equal(one, two)
    finally:
        ternary_rs.set_num_threads(old)


def reference_planes(q: torch.Tensor, k: int) -> np.ndarray:
    """The CPU layout written from its description: per row, per 64 columns, u64 plus mask then u64 minus mask."""
    codes = ((q.numpy()[:, :, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(q.shape[0], k)
    kpad = -(-k // 64) * 64
    codes = np.pad(codes, ((0, 0), (0, kpad - k)), constant_values=1)
    out = []
    for row in codes:
        buf = b""
        for c in range(kpad // 64):
            chunk = row[c * 64 : (c + 1) * 64]
            plus = sum(1 << i for i in range(64) if chunk[i] == 2)
            minus = sum(1 << i for i in range(64) if chunk[i] == 0)
            buf += plus.to_bytes(8, "little") + minus.to_bytes(8, "little")
        out.append(np.frombuffer(buf, dtype=np.uint8))
    return np.stack(out)


@pytest.mark.parametrize("k,g", [(32, 32), (96, 32), (256, 128), (512, 256)])
def test_prepare_weight_layout(k, g):
    rng = np.random.default_rng(k)
    q, s = make_weight(rng, 5, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    assert qk.dtype == torch.uint8 and sk.dtype == torch.float16
    np.testing.assert_array_equal(qk.numpy(), reference_planes(q, k))
    torch.testing.assert_close(sk, s, rtol=0, atol=0)


def test_errors_are_clear():
    rng = np.random.default_rng(3)
    n, k, g = 4, 96, 32  # K not a multiple of 64: canonical and prepared shapes differ
    q, s = make_weight(rng, n, k, g)
    bad = q.clone()
    bad[2, 5] = 0xFF  # four code-3 values at row 2, columns 20..23 → flat index 2·96 + 20
    with pytest.raises(ternary_rs.ValidationError, match=r"index 212"):
        ops.prepare_weight(bad, s, g)
    nan_s = s.clone()
    nan_s[1, 1] = float("nan")
    with pytest.raises(ternary_rs.ValidationError, match="NaN"):
        ops.prepare_weight(q, nan_s, g)
    with pytest.raises(ValueError, match="group_size"):
        ops.prepare_weight(q, s, 48)
    with pytest.raises(ValueError, match="float16"):
        ops.prepare_weight(q, s.float(), g)
    qk, sk = ops.prepare_weight(q, s, g)
    x = torch.randn(2, k)
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 96\]"):
        run_op(torch.randn(2, k + 1), qk, sk, n, k, g)
    with pytest.raises(TypeError, match="dtype"):
        run_op(x.double(), qk, sk, n, k, g)
    with pytest.raises(ValueError, match="prepared uint8"):
        run_op(x, q, sk, n, k, g)  # canonical, not prepared
    with pytest.raises(ValueError, match="bias"):
        run_op(x, qk, sk, n, k, g, torch.zeros(n + 1))
    with pytest.raises(ValueError, match="not available"):
        _ops_cpu.set_kernel_variant("neon")


def _opcheck_samples():
    rng = np.random.default_rng(4)
    n, k, g = 12, 128, 32
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    for dtype in DTYPES:
        for shape in [(k,), (3, k), (2, 2, k)]:
            for bias in (None, torch.randn(n).to(dtype)):
                yield (torch.randn(shape).to(dtype), qk, sk, n, k, g, bias)


@pytest.mark.parametrize("args", list(_opcheck_samples()), ids=lambda a: f"{a[0].dtype}-{tuple(a[0].shape)}-{a[6] is not None}")
def test_opcheck(args):
    torch.library.opcheck(OP.default, args)


def test_torch_compile_fullgraph():
    rng = np.random.default_rng(6)
    n, k, g = 48, 256, 128
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    bias = torch.randn(n, dtype=torch.bfloat16)

    def layer(x):
        return torch.nn.functional.silu(OP(x, qk, sk, n, k, g, bias)) * 2

    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for m in (1, 5):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x), layer(x))
