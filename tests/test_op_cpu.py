"""torch.ops.ternary_rs.ternary_linear on the CPU (Rust SIMD kernel) against an independent float64
reference: the weight is dequantized here with NumPy straight from the canonical bytes of
docs/checkpoint.md#canonical-layout (codes t+1, four per byte LSB-first along K; W = t · scale[n, k // g]) — never from the
kernel's own layout code.

Documented tolerance (see ``_ops_cpu``): exact mode accumulates in f32, so
``|y − y64| ≤ 4·K·2⁻²⁴·Σₖ|x_k·W[n,k]|`` before the final rounding to x's dtype, which adds at most half
an ulp of the output (bf16: 2⁻⁸ relative, fp16: 2⁻¹¹). The int8 modes add ``Σ_g xs_g/2 · Σ_{k∈g}|W[n,k]|``
with ``xs_g = max|x_g|/127`` per weight group (or one ``max(max|x|, 1e-5)/127`` per token).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ternary_rs
from ternary_rs.serving import _ops_cpu, ops

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
    """float64 W[N, K] from canonical bytes (docs/checkpoint.md#canonical-layout), independent of the kernel."""
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


def run_op(x, qk, sk, n, k, g, bias=None, activations=ops.EXACT):
    return OP(x, qk, sk, n, k, g, bias, activations)


def int8_bound(x: torch.Tensor, w64: np.ndarray, g: int, per_token: bool = False) -> np.ndarray:
    """Σ_g xs_g/2 · Σ_{k∈g}|W[n,k]| per (token, output): each activation moves by at most half a step."""
    xf = x.to(torch.float64).reshape(-1, x.shape[-1]).numpy()
    m, k = xf.shape
    if per_token:
        amax = np.maximum(np.abs(xf).max(axis=1, keepdims=True), 1e-5).repeat(k // g, axis=1)
    else:
        amax = np.abs(xf.reshape(m, k // g, g)).max(axis=2)
    l1 = np.abs(w64).reshape(w64.shape[0], k // g, g).sum(axis=2)  # [N, K/g]
    return (amax / 254.0) @ l1.T * 1.0001


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
@pytest.mark.parametrize("activations", [ops.EXACT, ops.INT8_GROUP, ops.INT8_TOKEN])
def test_each_variant_matches_scalar_and_reference(variant, activations):
    rng = np.random.default_rng(5)
    for m, n, k, g in [
        (1, 37, 320, 32), (1, 38, 320, 32), (3, 9, 512, 64), (4, 9, 512, 64), (16, 21, 384, 128),
        (33, 6, 768, 256), (2, 1030, 1024, 128),
    ]:
        q, s = make_weight(rng, n, k, g)
        qk, sk = ops.prepare_weight(q, s, g)
        dtype = DTYPES[(m + n) % 3]  # bf16 takes the AVX512_BF16 dot-product GEMV where available
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
        with _ops_cpu.kernel_options("scalar"):
            want = run_op(x, qk, sk, n, k, g, activations=activations)
        with _ops_cpu.kernel_options(variant):
            got = run_op(x, qk, sk, n, k, g, activations=activations)
        w64 = dequantize64(q, s, g)
        y64, mag = reference(x, w64, None)
        extra = 0.0 if activations == ops.EXACT else int8_bound(x, w64, g, activations == ops.INT8_TOKEN)
        assert_close(got, y64, mag, k, extra)
        # Same math, different summation order: agree to f32 accumulation error plus one output rounding.
        np.testing.assert_allclose(
            got.float().numpy(), want.float().numpy(), rtol=2 * OUT_EPS[dtype] + 1e-5, atol=1e-5 * float(mag.max())
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_default_mode_by_dtype(dtype):
    """Auto = int8 per group for bf16/fp16 activations (within its bound, and equal to asking for it),
    exact for f32."""
    rng = np.random.default_rng(17)
    m, n, k, g = 3, 70, 512, 128
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
    auto = OP(x, qk, sk, n, k, g)
    expected_mode = ops.EXACT if dtype == torch.float32 else ops.INT8_GROUP
    assert torch.equal(auto, run_op(x, qk, sk, n, k, g, activations=expected_mode))
    w64 = dequantize64(q, s, g)
    y64, mag = reference(x, w64, None)
    assert_close(auto, y64, mag, k, 0.0 if dtype == torch.float32 else int8_bound(x, w64, g))


@pytest.mark.parametrize("env,expect", [("0", "exact"), ("1", "int8"), (None, "by-dtype")])
def test_env_forces_the_auto_mode(env, expect):
    """TERNARY_RS_CPU_INT8=0 forces exact, =1 int8 for every dtype (scripts depend on these names)."""
    import os
    import subprocess
    import sys

    code = """
import torch, ternary_rs
from ternary_rs import ops
n, k, g = 8, 256, 128
q = torch.full((n, k // 4), 0x66, dtype=torch.uint8); s = torch.full((n, k // g), 0.5).half()
qk, sk = ops.prepare_weight(q, s, g)
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    x = torch.randn(2, k).to(dtype)
    auto = ops.ternary_linear(x, qk, sk, n, k, g)
    ex = ops.ternary_linear(x, qk, sk, n, k, g, None, ops.EXACT)
    i8 = ops.ternary_linear(x, qk, sk, n, k, g, None, ops.INT8_GROUP)
    assert not torch.equal(ex, i8)
    print(dtype, "exact" if torch.equal(auto, ex) else "int8" if torch.equal(auto, i8) else "?")
"""
    envs = {kk: v for kk, v in os.environ.items() if kk != "TERNARY_RS_CPU_INT8"}
    if env is not None:
        envs["TERNARY_RS_CPU_INT8"] = env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=envs, timeout=120)
    assert out.returncode == 0, out.stderr
    bf16, f32 = (line.split()[-1] for line in out.stdout.strip().splitlines())
    want = {"exact": ("exact", "exact"), "int8": ("int8", "int8"), "by-dtype": ("int8", "exact")}[expect]
    assert (bf16, f32) == want


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
    """torch's pool for the native op, the ternary-rs pool for the Python path: same bits at 1 and 2."""
    rng = np.random.default_rng(2)
    n, k, g = 2048, 1024, 128
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    old, old_torch = ternary_rs.get_num_threads(), torch.get_num_threads()
    try:
        for m in (1, 24):
            for act in (ops.EXACT, ops.INT8_GROUP):
                x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(torch.bfloat16)
                outs = []
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    ternary_rs.set_num_threads(threads)
                    outs.append(run_op(x, qk, sk, n, k, g, activations=act))
                    outs.append(_ops_cpu.ternary_linear(x, qk, sk, n, k, g, None, act))
                assert all(torch.equal(o, outs[0]) for o in outs[1:])
    finally:
        ternary_rs.set_num_threads(old)
        torch.set_num_threads(old_torch)


def _thread_names() -> list[str]:
    from pathlib import Path

    return sorted(p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm"))


def test_native_op_runs_on_torchs_pool_without_python():
    """The CPU kernel is registered natively (no Python on the call path) and its calls never start
    threads of the ternary-rs rayon pool: inside torch it uses torch's intra-op threads."""
    assert ops.NATIVE_CPU_UNAVAILABLE is None
    # The dispatcher's CPU kernel for the op is not a Python function.
    kernels = torch._C._dispatch_dump(ops.OP_NAME)
    cpu_line = next(line for line in kernels.splitlines() if line.startswith("CPU:"))
    assert "torch/cpu_op.rs" in cpu_line, kernels  # registered from Rust, not ops.py
    code = """
import os, torch
from pathlib import Path
from ternary_rs import ops

def pool_cpu_ticks():
    # CPU time (utime + stime, clock ticks) of every thread of the ternary-rs rayon pool.
    total = 0
    for task in Path('/proc/self/task').iterdir():
        if (task / 'comm').read_text().strip().startswith('ternary-rs'):
            fields = (task / 'stat').read_text().rsplit(')', 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total

n, k, g = 4096, 2048, 128
qk, sk = ops.prepare_weight(torch.full((n, k // 4), 0x66, dtype=torch.uint8), torch.ones(n, k // g).half(), g)
torch.set_num_threads(2)
x = torch.randn(8, k, dtype=torch.bfloat16)
threads = lambda: sum(1 for t in Path('/proc/self/task').iterdir())
before, ticks = threads(), pool_cpu_ticks()  # prepare_weight (load time) may have started the pool
for _ in range(200):
    ops.ternary_linear(x, qk, sk, n, k, g)
print(threads() - before, pool_cpu_ticks() - ticks)
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    new_threads, pool_ticks = map(int, out.stdout.split())
    assert new_threads == 0 and pool_ticks <= 1, f"op calls used the rayon pool: {out.stdout}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_warm_up_pass_returns_zeros_and_always_ends(dtype):
    """Inside ``warm_up_pass`` (vLLM's discarded warm-up forward) the native op, the Python path and the
    MoE op return zeros of the right shape and dtype without computing; on the way out — also by an
    exception — every call computes again."""
    rng = np.random.default_rng(5)
    n, k, g = 37, 512, 128
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    x = torch.randn(2, 3, k).to(dtype)
    want = run_op(x, qk, sk, n, k, g, activations=ops.AUTO)
    assert want.abs().sum() > 0
    with _ops_cpu.warm_up_pass():
        for y in (run_op(x, qk, sk, n, k, g, activations=ops.AUTO), _ops_cpu.ternary_linear(x, qk, sk, n, k, g)):
            assert y.shape == (2, 3, n) and y.dtype == dtype and not y.any()
    with pytest.raises(RuntimeError, match="inside"):
        with _ops_cpu.warm_up_pass():
            raise RuntimeError("inside")
    for y in (run_op(x, qk, sk, n, k, g, activations=ops.AUTO), _ops_cpu.ternary_linear(x, qk, sk, n, k, g)):
        assert torch.equal(y, want)


def reference_layout(q: torch.Tensor, s: torch.Tensor, k: int, g: int) -> tuple[np.ndarray, np.ndarray]:
    """The CPU layout written from its description (``_ops_cpu``): rows in blocks of 4, K padded to 256
    with t = 0; per block and 256 weights the 64-byte chunks of rows 0..3, byte j of a chunk holding the
    codes of weights j, 64+j, 128+j, 192+j at bits 0, 2, 4, 6; scales [block][group][row], padding 0."""
    n = q.shape[0]
    codes = ((q.numpy()[:, :, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(n, k)
    kp, np_ = -(-k // 256) * 256, -(-n // 4) * 4
    codes = np.pad(codes, ((0, np_ - n), (0, kp - k)), constant_values=1)
    out = np.zeros((np_ // 4, kp), dtype=np.uint8)
    for row in range(np_):
        for kk in range(kp):
            b, r = divmod(row, 4)
            sb, within = divmod(kk, 256)
            sub, j = divmod(within, 64)
            out[b, sb * 256 + r * 64 + j] |= codes[row, kk] << (2 * sub)
    scales = np.zeros((np_ // 4, kp // g, 4), dtype=np.float16)
    for row in range(n):
        scales[row // 4, : k // g, row % 4] = s.numpy()[row]
    return out, scales.reshape(np_ // 4, -1)


@pytest.mark.parametrize("n,k,g", [(5, 32, 32), (4, 96, 32), (7, 256, 128), (3, 512, 256), (9, 320, 64)])
def test_prepare_weight_layout(n, k, g):
    rng = np.random.default_rng(k + n)
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    assert qk.dtype == torch.uint8 and sk.dtype == torch.float16
    want_q, want_s = reference_layout(q, s, k, g)
    np.testing.assert_array_equal(qk.numpy(), want_q)
    np.testing.assert_array_equal(sk.numpy(), want_s)


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
    # The native kernel reports through torch (RuntimeError), the Python path with ValueError/TypeError:
    # same messages.
    for call, errors in ((run_op, (RuntimeError,)),
                         (lambda *a, **kw: _ops_cpu.ternary_linear(*a, **kw), (ValueError, TypeError))):
        with pytest.raises(errors, match=r"expected \[\.\.\., 96\]"):
            call(torch.randn(2, k + 1), qk, sk, n, k, g)
        with pytest.raises(errors, match="dtype"):
            call(x.double(), qk, sk, n, k, g)
        with pytest.raises(errors, match="prepared uint8"):
            call(x, q, sk, n, k, g)  # canonical, not prepared
        with pytest.raises(errors, match="bias"):
            call(x, qk, sk, n, k, g, torch.zeros(n + 1))
    with pytest.raises(RuntimeError, match="activations=7"):
        run_op(x, qk, sk, n, k, g, activations=7)
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
                for act in (ops.AUTO, ops.INT8_TOKEN):
                    yield (torch.randn(shape).to(dtype), qk, sk, n, k, g, bias, act)


@pytest.mark.parametrize("args", list(_opcheck_samples()), ids=lambda a: f"{a[0].dtype}-{tuple(a[0].shape)}-{a[6] is not None}-{a[7]}")
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


def _dense_prefill_variant() -> str | None:
    """A SIMD variant whose bf16 prefill takes the dense path on this CPU (AVX-512 on Zen 4, AVX2 forced
    on any CPU with AVX512_BF16), or None."""
    return next((v for v in ("avx512", "avx2") if v in _ops_cpu.available_variants()
                 and _ops_cpu.dense_prefill_pays(v)), None)


@pytest.mark.parametrize("with_bias", [False, True])
def test_large_m_bf16_takes_the_dense_tile_path(with_bias):
    """bf16, default mode, M ≥ 48 (prefill) where the dense path pays: row chunks decoded to bf16
    (t · bf16(s), exact) and multiplied by torch's GEMM — within bf16 weight rounding (2⁻⁹ relative
    per weight) of float64 and the output rounding; below 48 tokens it is the int8 kernel, bit for bit."""
    assert ops.NATIVE_CPU_UNAVAILABLE is None  # the path lives in the native kernel
    variant = _dense_prefill_variant()
    if variant is None:
        pytest.skip("no variant here takes the dense prefill (no native bf16 dot products for torch's GEMM): "
                    "prefill stays on the int8 kernels (test_large_m_bf16_stays_int8_where_dense_does_not_pay)")
    with _ops_cpu.kernel_options(variant=variant):
        _check_dense_tile_path(with_bias)


_STAYS_INT8 = [v for v in _ops_cpu.available_variants() if v != "scalar" and not _ops_cpu.dense_prefill_pays(v)]


@pytest.mark.skipif(not _STAYS_INT8, reason="every SIMD variant here takes the dense prefill")
@pytest.mark.parametrize("variant", _STAYS_INT8)
def test_large_m_bf16_stays_int8_where_dense_does_not_pay(variant):
    """Where the dense prefill does not pay — AMX-INT8 (its tiles beat it), the AVX-512 rows-in-lanes
    kernel on full-width 512-bit units (Zen 5: 2x the multiply-adds per instruction of bf16), or no native
    bf16 dot products for torch's GEMM (AVX2: 10.9 s vs ~0.75 s at 512 x 5120 -> 17408) — the default bf16 mode
    keeps the int8 numerics at every M: bit for bit the explicit int8 mode, within its quantization bound."""
    rng = np.random.default_rng(29)
    n, k, g = 300, 1024, 128
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    w64 = dequantize64(q, s, g)
    with _ops_cpu.kernel_options(variant=variant):
        for m in (4, 5, 48, 200):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).bfloat16()
            auto = OP(x, qk, sk, n, k, g, None)
            assert torch.equal(auto, run_op(x, qk, sk, n, k, g, None, activations=ops.INT8_GROUP))
            y64, mag = reference(x, w64, None)
            tol = int8_bound(x, w64, g) * 1.0001 + 2.0**-8 * np.abs(y64) + 1e-5 * mag + 1e-30
            assert np.all(np.abs(auto.double().numpy() - y64) <= tol)


def _check_dense_tile_path(with_bias):
    rng = np.random.default_rng(23)
    n, k, g = 4201, 2048, 128  # 17 MB dense: two decode chunks; N not a multiple of 4
    q, s = make_weight(rng, n, k, g)
    qk, sk = ops.prepare_weight(q, s, g)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).bfloat16() if with_bias else None
    w64 = dequantize64(q, s, g)
    for m in (47, 48, 200):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).bfloat16()
        auto = OP(x, qk, sk, n, k, g, bias)
        int8 = run_op(x, qk, sk, n, k, g, bias, activations=ops.INT8_GROUP)
        y64, mag = reference(x, w64, bias)
        if m < 48:
            assert torch.equal(auto, int8)
        else:
            assert not torch.equal(auto, int8)
            got = auto.double().numpy()
            tol = 2.0**-8 * np.abs(y64) + 2.0**-8 * mag + 1e-30
            assert np.all(np.abs(got - y64) <= tol)
    # 3-D input, the same rows.
    x = torch.from_numpy(rng.standard_normal((3, 20, k)).astype(np.float32)).bfloat16()
    assert torch.equal(OP(x, qk, sk, n, k, g, bias).reshape(60, n), OP(x.reshape(60, k), qk, sk, n, k, g, bias))


def load_bench_cpu_op():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benches" / "bench_cpu_op.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_op", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_round_robin_timing_calls_every_side_in_turn():
    """benches/bench_cpu_op.py's ratios come from round-robin timing: every side once per round, each
    after its own untimed setup, copies cycled; (median, min) per side."""
    bench = load_bench_cpu_op()
    log = []
    fns = {
        "a": (lambda i: log.append(("a", i)), 2, lambda: log.append("setup a")),
        "b": (lambda i: log.append(("b", i)), 3, None),
    }
    got = bench.timed_together(fns, budget_s=0.0, min_rounds=4, run_s=0.0)
    warm = ["setup a", ("a", 0), "setup a", ("a", 1), ("b", 0), ("b", 1), ("b", 2)]
    assert log[: len(warm)] == warm
    rounds = [e for e in log[len(warm):] if e != "setup a"]
    assert rounds == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 0), ("b", 2), ("a", 1), ("b", 0)]
    assert log[len(warm):].count("setup a") == 4
    for median, fastest in got.values():
        assert 0 <= fastest <= median


def test_bench_round_robin_timing_times_runs_of_calls():
    """With ``run_s``, each side's turn in a round is a run of back-to-back calls (as a decoding model calls
    its layers), the same length every round, its copies cycling on from one run to the next; the times
    are per call."""
    bench = load_bench_cpu_op()
    log = []

    def slow(i):
        log.append(i)
        time.sleep(0.002)

    got = bench.timed_together({"a": (slow, 3, None)}, budget_s=0.0, min_rounds=3, run_s=0.008)
    rounds = log[3:]  # after the warm pass over the 3 copies
    n = len(rounds) // 3
    assert len(rounds) == 3 * n and n >= 2
    assert rounds == [i % 3 for i in range(3 * n)]
    median, fastest = got["a"]
    assert 0.002 <= fastest <= median < 0.008


def reference_lanes_layout(q: torch.Tensor, s: torch.Tensor, k: int, g: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows-in-lanes layout written from its description (``_ops_cpu``, docs/design.md): rows in groups
    of 16, K padded to 256 with t = 0; per group 64-byte lines of 16 weights, byte 4·n + b of line j holding
    at bits 2·i the code of row n, weight 16·j + 4·i + b; scales [group][weight group][row], padding 0."""
    n = q.shape[0]
    kp = -(-k // 256) * 256
    groups = -(-n // 16)
    codes = ((q.numpy()[:, :, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(n, k)
    full = np.ones((groups * 16, kp), dtype=np.uint8)
    full[:n, :k] = codes
    out = np.zeros((groups, kp // 16, 16, 4), dtype=np.uint8)  # [group][line][row][byte]
    for i in range(4):
        # weights 16·j + 4·i + b of row r → line j, row r, byte b, bits 2i
        part = full.reshape(groups, 16, kp // 16, 4, 4)[:, :, :, i, :]  # [group][row][line][b]
        out |= (part.transpose(0, 2, 1, 3) << (2 * i)).astype(np.uint8)
    scales = np.zeros((groups * 16, kp // g), dtype=np.float16)
    scales[:n, : k // g] = s.numpy()
    scales = scales.reshape(groups, 16, kp // g).transpose(0, 2, 1)
    return out.reshape(groups, -1), scales.reshape(groups, -1)


@pytest.mark.parametrize("n,k,g", [(5, 32, 32), (17, 96, 32), (16, 256, 128), (33, 512, 256), (9, 320, 64)])
def test_prepare_weight_lanes16_layout(n, k, g):
    rng = np.random.default_rng(k + n + 1)
    q, s = make_weight(rng, n, k, g)
    qk, sk = _ops_cpu.prepare_weight(q, s, g, "lanes16")
    want_q, want_s = reference_lanes_layout(q, s, k, g)
    assert tuple(qk.shape) == want_q.shape and tuple(sk.shape) == want_s.shape
    np.testing.assert_array_equal(qk.numpy(), want_q)
    np.testing.assert_array_equal(sk.numpy(), want_s)
    assert _ops_cpu.layout_of(qk, n, k, g) == "lanes16"
    assert _ops_cpu.layout_of(ops.prepare_weight(q, s, g)[0], n, k, g) == "rows4"


@pytest.mark.parametrize("variant", _ops_cpu.available_variants())
@pytest.mark.parametrize("activations", [ops.EXACT, ops.INT8_GROUP, ops.INT8_TOKEN])
def test_lanes16_weights_match_rows4_and_reference(variant, activations):
    """Every variant and mode on a lanes16 weight (the AVX-512 lanes kernel, or the plain reference) is within
    the float64 bound; the int8 modes agree with the rows4 weight; the Python path gives the native result."""
    rng = np.random.default_rng(11)
    for m, n, k, g in [(1, 37, 320, 32), (3, 9, 512, 64), (8, 40, 1024, 128), (19, 21, 768, 256),
                       (2, 1030, 1024, 128), (16, 1100, 1024, 128)]:
        q, s = make_weight(rng, n, k, g)
        lanes = _ops_cpu.prepare_weight(q, s, g, "lanes16")
        rows4 = ops.prepare_weight(q, s, g)
        dtype = DTYPES[(m + n) % 3]
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
        with _ops_cpu.kernel_options(variant):
            got = run_op(x, *lanes, n, k, g, activations=activations)
            got_py = _ops_cpu.ternary_linear(x, *lanes, n, k, g, activations=activations)
            want = run_op(x, *rows4, n, k, g, activations=activations)
        w64 = dequantize64(q, s, g)
        y64, mag = reference(x, w64, None)
        extra = 0.0 if activations == ops.EXACT else int8_bound(x, w64, g, activations == ops.INT8_TOKEN)
        assert_close(got, y64, mag, k, extra)
        torch.testing.assert_close(got_py, got, rtol=0, atol=0)
        np.testing.assert_allclose(
            got.float().numpy(), want.float().numpy(), rtol=2 * OUT_EPS[dtype] + 1e-5, atol=1e-5 * float(mag.max())
        )


def test_int8_layout_choice_and_override(monkeypatch):
    rng = np.random.default_rng(2)
    n, k, g = 20, 256, 128
    q, s = make_weight(rng, n, k, g)
    chosen = _ops_cpu.int8_layout()
    assert chosen in _ops_cpu.LAYOUTS
    assert _ops_cpu.layout_of(ops.prepare_weight(q, s, g, int8_only=True)[0], n, k, g) == chosen
    assert _ops_cpu.layout_of(ops.prepare_weight(q, s, g)[0], n, k, g) == "rows4"  # exact-mode weights
    with _ops_cpu.kernel_options("scalar"):
        assert _ops_cpu.int8_layout() == "rows4"  # the lanes kernel is AVX-512's
    for forced in _ops_cpu.LAYOUTS:
        monkeypatch.setenv("TERNARY_RS_CPU_LAYOUT", forced)
        assert _ops_cpu.int8_layout() == forced
    monkeypatch.setenv("TERNARY_RS_CPU_LAYOUT", "rows8")
    with pytest.raises(ValueError, match="rows4 or lanes16"):
        _ops_cpu.int8_layout()
    with pytest.raises(ValueError, match="layout"):
        _ops_cpu.prepare_weight(q, s, g, "rows8")


def test_lanes16_shape_errors_name_the_layout():
    rng = np.random.default_rng(6)
    n, k, g = 20, 256, 128
    q, s = make_weight(rng, n, k, g)
    qk, sk = _ops_cpu.prepare_weight(q, s, g, "lanes16")
    x = torch.randn(2, k)
    with pytest.raises(RuntimeError, match="lanes16"):
        run_op(x, qk, sk[:, :-1].contiguous(), n, k, g)
    with pytest.raises(RuntimeError, match="prepared uint8"):
        run_op(x, qk[:, :-64].contiguous(), sk, n, k, g)
