"""Torch custom ops of ternary_rs — the one place the op is defined.

Contract (stable; the vLLM backend codes against it):

* ``prepare_weight(qweight, scales, group_size) -> (qweight_k, scales_k)`` — called once per layer from
  ``process_weights_after_loading``. Takes the canonical tensors (``uint8 [N, K/4]``, ``float16 [N, K/g]``)
  on the target device and returns them in the layout of that device's kernel (opaque to callers).
* ``torch.ops.ternary_rs.ternary_linear(x, qweight_k, scales_k, out_features, in_features, group_size, bias)``
  — ``y[..., N] = x[..., K] @ W.T (+ bias)`` for bf16/fp16/fp32 ``x``; output dtype = ``x.dtype``.
  Device implementations live in ``_ops_cpu.py`` (Rust SIMD kernel) and ``_ops_cuda.py`` (cuda/ kernels);
  the fake implementation here makes the op traceable by ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch

LIB = "ternary_rs"


def prepare_weight(qweight: torch.Tensor, scales: torch.Tensor, group_size: int):
    """Permute canonical tensors once into the layout of the kernel for their device."""
    if qweight.device.type == "cuda":
        from . import _ops_cuda

        return _ops_cuda.prepare_weight(qweight, scales, group_size)
    from . import _ops_cpu

    return _ops_cpu.prepare_weight(qweight, scales, group_size)


@torch.library.custom_op(f"{LIB}::ternary_linear", mutates_args=(), device_types=("cpu", "cuda"))
def ternary_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    out_features: int,
    in_features: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    if x.device.type == "cuda":
        from . import _ops_cuda

        return _ops_cuda.ternary_linear(x, qweight, scales, out_features, in_features, group_size, bias)
    from . import _ops_cpu

    return _ops_cpu.ternary_linear(x, qweight, scales, out_features, in_features, group_size, bias)


@ternary_linear.register_fake
def _(x, qweight, scales, out_features, in_features, group_size, bias=None):
    return x.new_empty((*x.shape[:-1], out_features))
