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
    from ternary_rs import _ops_cuda, ops, pack_codes

    g = 128
    k = 4 * g
    gen = torch.Generator().manual_seed(7)
    half = torch.randn(12, k // 2, generator=gen) * torch.logspace(-3, 2, 12).unsqueeze(1)
    half[0] = 0.0
    half[0, :6] = torch.tensor([127.0, 2.5, -3.5, 0.5, 126.5, -1.5])  # scale exactly 1: .5 ties, half to even
    half[1] *= 1e-8                                                  # max|x| under BitNet's 1e-5 clamp
    half[2] = 0.0                                                    # an all-zero token
    half[3, 64:] = 0.0                                               # all-zero groups (per-group mode)
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
    from ternary_rs import _ops_cuda, ops, pack_codes

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
