"""CPU implementation of ``ternary_rs::ternary_linear``: the fused Rust SIMD kernel.

The kernel (``rust/ternary-core/src/kernels/cpu``) never materialises the dense weight:

* ``prepare_weight`` permutes the canonical codes once into sign bit-planes — ``uint8 [N, row_bytes(K)]``
  where each 64 columns of a row are a little-endian ``u64`` "t = +1" mask then a ``u64`` "t = −1" mask
  (same 2 bits/weight; K padded to a multiple of 64). Scales stay ``float16 [N, K/g]``.
* ``ternary_linear`` passes raw data pointers (``tensor.data_ptr()``) and sizes to
  ``_core.ternary_gemm_cpu``, which runs with the GIL released on the ternary-rs thread pool
  (``ternary_rs.set_num_threads``), multithreaded over N for large weights.

Paths: M < 4 streams the bit-planes once per block of rows (GEMV: AVX-512 masked adds, or ``vdpbf16ps``
for bf16 x on CPUs with AVX512_BF16); M ≥ 4 decodes 16 × 512 weight tiles to f32 once and runs an FMA
micro-kernel over all rows of x (GEMM).

Accuracy (default, "exact"): x is converted to f32 (lossless for bf16/fp16/fp32), products ``t·x`` are
exact and sums are f32 accumulations (per group, then × scale); the result is rounded once to x's dtype
(the bf16 dot-product path treats |x| < 2⁻¹²⁶ as 0).
Versus a float64 reference: ``|err| ≤ K·2⁻²³·Σₖ|x_k·W[n,k]|`` before that final rounding (in practice
~1e-6 relative). Opt-in int8 mode (``set_int8_activations(True)`` or ``TERNARY_RS_CPU_INT8=1``): x is
quantized per row to int8 (scale ``max|x|/127``) and summed with integer dot products (VNNI);
extra error ``≤ max|x|/254 · Σₖ|W[n,k]|``.

The variant (``"auto"`` = best supported, ``"avx512"``, ``"avx2"``, ``"scalar"``) can be forced with
``set_kernel_variant`` or the ``TERNARY_RS_CPU_KERNEL`` environment variable (read at import).
"""

from __future__ import annotations

import contextlib
import os

import torch

from . import _core

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

_variant = os.environ.get("TERNARY_RS_CPU_KERNEL", "auto") or "auto"
_int8 = os.environ.get("TERNARY_RS_CPU_INT8", "0") not in ("", "0")


def available_variants() -> list[str]:
    """Kernel variants this CPU can run (always includes ``"scalar"``)."""
    return list(_core.cpu_kernel_variants())


def kernel_variant() -> str:
    """The variant the op uses now (``"auto"`` resolved to the best supported one)."""
    return _core.cpu_kernel_best() if _variant == "auto" else _variant


def set_kernel_variant(name: str) -> None:
    """Force a kernel variant (``"auto"``, ``"avx512"``, ``"avx2"`` or ``"scalar"``)."""
    global _variant
    if name != "auto" and name not in available_variants():
        raise ValueError(
            f"CPU kernel variant {name!r} is not available here; choose from auto, {', '.join(available_variants())}"
        )
    _variant = name


def int8_activations() -> bool:
    return _int8


def set_int8_activations(enabled: bool) -> None:
    """Opt in to (or out of) the per-token int8 activation mode (default: exact f32 accumulation)."""
    global _int8
    _int8 = bool(enabled)


@contextlib.contextmanager
def kernel_options(variant: str | None = None, int8: bool | None = None):
    """Temporarily force a variant and/or the activation mode (tests and benchmarks)."""
    old = (_variant, _int8)
    try:
        if variant is not None:
            set_kernel_variant(variant)
        if int8 is not None:
            set_int8_activations(int8)
        yield
    finally:
        globals().update(_variant=old[0], _int8=old[1])


_GROUP_SIZES_TEXT = ", ".join(map(str, _core.GROUP_SIZES))


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def prepare_weight(qweight: torch.Tensor, scales: torch.Tensor, group_size: int):
    """Canonical ``(uint8 [N, K/4], float16 [N, K/g])`` → ``(bit-planes uint8 [N, row_bytes], float16 scales)``."""
    _check(qweight.dtype == torch.uint8 and qweight.dim() == 2, f"qweight must be uint8 [N, K/4], got {qweight.dtype} {tuple(qweight.shape)}")
    _check(scales.dtype == torch.float16, f"scales must be float16, got {scales.dtype}")
    n, k = qweight.shape[0], qweight.shape[1] * 4
    _check(group_size in _core.GROUP_SIZES, f"group_size {group_size} is not one of {_GROUP_SIZES_TEXT}")
    _check(k % group_size == 0, f"in_features {k} is not a multiple of group_size {group_size}")
    _check(tuple(scales.shape) == (n, k // group_size), f"scales must be [{n}, {k // group_size}], got {tuple(scales.shape)}")
    _check(qweight.device.type == "cpu" and scales.device.type == "cpu", "prepare_weight (CPU) needs CPU tensors")
    q = qweight.contiguous()
    s = scales.contiguous()
    planes = torch.empty((n, _core.cpu_prepared_row_bytes(k)), dtype=torch.uint8)
    _core.ternary_cpu_prepare(q.data_ptr(), s.data_ptr(), n, k, group_size, planes.data_ptr())
    return planes, s


def ternary_linear(x, qweight, scales, out_features, in_features, group_size, bias=None):
    n, k, g = int(out_features), int(in_features), int(group_size)
    name = _DTYPE_NAMES.get(x.dtype)
    if name is None:
        raise TypeError(f"ternary_linear: x dtype {x.dtype} is not supported; use bfloat16, float16 or float32")
    _check(x.dim() >= 1 and x.shape[-1] == k, f"ternary_linear: x has shape {tuple(x.shape)}, expected [..., {k}]")
    _check(g in _core.GROUP_SIZES and k % g == 0, f"ternary_linear: in_features {k} / group_size {g} invalid")
    row_bytes = _core.cpu_prepared_row_bytes(k)
    _check(
        qweight.dtype == torch.uint8 and tuple(qweight.shape) == (n, row_bytes) and qweight.is_contiguous(),
        f"ternary_linear: qweight must be the prepared uint8 [{n}, {row_bytes}] (ops.prepare_weight), got "
        f"{qweight.dtype} {tuple(qweight.shape)}",
    )
    _check(
        scales.dtype == torch.float16 and tuple(scales.shape) == (n, k // g) and scales.is_contiguous(),
        f"ternary_linear: scales must be float16 [{n}, {k // g}], got {scales.dtype} {tuple(scales.shape)}",
    )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype)
    b_ptr = 0
    if bias is not None:
        _check(tuple(bias.shape) == (n,), f"ternary_linear: bias must be [{n}], got {tuple(bias.shape)}")
        bias = bias.to(dtype=x.dtype).contiguous()
        b_ptr = bias.data_ptr()
    if m > 0 and n > 0:
        _core.ternary_gemm_cpu(
            x2.data_ptr(), name, m, k, qweight.data_ptr(), scales.data_ptr(), n, g, b_ptr, y.data_ptr(),
            _variant, _int8,
        )
    return y.reshape(*lead, n)
