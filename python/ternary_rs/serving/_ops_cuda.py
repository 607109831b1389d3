"""CUDA implementation of ``ternary_rs::ternary_linear`` (kernels in ``cuda/``, launched through ``_core``).

* The op's CUDA kernel is registered **natively** with torch's dispatcher (:func:`register_native`:
  ``rust/bindings/src/torch/cuda_op.rs``, PyTorch's stable C ABI resolved from the loaded
  ``libtorch_cpu.so`` / ``libtorch_cuda.so``), so a call runs no Python. It follows :func:`ternary_linear`
  below step for step — the same kernels, dtypes, workspaces and int8 numerics (its quantizers are
  ``cuda/activation_quant.cu``, the CPU kernel's quantization bit for bit) — and that Python path stays as
  the fallback (a torch without the ABI, ``TERNARY_RS_CUDA_NATIVE=0``) and as the GPU tests' reference.

* :func:`prepare_weight` permutes the canonical tensors once (in Rust, on the CPU) into the kernels' layout
  (``rust/ternary-core/src/kernels/gpu_layout.rs``): ``qweight_k`` is ``uint8 [ceil(N/32), ceil(K/64)·512]``
  and ``scales_k`` is ``float16 [ceil(k_pad/g), n_pad]``, both on the weight's device. It needs no GPU.
* :func:`ternary_linear` launches the fused kernel on ``torch.cuda.current_stream()``: the decode GEMV for
  up to 8 rows of ``x``, the tensor-core GEMM above. ``x`` may be bf16 or fp16 (computed natively) or fp32
  (converted to bf16 first, the result converted back); ``bias`` is cast to the compute dtype. Everything
  is allocated here by torch (output, split-K partials), nothing synchronises the host, so calls can be
  captured in CUDA graphs. The split-K tile counters are a small zeroed buffer kept per (device, stream)
  that the kernels leave zeroed again.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .. import _core

CHUNK_N = 32
CHUNK_K = 64
CHUNK_BYTES = 512
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_GROUP_SIZES = _core.GROUP_SIZES

_sm_counts: dict[int, int] = {}
# (m, n, k, g, sm_count) -> (splits, partial_floats, counters); cleared when the GEMV cut-off changes.
_plans: dict[tuple[int, int, int, int, int], tuple[int, int, int]] = {}
# (device index, stream handle) -> (zeroed int32 counters, zeroed outside any capture); retired buffers stay
# alive because CUDA graphs captured earlier may still point at them.
_counters: dict[tuple[int, int], tuple[torch.Tensor, bool]] = {}
_retired: list[torch.Tensor] = []
# From this M on, dequantize W to x.dtype and call cuBLAS instead of the fused GEMM (0 = never, the
# default: enable only where benches/bench_gpu.py measured it faster).
_dequant_min_m = 0


def _ceil_to(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def gpu_shapes(out_features: int, in_features: int, group_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of ``(qweight_k, scales_k)`` for a ``[out_features, in_features]`` weight."""
    n_pad = _ceil_to(out_features, CHUNK_N)
    k_pad = _ceil_to(in_features, CHUNK_K)
    return (n_pad // CHUNK_N, k_pad // CHUNK_K * CHUNK_BYTES), ((k_pad + group_size - 1) // group_size, n_pad)


def _require_kernels() -> None:
    if not _core.cuda_available():
        raise RuntimeError(
            "ternary_rs was built without its CUDA kernels, so CUDA tensors cannot use ternary_linear; "
            "install a CUDA build (`maturin build --release --features cuda`, needs a CUDA toolkit)"
        )


def prepare_weight(qweight: torch.Tensor, scales: torch.Tensor, group_size: int):
    """Permute canonical ``qweight`` (``uint8 [N, K/4]``) and ``scales`` (``float16 [N, K/g]``) into the CUDA
    kernels' layout, returned on ``qweight.device``. The permutation runs in Rust on the CPU."""
    g = int(group_size)
    if g not in _GROUP_SIZES:
        raise ValueError(f"group_size {g} is not one of {_GROUP_SIZES}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise TypeError(f"qweight must be a 2-D uint8 tensor [N, K/4], got {qweight.dtype} {tuple(qweight.shape)}")
    if scales.dtype != torch.float16 or scales.dim() != 2:
        raise TypeError(f"scales must be a 2-D float16 tensor [N, K/g], got {scales.dtype} {tuple(scales.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * 4
    if k % g != 0 or tuple(scales.shape) != (n, k // g):
        raise ValueError(
            f"scales {tuple(scales.shape)} do not match qweight {tuple(qweight.shape)} (K = {k}) with group size {g}"
        )
    q_np = qweight.detach().to("cpu").contiguous().numpy()
    s_np = scales.detach().to("cpu").contiguous().view(torch.int16).numpy().view(np.uint16)
    q_k, s_k = _core.gpu_layout(q_np, s_np, g)
    q_t = torch.from_numpy(q_k).to(qweight.device)
    s_t = torch.from_numpy(s_k.view(np.int16)).view(torch.float16).to(qweight.device)
    return q_t, s_t


def set_gemv_max_m(m: int) -> int:
    """Largest M that runs the decode GEMV (0..16, default 8; above it the tensor-core GEMM runs).
    Process-wide, for tuning; returns the previous value."""
    _require_kernels()
    prev = _core.cuda_set_gemv_max_m(int(m))
    _plans.clear()
    return prev


def set_dequant_min_m(m: int) -> int:
    """From this M on, ``ternary_linear`` dequantizes W into a temporary ``x.dtype`` tensor and runs
    ``torch.nn.functional.linear`` (cuBLAS); 0 (the default) always uses the fused kernels. Returns the
    previous value."""
    global _dequant_min_m
    if int(m) < 0:
        raise ValueError("dequant_min_m must be >= 0")
    prev, _dequant_min_m = _dequant_min_m, int(m)
    _core.cuda_set_dequant_min_m(_dequant_min_m)  # the native kernel's copy
    return prev


def register_native() -> str | None:
    """Register the native CUDA kernel with torch's dispatcher; returns why not (None on success)."""
    if os.environ.get("TERNARY_RS_CUDA_NATIVE", "").strip() == "0":
        return "TERNARY_RS_CUDA_NATIVE=0"
    if not _core.cuda_available():
        return "this ternary_rs build has no CUDA kernels"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    lib = Path(torch.__file__).parent / "lib"
    cuda_lib = lib / "libtorch_cuda.so"
    if not cuda_lib.is_file():
        return f"{cuda_lib} not found"
    try:
        _core.register_torch_cuda_kernel(str(lib / "libtorch_cpu.so"), str(cuda_lib))
    except RuntimeError as e:
        return str(e)
    return None


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int, group_size: int,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W[N, K] = trit · scale in ``dtype`` (bf16/fp16), from the prepared CUDA layout, on its device."""
    _require_kernels()
    n, k, g = int(out_features), int(in_features), int(group_size)
    if dtype not in _DTYPE_NAMES:
        raise TypeError(f"dtype {dtype} is not supported; supported: bfloat16, float16")
    if g not in _GROUP_SIZES or k % g != 0:
        raise ValueError(f"in_features {k} and group_size {g}: g must be one of {_GROUP_SIZES} and divide K")
    _check_weight(qweight, scales, qweight, n, k, g)
    w = torch.empty((n, k), dtype=dtype, device=qweight.device)
    with torch.cuda.device(qweight.device):
        stream = torch.cuda.current_stream(qweight.device).cuda_stream
        _core.cuda_dequantize(qweight.data_ptr(), scales.data_ptr(), w.data_ptr(), n, k, g, _DTYPE_NAMES[dtype], stream)
    return w


def _plan(m: int, n: int, k: int, g: int, sm: int) -> tuple[int, int, int]:
    key = (m, n, k, g, sm)
    plan = _plans.get(key)
    if plan is None:
        p = _core.cuda_plan(m, n, k, g, sm)
        plan = _plans[key] = (p["splits"], p["partial_floats"], p["counters"])
    return plan


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_counts:
        _sm_counts[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_counts[idx]


def _counter_buffer(device: torch.device, stream: int, needed: int) -> torch.Tensor:
    """The zeroed split-K counters of (device, stream). One made during a graph capture is zeroed only by
    that graph's memset node, so until a call outside any capture zeroes it, every call zeroes it again
    (eagerly: now; in another capture: a memset node of that graph too) — as the native kernel does."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    entry = _counters.get(key)
    if entry is None or entry[0].numel() < needed:
        if entry is not None:
            _retired.append(entry[0])
        # Split-K is only used while tiles < 8 blocks per SM, so this size is rarely exceeded.
        size = max(needed, 8 * _sm_count(device) + 64)
        entry = _counters[key] = (torch.zeros(size, dtype=torch.int32, device=device), not capturing)
    elif not entry[1]:
        entry[0].zero_()
        entry = _counters[key] = (entry[0], not capturing)
    return entry[0]


def _check_weight(qweight, scales, x, n, k, g) -> None:
    q_shape, s_shape = gpu_shapes(n, k, g)
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != q_shape:
        raise ValueError(
            f"qweight must be the prepared CUDA layout uint8 {q_shape} for [{n}, {k}] g{g}, got "
            f"{qweight.dtype} {tuple(qweight.shape)} (call ternary_rs.ops.prepare_weight first)"
        )
    if scales.dtype != torch.float16 or tuple(scales.shape) != s_shape:
        raise ValueError(f"scales must be float16 {s_shape} (prepared layout), got {scales.dtype} {tuple(scales.shape)}")
    for name, t in (("qweight", qweight), ("scales", scales)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


# The int8-per-token codes go to the fp16 kernels as q · 2⁻⁷ (exact: |q| <= 128 has <= 8 significant bits),
# so the fp16 output (≈ y / max|x|) cannot overflow where q itself (up to 127 · Σ|W|) could.
INT8_CODE_SCALE = 2.0 ** -7

# Values of the op's ``activations`` argument (see ternary_rs.ops).
_AUTO, _EXACT, _INT8_GROUP, _INT8_TOKEN = (
    _core.ACTIVATIONS_AUTO, _core.ACTIVATIONS_EXACT, _core.ACTIVATIONS_INT8_GROUP, _core.ACTIVATIONS_INT8_TOKEN,
)


def _int8_activations(x: torch.Tensor, g: int, per_token: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The int8 numerics of the CPU kernel (``_ops_cpu``), in torch: per token → ``(q, xs)`` with integer-
    valued ``q`` (exact in fp16) and ``y = (q·W)·xs``; per group → the dequantized ``q·xs`` in f32 (its
    scale varies along K, so it cannot be factored out of the product) and ``None``."""
    xf = x.float()
    # ``127 / amax`` as one correctly rounded division, as the CPU kernel computes it: torch's ``127.0 / t``
    # is ``t.reciprocal() * 127`` (two roundings), an ulp off for some amax.
    int8_max = xf.new_full((), 127.0)
    if per_token:
        scale = int8_max / xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
        q = (xf * scale).round().clamp(-128, 127)  # torch.round is half to even
        return q.to(torch.float16), 1.0 / scale
    xg = xf.reshape(*xf.shape[:-1], -1, g)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    mul = int8_max / amax
    # All-zero groups and max|x| < 127 / f32 max (the multiplier overflows) quantize to zeros, as in the
    # CPU kernel's domain_scale; a NaN max stays NaN (and makes the group NaN).
    zero_group = torch.isinf(mul)
    q = (xg * torch.where(zero_group, 0.0, mul)).round().clamp(-127, 127)
    return (q * torch.where(zero_group, 0.0, amax / 127.0)).reshape(xf.shape), None


def ternary_linear(x, qweight, scales, out_features, in_features, group_size, bias=None, activations=_AUTO):
    """``y[..., N] = x[..., K] @ W.T (+ bias)`` on CUDA; output dtype = ``x.dtype``.

    ``activations`` 0/1 run the kernels on x as it is; 3 (int8 per token, BitNet) feeds the integer codes
    (times ``INT8_CODE_SCALE``, exact in fp16) and applies the token scale to the f32-accumulated product;
    2 (int8 per group) feeds the dequantized activations."""
    _require_kernels()
    n, k, g = int(out_features), int(in_features), int(group_size)
    if activations in (_INT8_TOKEN, _INT8_GROUP):
        if x.shape[-1] != k:
            raise ValueError(f"x has {x.shape[-1]} features, the layer expects {k}")
        xq, xs = _int8_activations(x, g, activations == _INT8_TOKEN)
        if xs is None:
            return ternary_linear(xq, qweight, scales, n, k, g, bias, _EXACT).to(x.dtype)
        y = ternary_linear(xq * INT8_CODE_SCALE, qweight, scales, n, k, g, None, _EXACT).float()
        y = y * (xs / INT8_CODE_SCALE)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
    if activations not in (_AUTO, _EXACT):
        raise ValueError(f"activations={activations}: expected 0, 1, 2 or 3")
    if g not in _GROUP_SIZES:
        raise ValueError(f"group_size {g} is not one of {_GROUP_SIZES}")
    if k % g != 0:
        raise ValueError(f"in_features {k} is not a multiple of group_size {g}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the layer expects {k}")
    _check_weight(qweight, scales, x, n, k, g)
    out_dtype = x.dtype
    if x.dtype == torch.float32:
        x = x.to(torch.bfloat16)
    elif x.dtype not in _DTYPE_NAMES:
        raise TypeError(f"x dtype {x.dtype} is not supported on CUDA; supported: bfloat16, float16, float32")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous() or x2.data_ptr() % 16 != 0:
        x2 = x2.contiguous() if not x2.is_contiguous() else x2.clone()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return y.reshape(*lead, n).to(out_dtype)
    b = None
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        b = bias.to(device=x2.device, dtype=x2.dtype).contiguous()

    if _dequant_min_m and m >= _dequant_min_m:
        w = dequantize(qweight, scales, n, k, g, x2.dtype)
        return torch.nn.functional.linear(x2, w, b).reshape(*lead, n).to(out_dtype)
    device = x2.device
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # the launcher enqueues on the current device
            _launch(x2, qweight, scales, b, y, m, n, k, g)
    else:
        _launch(x2, qweight, scales, b, y, m, n, k, g)
    return y.reshape(*lead, n).to(out_dtype)


def _launch(x2, qweight, scales, b, y, m: int, n: int, k: int, g: int) -> None:
    device = x2.device
    stream = torch.cuda.current_stream(device).cuda_stream
    sm = _sm_count(device)
    splits, partial_floats, n_counters = _plan(m, n, k, g, sm)
    partials = counters = None
    if splits > 1:
        # Per call from torch's caching allocator (stream-ordered, graph-safe); the counters persist.
        partials = torch.empty(partial_floats, dtype=torch.float32, device=device)
        counters = _counter_buffer(device, stream, n_counters)
    _core.cuda_ternary_linear(
        x2.data_ptr(),
        qweight.data_ptr(),
        scales.data_ptr(),
        b.data_ptr() if b is not None else 0,
        y.data_ptr(),
        partials.data_ptr() if partials is not None else 0,
        partials.numel() if partials is not None else 0,
        counters.data_ptr() if counters is not None else 0,
        counters.numel() if counters is not None else 0,
        m,
        n,
        k,
        g,
        _DTYPE_NAMES[x2.dtype],
        sm,
        stream,
    )
