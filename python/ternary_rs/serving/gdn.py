"""One Gated DeltaNet decode step on CPU in one native call (``_core.gdn_decode_cpu``; the arithmetic and
why it is one call: ``rust/ternary-core/src/gdn.rs``).

:func:`decode_` takes torch tensors as vLLM's CPU GDN layer holds them (the projected ``q, k, v`` rows, the
gate inputs, the slots, the layer's convolution and recurrent caches) and returns False, touching nothing,
where the kernel does not take the call (another dtype or device, a layout it does not read), so the
caller keeps its own path there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _core


@dataclass(frozen=True)
class GdnLayer:
    """A layer's sizes and its constant parameters as the kernel reads them (f32, contiguous)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_weight: torch.Tensor  # [channels, width]
    conv_bias: torch.Tensor | None  # [channels]
    a_log: torch.Tensor  # [value_heads]
    dt_bias: torch.Tensor  # [value_heads]

    @property
    def conv_width(self) -> int:
        return self.conv_weight.shape[1]

    @property
    def channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @staticmethod
    def build(key_heads: int, value_heads: int, key_dim: int, value_dim: int, conv_weight: torch.Tensor,
              conv_bias: torch.Tensor | None, a_log: torch.Tensor, dt_bias: torch.Tensor) -> GdnLayer | None:
        """The layer, its parameters widened to f32; None where the sizes are not a layer the kernel runs."""
        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device="cpu", dtype=torch.float32).contiguous()

        weight = conv_weight.reshape(conv_weight.shape[0], -1) if conv_weight.dim() == 3 else conv_weight
        layer = GdnLayer(key_heads, value_heads, key_dim, value_dim, f32(weight),
                         None if conv_bias is None else f32(conv_bias).reshape(-1), f32(a_log).reshape(-1),
                         f32(dt_bias).reshape(-1))
        if weight.dim() != 2 or weight.shape[0] != layer.channels or layer.a_log.numel() != value_heads \
                or layer.dt_bias.numel() != value_heads \
                or (layer.conv_bias is not None and layer.conv_bias.numel() != layer.channels):
            return None
        return layer


def _extent(t: torch.Tensor) -> int:
    """Elements from ``t.data_ptr()`` to the last one its view reaches, plus one."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0


def decode_(layer: GdnLayer, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
            conv_cache: torch.Tensor, conv_channel_first: bool, state_cache: torch.Tensor,
            out: torch.Tensor) -> bool:
    """One decode step of ``n = slots.numel()`` sequences: ``x`` ``[n, channels]`` bf16 rows (any row
    stride), ``a`` / ``b`` ``[n, value_heads]`` bf16, ``slots`` int32; ``conv_cache`` bf16 ``[slots, channels,
    width − 1]`` (``conv_channel_first``) or ``[slots, width − 1, channels]``; ``state_cache`` float32
    ``[slots, value_heads, key_dim, value_dim]`` (contiguous per slot); ``out`` ``[n, value_heads, value_dim]``
    bf16, contiguous. Updates the caches in place and writes ``out``; False (nothing touched) where the
    kernel does not take these tensors."""
    n = slots.numel()
    tensors = (x, a, b, slots, conv_cache, state_cache, out)
    if any(t.device.type != "cpu" for t in tensors) or n == 0 or slots.dim() != 1:
        return False
    if x.dtype != torch.bfloat16 or a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 \
            or conv_cache.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 \
            or state_cache.dtype != torch.float32:
        return False
    hv, kd, vd = layer.value_heads, layer.key_dim, layer.value_dim
    if x.dim() != 2 or x.shape[0] < n or x.shape[1] != layer.channels or x.stride(1) != 1:
        return False
    if a.shape != (n, hv) or b.shape != (n, hv) or a.stride(1) != 1 or b.stride(1) != 1 \
            or a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
        if a.shape != (n, hv) or b.shape != (n, hv):
            return False
    if out.shape != (n, hv, vd) or not out.is_contiguous():
        return False
    steps = layer.conv_width - 1
    if conv_cache.dim() != 3:
        return False
    if conv_channel_first:
        if conv_cache.shape[1:] != (layer.channels, steps):
            return False
        channel_stride, step_stride = conv_cache.stride(1), conv_cache.stride(2)
    else:
        if conv_cache.shape[1:] != (steps, layer.channels):
            return False
        step_stride, channel_stride = conv_cache.stride(1), conv_cache.stride(2)
    if state_cache.dim() != 4 or state_cache.shape[1:] != (hv, kd, vd) or state_cache.stride(3) != 1 \
            or state_cache.stride(2) != vd or state_cache.stride(1) != kd * vd:
        return False
    slots = slots.to(torch.int32).contiguous()
    layer_ptrs = (layer.conv_weight.data_ptr(), 0 if layer.conv_bias is None else layer.conv_bias.data_ptr(),
                  layer.a_log.data_ptr(), layer.dt_bias.data_ptr())
    try:
        _core.gdn_decode_cpu(
            (layer.key_heads, hv, kd, vd, layer.conv_width), layer_ptrs, (x.data_ptr(), x.stride(0)),
            (a.data_ptr(), b.data_ptr(), a.stride(0)), (slots.data_ptr(), n),
            (conv_cache.data_ptr(), _extent(conv_cache), conv_cache.shape[0], conv_cache.stride(0),
             channel_stride, step_stride),
            (state_cache.data_ptr(), _extent(state_cache), state_cache.shape[0], state_cache.stride(0)),
            out.data_ptr())
    except ValueError:
        return False
    return True
