"""CPU implementation of ``ternary_rs::ternary_linear``.

PLACEHOLDER (dequantize + matmul) until the Rust CPU kernel lands; canonical layout.
"""

from __future__ import annotations

import torch


def _dequantize_canonical(qweight, scales, n, k, g):
    shifts = torch.arange(0, 8, 2, device=qweight.device, dtype=torch.uint8)
    codes = (qweight.unsqueeze(-1) >> shifts) & 3
    trits = codes.reshape(n, k).to(torch.float32) - 1.0
    return trits * scales.to(torch.float32).repeat_interleave(g, dim=1)


def prepare_weight(qweight, scales, group_size):
    return qweight.contiguous(), scales.contiguous()


def ternary_linear(x, qweight, scales, out_features, in_features, group_size, bias=None):
    w = _dequantize_canonical(qweight, scales, out_features, in_features, group_size)
    y = x.to(torch.float32) @ w.T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
