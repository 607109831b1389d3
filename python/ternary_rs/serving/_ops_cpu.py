"""CPU implementation of ``ternary_rs::ternary_linear``: the fused Rust SIMD kernel.

The kernel (``rust/ternary-core/src/kernels/cpu``) never materialises the dense weight:

* ``prepare_weight`` permutes the canonical codes once into the kernel layout: ``uint8 [ceil(N/4), Kp]``
  (four rows interleaved, ``Kp`` = K rounded up to 256; per row and 256 weights one 64-byte chunk whose
  byte j holds the codes of weights j, 64+j, 128+j, 192+j), and the scales into ``float16
  [ceil(N/4), Kp/g·4]`` (the four rows of a group side by side). Same 2 bits per weight.
  Weights only the int8 modes will multiply may instead take the rows-in-lanes layout (``layout="lanes16"``,
  what ``int8_layout()`` picks on full-width AVX-512 VNNI CPUs without AMX): ``uint8 [ceil(N/16), 4·Kp]`` and
  ``float16 [ceil(N/16), Kp/g·16]``, 16 rows in the 32-bit lanes of each 64-byte line, so the int8 kernel
  unpacks a line with a shift and an AND at every M (docs/design.md#the-rows-in-lanes-layout). The op tells
  the two apart by the codes' second dimension (``Kp`` vs ``4·Kp``); the exact modes run on either layout
  (the MoE op needs ``rows4``).
* The op's CPU kernel is registered **natively** with torch's dispatcher (``register_native``: PyTorch's
  stable C ABI, resolved at run time from the loaded libtorch), so a call runs no Python, and it splits
  its work over torch's own intra-op thread pool — inside vLLM the OpenMP pool bound to the cores.
  :func:`ternary_linear` below is the same kernel called through Python (on the ternary-rs rayon pool);
  it serves torch builds without that ABI (< 2.10) and tests.

Activation modes (the op's ``activations`` argument; 0 = auto):

* **int8 per group** (2; auto for bf16/fp16 x): x quantized per token and per weight group to int8
  (``xs = max|x_g|/127``, round half to even), exact integer dot products (VNNI, or AMX-INT8 tiles from a few tokens on CPUs that have
  them), combined in f32.
  Extra error vs float64 ``≤ Σ_g xs_g/2 · Σ_{k∈g}|W[n,k]|`` — at least as tight as llama.cpp's Q8_K.
* **exact** (1; auto for f32 x): x in f32, exact products, f32 sums per group then × scale:
  ``|y − y64| ≤ K·2⁻²³·Σₖ|x_k·W[n,k]|`` before the one rounding to x's dtype (bf16 x may take the
  ``vdpbf16ps`` GEMV, which treats |x| < 2⁻¹²⁶ as 0).
* **int8 per token** (3): BitNet b1.58's ``activation_quant`` — one scale ``127/max(max|x|, 1e-5)`` per
  token; the BitNet architecture always asks for it.

``TERNARY_RS_CPU_INT8=0`` makes *auto* exact for every dtype, ``=1`` int8 (per group) for every dtype;
an explicit ``activations`` value always wins. The variant (``"auto"`` = best supported, ``"amx"``,
``"avx512"``, ``"avx2"``, ``"scalar"``) can be forced with :func:`set_kernel_variant` or ``TERNARY_RS_CPU_KERNEL``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from .. import _core
from . import hugepages

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
AUTO, EXACT, INT8_GROUP, INT8_TOKEN = (
    _core.ACTIVATIONS_AUTO, _core.ACTIVATIONS_EXACT, _core.ACTIVATIONS_INT8_GROUP, _core.ACTIVATIONS_INT8_TOKEN,
)
_ACTIVATION_NAMES = {"auto": AUTO, "exact": EXACT, "int8": INT8_GROUP, "int8_group": INT8_GROUP,
                     "int8_token": INT8_TOKEN}


def _env_int8() -> bool | None:
    v = os.environ.get("TERNARY_RS_CPU_INT8")
    if v is None or v.strip() == "":
        return None
    return v.strip() not in ("0", "false", "False", "no")


_variant = os.environ.get("TERNARY_RS_CPU_KERNEL", "auto") or "auto"
_default_int8: bool | None = _env_int8()


def _push_settings() -> None:
    """The native kernel reads the variant and the auto mode from Rust: keep them in sync."""
    _core.cpu_set_kernel_variant(_variant)
    _core.cpu_set_default_int8(_default_int8)


def available_variants() -> list[str]:
    """Kernel variants this CPU can run (always includes ``"scalar"``)."""
    return list(_core.cpu_kernel_variants())


def kernel_variant() -> str:
    """The variant the op uses now (``"auto"`` resolved to the best supported one)."""
    return _core.cpu_kernel_best() if _variant == "auto" else _variant


def dense_prefill_pays(variant: str | None = None) -> bool:
    """Whether bf16 prefill calls (M >= 48, default mode) with ``variant`` (default: the one in use)
    take the dense path, decoded bf16 chunks through torch's GEMM: only where that GEMM has native bf16
    dot products and beats the int8 kernels of ``variant`` (not AMX's, not the AVX-512 rows-in-lanes one
    on full-width 512-bit units; ``dense::prefill_pays`` in the core crate)."""
    return bool(_core.cpu_dense_prefill_pays(variant or kernel_variant()))


def set_kernel_variant(name: str) -> None:
    """Force a kernel variant (``"auto"``, ``"amx"``, ``"avx512"``, ``"avx2"`` or ``"scalar"``)."""
    global _variant
    if name != "auto" and name not in available_variants():
        raise ValueError(
            f"CPU kernel variant {name!r} is not available here; choose from auto, {', '.join(available_variants())}"
        )
    _variant = name
    _push_settings()


def default_int8() -> bool | None:
    """What ``activations=0`` (auto) means now: None = by dtype, True = int8, False = exact."""
    return _default_int8


def set_default_int8(value: bool | None) -> None:
    """Make *auto* int8 (True) or exact (False) for every dtype; None restores the by-dtype default."""
    global _default_int8
    _default_int8 = None if value is None else bool(value)
    _push_settings()


def activations_code(mode: str | int) -> int:
    """The op's ``activations`` value for a mode name (``auto``, ``exact``, ``int8``, ``int8_token``)."""
    if isinstance(mode, int):
        if mode not in (AUTO, EXACT, INT8_GROUP, INT8_TOKEN):
            raise ValueError(f"activations={mode}: expected one of 0, 1, 2, 3")
        return mode
    try:
        return _ACTIVATION_NAMES[mode]
    except KeyError:
        raise ValueError(f"activation mode {mode!r}: expected one of {', '.join(_ACTIVATION_NAMES)}") from None


