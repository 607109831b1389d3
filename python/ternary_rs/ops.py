"""Torch custom ops of ternary_rs.

Contract (stable; the vLLM backend codes against it):

* ``prepare_weight(qweight, scales, group_size) -> (qweight_k, scales_k)`` — called once per layer from
  ``process_weights_after_loading``. Takes the canonical tensors (``uint8 [N, K/4]``, ``float16 [N, K/g]``)
  on the target device and returns them in the layout of that device's kernel (opaque to callers).
* ``torch.ops.ternary_rs.ternary_linear(x, qweight_k, scales_k, out_features, in_features, group_size, bias)``
  — ``y[..., N] = x[..., K] @ W.T (+ bias)`` for bf16/fp16/fp32 ``x``; output dtype = ``x.dtype``.
  CPU and CUDA implementations plus a fake (meta) implementation for ``torch.compile``.

PLACEHOLDER: the implementations below are a plain dequantize + matmul reference; the CPU kernel work and
the CUDA kernel work replace them.
"""

from __future__ import annotations

import torch

LIB = "ternary_rs"


def _dequantize_canonical(qweight: torch.Tensor, scales: torch.Tensor, n: int, k: int, g: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, 2, device=qweight.device, dtype=torch.uint8)
    codes = (qweight.unsqueeze(-1) >> shifts) & 3
    trits = codes.reshape(n, k).to(torch.float32) - 1.0
    return trits * scales.to(torch.float32).repeat_interleave(g, dim=1)


def prepare_weight(qweight: torch.Tensor, scales: torch.Tensor, group_size: int):
    return qweight.contiguous(), scales.contiguous()


@torch.library.custom_op(f"{LIB}::ternary_linear", mutates_args=())
def ternary_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    out_features: int,
    in_features: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    w = _dequantize_canonical(qweight, scales, out_features, in_features, group_size)
    y = x.to(torch.float32) @ w.T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


@ternary_linear.register_fake
def _(x, qweight, scales, out_features, in_features, group_size, bias=None):
    return x.new_empty((*x.shape[:-1], out_features))
