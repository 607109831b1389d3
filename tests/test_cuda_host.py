"""Host-side checks of the CUDA kernels that need no GPU and no CUDA toolkit.

``cuda/tests/test_fragments.cpp`` replays both kernels' per-lane logic (weight-word unpacking, mma.sync and
ldmatrix fragment assembly from their PTX ISA definitions, the swizzled shared-memory tile, group-scale
flushes, split-K reduction) over whole grids and compares with a float64 ``x @ W.T + bias`` built from an
independent implementation of the layout spec. Here it is compiled with the system C++ compiler and run.
(``scripts/check_cuda.sh`` runs it too, next to the nvcc/ptxas checks.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_fragment_replays_match_reference(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    assert cxx, "a C++17 compiler (g++/clang++) is needed to build cuda/tests/test_fragments.cpp"
    exe = tmp_path / "test_fragments"
    subprocess.run(
        [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", str(ROOT / "cuda/tests/test_fragments.cpp"), "-o", str(exe)],
        check=True,
        capture_output=True,
        text=True,
    )
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "all fragment replays match the reference" in run.stdout
    # Both kernels, split-K and the GEMV cut-off at 8 and 16 were exercised.
    out = run.stdout
    assert "kernel 0" in out and "kernel 4" in out and "cut-off 16" in out
    assert any(f"{s} split(s)" in out for s in (2, 4, 8, 16))


@pytest.mark.parametrize("per_token", [True, False], ids=["int8_token", "int8_group"])
def test_cuda_int8_emulation_quantizes_like_the_cpu_kernel(per_token):
    """On CUDA the int8 activation modes are emulated (``_ops_cuda._int8_activations``: integer codes fed to
    the fp kernels, the token scale applied afterwards). Its quantization must be the CPU kernel's bit for
    bit. The CPU op shows it exactly with ``W = I`` (scale 1) and codes that sum to zero in every group
    (``x`` antisymmetric in pairs, so the kernel's code-offset correction is 0): then ``y[n] = fl(xs · q[n])``."""
    torch = pytest.importorskip("torch")
    from ternary_rs import pack_codes
    from ternary_rs.serving import _ops_cuda, ops

    g = 128
    k = 4 * g
    gen = torch.Generator().manual_seed(7)
    half = torch.randn(12, k // 2, generator=gen) * torch.logspace(-3, 2, 12).unsqueeze(1)
    half[0] = 0.0
    half[0, :6] = torch.tensor([127.0, 2.5, -3.5, 0.5, 126.5, -1.5])  # scale exactly 1: .5 ties, half to even
    half[1] *= 1e-8                                                  # max|x| under BitNet's 1e-5 clamp
    half[2] = 0.0                                                    # an all-zero token
    half[3, 64:] = 0.0                                               # all-zero groups (per-group mode)
    half[5, :64] = torch.arange(64) % 3 * 1e-38                      # 127 / max|x_g| overflows: a zero group
    x = torch.stack([half, -half], dim=-1).reshape(12, k).contiguous()
    eye = torch.eye(k, dtype=torch.int8)
    qk, sk = ops.prepare_weight(torch.from_numpy(pack_codes(eye.numpy())), torch.ones(k, k // g, dtype=torch.float16), g)
    mode = ops.INT8_TOKEN if per_token else ops.INT8_GROUP
    y = ops.ternary_linear(x, qk, sk, k, k, g, None, mode)
    q, xs = _ops_cuda._int8_activations(x, g, per_token)
    if per_token:
        assert q.dtype == torch.float16 and torch.equal(q.float(), q.float().round()) and q.abs().max() <= 128
        assert torch.equal(y, q.float() * xs)
    else:
        assert xs is None and torch.equal(y, q)  # per group: the emulation hands over q · xs_g itself


def test_cuda_int8_token_path_with_a_host_stand_in_kernel(monkeypatch):
    """``_ops_cuda.ternary_linear(activations=INT8_TOKEN)`` with the fused kernel replaced by its arithmetic
    (fp16 inputs, exact products, output rounded to fp16): equal to the CPU kernel's BitNet mode within the
    fp16 output rounding — also for a row whose integer sum ``Σ q·W`` (≈ 1.4e6 here) would overflow fp16
    if the codes were fed unscaled."""
    torch = pytest.importorskip("torch")
    from ternary_rs import pack_codes
    from ternary_rs.serving import _ops_cuda, ops

    n, k, g = 8, 4096, 128
    gen = torch.Generator().manual_seed(3)
    trits = torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8)
    w = trits.double() * 4.0
    x = torch.randn(5, k, generator=gen)
    x[0] = trits[0].float() * 0.5  # token 0 aligned with row 0: q = ±127 wherever W[0] != 0
    seen = []

    def stand_in(x2, qweight, scales, b, y, m, n_, k_, g_):
        seen.append(x2.dtype)
        y.copy_((x2.double() @ w.T).to(y.dtype))

    monkeypatch.setattr(_ops_cuda, "_require_kernels", lambda: None)
    monkeypatch.setattr(_ops_cuda, "_check_weight", lambda *args: None)
    monkeypatch.setattr(_ops_cuda, "_launch", stand_in)
    got = _ops_cuda.ternary_linear(x, None, None, n, k, g, None, ops.INT8_TOKEN)
    assert seen == [torch.float16] and got.dtype == torch.float32 and torch.isfinite(got).all()
    scales = torch.full((n, k // g), 4.0, dtype=torch.float16)
    qk, sk = ops.prepare_weight(torch.from_numpy(pack_codes(trits.numpy())), scales, g)
    want = ops.ternary_linear(x, qk, sk, n, k, g, None, ops.INT8_TOKEN)
    torch.testing.assert_close(got, want, rtol=2.0 ** -10, atol=0)


@pytest.fixture(scope="module")
def quantizer_replay(tmp_path_factory):
    """``cuda/tests/test_activation_quant.cpp`` built with the system C++ compiler: the CUDA quantizers'
    arithmetic (``cuda/activation_quant_math.h``, the functions the kernels call) on the host."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    assert cxx, "a C++17 compiler (g++/clang++) is needed to build cuda/tests/test_activation_quant.cpp"
    exe = tmp_path_factory.mktemp("quant") / "test_activation_quant"
    subprocess.run(
        [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", str(ROOT / "cuda/tests/test_activation_quant.cpp"),
         "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    return exe


def test_cuda_quantizer_replay_self_test(quantizer_replay):
    run = subprocess.run([str(quantizer_replay), "--self-test"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "all activation-quantizer replays match" in run.stdout


def _hostile_activations(torch, m: int, k: int, g: int):
    """Magnitudes over 10 decades, exact .5 ties, a token under BitNet's 1e-5 floor, all-zero tokens and
    groups, and one max|x| shared by many elements."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-4, 3, m).unsqueeze(1)
    x[0] = 0.0
    x[0, :7] = torch.tensor([127.0, 2.5, -3.5, 0.5, 126.5, -1.5, -127.0])  # scale exactly 1 per token
    x[1] *= 1e-9
    x[2] = 0.0
    x[3, g:2 * g] = 0.0
    x[4, ::3] = -x[4].abs().max()
    x[5, :g] = torch.arange(g) % 3 * 1e-38  # max|x_g| < 127 / f32 max: 127 / max overflows, a zero group
    return x.contiguous()


@pytest.mark.parametrize("per_token", [True, False], ids=["int8_token", "int8_group"])
def test_cuda_quantizers_match_the_cpu_kernel(quantizer_replay, tmp_path, per_token):
    """The native CUDA op quantizes activations with ``cuda/activation_quant.cu``. Its arithmetic, replayed
    on the host, must give the CPU kernel's codes and scales bit for bit — through ``_int8_activations``,
    which the test above ties to the CPU kernel — as the fp16 codes q·2⁻⁷ and f32 token scales per token,
    and as the bf16-rounded q·xs_g the bf16 GEMM gets per group."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from ternary_rs.serving import _ops_cuda

    m, k, g = 12, 512, 64
    x = _hostile_activations(torch, m, k, g)
    x.numpy().astype(np.float32).tofile(tmp_path / "x.f32")
    q, xs = _ops_cuda._int8_activations(x, g, per_token)
    if per_token:
        subprocess.run([str(quantizer_replay), "tokens", str(m), str(k), str(tmp_path / "x.f32"),
                        str(tmp_path / "codes.f32"), str(tmp_path / "xs.f32")], check=True, timeout=60)
        codes = torch.from_numpy(np.fromfile(tmp_path / "codes.f32", dtype=np.float32)).reshape(m, k)
        got_xs = torch.from_numpy(np.fromfile(tmp_path / "xs.f32", dtype=np.float32))
        assert torch.equal(codes * 128.0, q.float())
        assert torch.equal(codes.to(torch.float16).float(), codes)  # exact in fp16, as the GEMM reads them
        assert torch.equal(got_xs, xs.reshape(m))
    else:
        subprocess.run([str(quantizer_replay), "groups", str(m), str(k), str(g), str(tmp_path / "x.f32"),
                        str(tmp_path / "out.bf16")], check=True, timeout=60)
        got = torch.from_numpy(np.fromfile(tmp_path / "out.bf16", dtype=np.int16)).reshape(m, k)
        assert torch.equal(got, q.to(torch.bfloat16).view(torch.int16))


def test_cuda_token_epilogue_rounds_each_operation_once(quantizer_replay, tmp_path):
    """``scale_rows`` (y = fl(fl(y16 · xs·2⁷) + bias)) replayed on the host equals the Python path's torch
    ops: ``y.float() * (xs / INT8_CODE_SCALE) + bias.float()``, one rounding each, no fused multiply-add."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from ternary_rs.serving import _ops_cuda

    m, n = 7, 300
    gen = torch.Generator().manual_seed(5)
    y16 = (torch.randn(m, n, generator=gen) * 50).to(torch.float16).float()
    xs = torch.rand(m, generator=gen) * 1e-2
    bias = torch.randn(n, generator=gen)
    for name, t in (("y", y16), ("xs", xs), ("b", bias)):
        t.numpy().astype(np.float32).tofile(tmp_path / f"{name}.f32")
    subprocess.run([str(quantizer_replay), "scale", str(m), str(n), *(str(tmp_path / f"{v}.f32") for v in ("y", "xs", "b")),
                    str(tmp_path / "out.f32")], check=True, timeout=60)
    got = torch.from_numpy(np.fromfile(tmp_path / "out.f32", dtype=np.float32)).reshape(m, n)
    want = y16 * (xs.unsqueeze(1) / _ops_cuda.INT8_CODE_SCALE) + bias
    assert torch.equal(got, want)


def test_cuda_kernel_registration_says_why_it_is_not_native_here():
    """Without CUDA kernels in the build (or without a CUDA torch) the op's CUDA kernel is the Python path,
    and ``ops.NATIVE_CUDA_UNAVAILABLE`` says why; with both it is the native one (tests/test_cuda.py)."""
    torch = pytest.importorskip("torch")
    from ternary_rs import _core
    from ternary_rs.serving import ops

    assert torch._C._dispatch_has_kernel_for_dispatch_key(ops.OP_NAME, "CUDA")
    if not _core.cuda_available():
        assert ops.NATIVE_CUDA_UNAVAILABLE == "this ternary_rs build has no CUDA kernels"
    elif torch.version.cuda is None:
        assert "without CUDA" in ops.NATIVE_CUDA_UNAVAILABLE
    # The native kernel's dequantize cut-off follows the Python setting.
    from ternary_rs.serving import _ops_cuda

    prev = _ops_cuda.set_dequant_min_m(256)
    try:
        assert _core.cuda_set_dequant_min_m(256) == 256
    finally:
        _ops_cuda.set_dequant_min_m(prev)
    assert _core.cuda_set_dequant_min_m(prev) == prev


def test_native_cuda_kernel_is_reached_through_the_dispatcher():
    """With a CUDA build of ternary_rs and a CUDA build of torch the op's CUDA kernel is the native one even
    on a machine without a GPU: redispatching to the CUDA key reaches ``torch/cuda_op.rs``, which unboxes the
    arguments and rejects what it can check before touching a device. (The GPU tests run the rest.)"""
    torch = pytest.importorskip("torch")
    from ternary_rs import _core
    from ternary_rs.serving import ops

    if not (_core.cuda_available() and torch.version.cuda):
        pytest.skip("needs the CUDA build of ternary_rs (maturin build --features cuda) and a CUDA torch; "
                    "scripts/check_cuda.sh compiles and lints that build")
    assert ops.NATIVE_CUDA_UNAVAILABLE is None
    assert "torch/cuda_op.rs" in torch._C._dispatch_dump(ops.OP_NAME)
    op = torch.ops.ternary_rs.ternary_linear.default
    cuda_only = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    q = torch.zeros(2, 2048, dtype=torch.uint8)
    s = torch.zeros(4, 64, dtype=torch.float16)
    for args, message in [
        ((x, q, s, 64, 256, 64, None, 0), "x is not a CUDA tensor"),
        ((x, q, s, 64, 256, 64, None, 9), "activations=9"),
        ((x.double(), q, s, 64, 256, 64, None, 0), "x dtype is not supported on CUDA"),
        ((x, q, s, 64, 256, 64, torch.zeros(3), 3), "x is not a CUDA tensor"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            op.redispatch(cuda_only, *args)