@contextlib.contextmanager
def kernel_options(variant: str | None = None, int8: bool | None = None):
    """Temporarily force a variant and/or the auto activation mode (tests and benchmarks)."""
    old = (_variant, _default_int8)
    try:
        if variant is not None:
            set_kernel_variant(variant)
        if int8 is not None:
            set_default_int8(int8)
        yield
    finally:
        globals().update(_variant=old[0], _default_int8=old[1])
        _push_settings()


@contextlib.contextmanager
def warm_up_pass():
    """While inside, every CPU call of the ops (native or through Python) returns zeros without computing:
    for a forward pass whose outputs are thrown away (vLLM's warm-up on dummy tokens, which exists to
    compile the graph). Always switched off again on the way out, exception or not."""
    _core.cpu_set_warm_up_pass(True)
    try:
        yield
    finally:
        _core.cpu_set_warm_up_pass(False)


_GROUP_SIZES_TEXT = ", ".join(map(str, _core.GROUP_SIZES))


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


LAYOUTS = ("rows4", "lanes16")


def prepared_shapes(out_features: int, in_features: int, group_size: int, layout: str = "rows4"):
    """Shapes of the prepared ``(qweight, scales)`` of a ``[out_features, in_features]`` weight in ``layout``."""
    return _core.cpu_prepared_shapes(int(out_features), int(in_features), int(group_size), layout)


def int8_layout() -> str:
    """The layout for weights only the int8 modes will multiply, with the kernel variant in use: ``"lanes16"``
    where the AVX-512 VNNI rows-in-lanes kernel runs on full-width units (no AMX), else ``"rows4"``;
    ``TERNARY_RS_CPU_LAYOUT`` (rows4 / lanes16 / auto) overrides."""
    _push_settings()
    return _core.cpu_int8_layout()


def layout_of(qweight: torch.Tensor, out_features: int, in_features: int, group_size: int) -> str:
    """Which layout a prepared ``qweight`` is in (by its shape; ``"rows4"`` when neither fits)."""
    shape = tuple(qweight.shape)
    for layout in LAYOUTS:
        if shape == tuple(prepared_shapes(out_features, in_features, group_size, layout)[0]):
            return layout
    return "rows4"


def _check_canonical(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[int, int]:
    """(N, K) of canonical CPU tensors, or a clear ValueError."""
    _check(qweight.dtype == torch.uint8 and qweight.dim() == 2, f"qweight must be uint8 [N, K/4], got {qweight.dtype} {tuple(qweight.shape)}")
    _check(scales.dtype == torch.float16, f"scales must be float16, got {scales.dtype}")
    n, k = qweight.shape[0], qweight.shape[1] * 4
    _check(group_size in _core.GROUP_SIZES, f"group_size {group_size} is not one of {_GROUP_SIZES_TEXT}")
    _check(k % group_size == 0, f"in_features {k} is not a multiple of group_size {group_size}")
    _check(tuple(scales.shape) == (n, k // group_size), f"scales must be [{n}, {k // group_size}], got {tuple(scales.shape)}")
    _check(qweight.device.type == "cpu" and scales.device.type == "cpu", "prepare_weight (CPU) needs CPU tensors")
    return n, k


def _prepare_into(qweight, scales, group_size, n, k, codes, prepared_scales, layout: str = "rows4") -> None:
    q = qweight.contiguous()
    s = scales.contiguous()
    _core.ternary_cpu_prepare(q.data_ptr(), s.data_ptr(), n, k, group_size, codes.data_ptr(),
                              prepared_scales.data_ptr(), "qweight", layout)


def prepare_weight(qweight: torch.Tensor, scales: torch.Tensor, group_size: int, layout: str = "rows4"):
    """Canonical ``(uint8 [N, K/4], float16 [N, K/g])`` → the kernel layout ``layout`` (see the module docs)."""
    n, k = _check_canonical(qweight, scales, group_size)
    _check(layout in LAYOUTS, f"layout must be one of {LAYOUTS}, got {layout!r}")
    q_shape, s_shape = prepared_shapes(n, k, group_size, layout)
    # The kernels stream these once per call: on 2 MiB pages (see hugepages.py), so the heap memory of the
    # canonical tensors a loader frees as it goes is no longer reused by them: hand it back first.
    hugepages.trim_heap()
    codes = hugepages.empty(q_shape, torch.uint8)
    prepared_scales = hugepages.empty(s_shape, torch.float16)
    _prepare_into(qweight, scales, group_size, n, k, codes, prepared_scales, layout)
    return codes, prepared_scales


def prepare_stacked(qweight: torch.Tensor, scales: torch.Tensor, group_size: int):
    """Canonical ``(uint8 [E, N, K/4], float16 [E, N, K/g])`` (MoE experts) → each expert's kernel layout,
    stacked along E: ``prepare_weight`` of every expert written straight into its slice of one huge-page
    tensor (no per-expert temporaries: in a shared huge-page region they would stay resident)."""
    _check(qweight.dim() == 3 and scales.dim() == 3 and qweight.shape[0] == scales.shape[0],
           f"stacked qweight / scales must be [E, N, K/4] / [E, N, K/g], got {tuple(qweight.shape)} / {tuple(scales.shape)}")
    experts = qweight.shape[0]
    _check(experts > 0, "prepare_stacked needs at least one expert")
    n, k = _check_canonical(qweight[0], scales[0], group_size)
    q_shape, s_shape = prepared_shapes(n, k, group_size)
    hugepages.trim_heap()
    codes = hugepages.empty((experts, *q_shape), torch.uint8)
    prepared_scales = hugepages.empty((experts, *s_shape), torch.float16)
    for e in range(experts):
        _prepare_into(qweight[e], scales[e], group_size, n, k, codes[e], prepared_scales[e])
    return codes, prepared_scales


def ternary_linear(x, qweight, scales, out_features, in_features, group_size, bias=None, activations=AUTO):
    """The kernel through Python (rayon pool); same contract as the native registration."""
    n, k, g = int(out_features), int(in_features), int(group_size)
    name = _DTYPE_NAMES.get(x.dtype)
    if name is None:
        raise TypeError(f"ternary_linear: x dtype {x.dtype} is not supported; use bfloat16, float16 or float32")
    _check(x.dim() >= 1 and x.shape[-1] == k, f"ternary_linear: x has shape {tuple(x.shape)}, expected [..., {k}]")
    _check(g in _core.GROUP_SIZES and k % g == 0, f"ternary_linear: in_features {k} / group_size {g} invalid")
    layout = layout_of(qweight, n, k, g)
    q_shape, s_shape = prepared_shapes(n, k, g, layout)
    _check(
        qweight.dtype == torch.uint8 and tuple(qweight.shape) == q_shape and qweight.is_contiguous(),
        f"ternary_linear: qweight must be the prepared uint8 {list(q_shape)} (ops.prepare_weight), got "
        f"{qweight.dtype} {tuple(qweight.shape)}",
    )
    _check(
        scales.dtype == torch.float16 and tuple(scales.shape) == s_shape and scales.is_contiguous(),
        f"ternary_linear: scales must be the prepared float16 {list(s_shape)}, got {scales.dtype} {tuple(scales.shape)}",
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
    if _core.cpu_warm_up_pass():
        return y.zero_().reshape(*lead, n)
    if m > 0 and n > 0:
        _core.ternary_gemm_cpu(
            x2.data_ptr(), name, m, k, qweight.data_ptr(), scales.data_ptr(), n, g, b_ptr, y.data_ptr(),
            _variant, int(activations), layout,
        )
    return y.reshape(*lead, n)


def _libtorch_cpu() -> Path:
    return Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"


def register_native(op: str = "ternary_linear") -> str | None:
    """Register the native CPU kernel of ``op`` (``"ternary_linear"``, ``"ternary_moe"``, ``"dense_linear"``,
    ``"fwht"`` or ``"decode_attention"``, whose schema must be defined) with torch's dispatcher; returns why not (None on success)."""
    _push_settings()
    path = _libtorch_cpu()
    if not path.is_file():
        return f"{path} not found"
    register = {"ternary_linear": _core.register_torch_cpu_kernel, "ternary_moe": _core.register_torch_cpu_moe_kernel,
                "dense_linear": _core.register_torch_cpu_dense_kernel,
                "fwht": _core.register_torch_cpu_fwht_kernel,
                "decode_attention": _core.register_torch_cpu_attention_kernel}[op]
    try:
        register(str(path))
    except RuntimeError as e:
        return str(e)
    return None
