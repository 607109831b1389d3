"""One Gated DeltaNet decode step on CPU in one native call (``_core.gdn_decode_cpu``; the arithmetic and
why it is one call: ``rust/ternary-core/src/gdn.rs``).

:func:`decode_` takes torch tensors as vLLM's CPU GDN layer holds them (the projected ``q, k, v`` rows, the
gate inputs, the slots, the layer's convolution and recurrent caches) and returns False, touching nothing,
where the kernel does not take the call (another dtype or device, a layout it does not read), so the
caller keeps its own path there. A caller that decodes every step (the vLLM wrapper) checks the caches
once (:func:`bind_caches`) and then only the step's tensors (:func:`decode_bound`): checking and slicing
everything on every call was ~64 µs of Python per layer call around a ~120 µs kernel (27B shape, batch 1;
bound, ~31 — docs/design.md#gated-deltanet-decode).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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

    @cached_property
    def sizes(self) -> tuple[int, int, int, int, int]:
        """The kernel's size tuple: key heads, value heads, key and value head widths, convolution width."""
        return (self.key_heads, self.value_heads, self.key_dim, self.value_dim, self.conv_width)

    @cached_property
    def pointers(self) -> tuple[int, int, int, int]:
        """The kernel's parameter pointers (convolution weight, bias or 0, ``A_log``, ``dt_bias``)."""
        return (self.conv_weight.data_ptr(), 0 if self.conv_bias is None else self.conv_bias.data_ptr(),
                self.a_log.data_ptr(), self.dt_bias.data_ptr())

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


@dataclass(frozen=True)
class GdnCaches:
    """A layer's convolution and recurrent caches, checked once and described as the kernel reads them
    (vLLM allocates them once per engine; the step's own tensors are checked on every call,
    :func:`decode_bound`)."""

    conv_cache: torch.Tensor  # kept: the pointers below are into it
    state_cache: torch.Tensor
    conv: tuple  # (ptr, extent, slots, slot stride, channel stride, step stride)
    state: tuple  # (ptr, extent, slots, slot stride)


def bind_caches(layer: GdnLayer, conv_cache: torch.Tensor, conv_channel_first: bool,
                state_cache: torch.Tensor) -> GdnCaches | None:
    """``conv_cache`` bf16 ``[slots, channels, width − 1]`` (``conv_channel_first``) or ``[slots, width − 1,
    channels]``, ``state_cache`` float32 ``[slots, value_heads, key_dim, value_dim]`` (contiguous per slot)
    as :func:`decode_bound` passes them on; None where the kernel does not read them."""
    hv, kd, vd = layer.value_heads, layer.key_dim, layer.value_dim
    if conv_cache.device.type != "cpu" or state_cache.device.type != "cpu" \
            or conv_cache.dtype != torch.bfloat16 or state_cache.dtype != torch.float32 or conv_cache.dim() != 3:
        return None
    steps = layer.conv_width - 1
    if conv_channel_first:
        if conv_cache.shape[1:] != (layer.channels, steps):
            return None
        channel_stride, step_stride = conv_cache.stride(1), conv_cache.stride(2)
    else:
        if conv_cache.shape[1:] != (steps, layer.channels):
            return None
        step_stride, channel_stride = conv_cache.stride(1), conv_cache.stride(2)
    if state_cache.dim() != 4 or state_cache.shape[1:] != (hv, kd, vd) or state_cache.stride(3) != 1 \
            or state_cache.stride(2) != vd or state_cache.stride(1) != kd * vd:
        return None
    return GdnCaches(conv_cache, state_cache,
                     (conv_cache.data_ptr(), _extent(conv_cache), conv_cache.shape[0], conv_cache.stride(0),
                      channel_stride, step_stride),
                     (state_cache.data_ptr(), _extent(state_cache), state_cache.shape[0], state_cache.stride(0)))


def decode_bound(layer: GdnLayer, caches: GdnCaches, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 slots: torch.Tensor, n: int, out: torch.Tensor) -> bool:
    """One decode step of the first ``n`` rows of ``x`` ``[≥ n, channels]`` bf16 (any row stride), ``a`` /
    ``b`` ``[≥ n, value_heads]`` bf16, ``slots`` int32 ``[≥ n]``, into the first ``n`` rows of ``out``
    ``[≥ n, value_heads, value_dim]`` bf16 (contiguous), on caches bound by :func:`bind_caches`. Updates the
    caches in place; False (nothing touched) where the kernel does not take these tensors. Called once per
    GDN layer and decode step, so it checks only what can change between steps, and slices nothing."""
    bf16 = torch.bfloat16
    hv = layer.value_heads
    if n <= 0 or x.dtype != bf16 or a.dtype != bf16 or b.dtype != bf16 or out.dtype != bf16 \
            or x.device.type != "cpu" or out.device.type != "cpu" or a.device.type != "cpu" \
            or b.device.type != "cpu" or slots.device.type != "cpu":
        return False
    if x.dim() != 2 or x.shape[0] < n or x.shape[1] != layer.channels or x.stride(1) != 1:
        return False
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] < n or b.shape[0] < n or a.shape[1] != hv \
            or b.shape[1] != hv:
        return False
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        a, b = a[:n].contiguous(), b[:n].contiguous()
    if out.dim() != 3 or out.shape[0] < n or out.shape[1] != hv or out.shape[2] != layer.value_dim \
            or not out.is_contiguous():
        return False
    if slots.dim() != 1 or slots.shape[0] < n:
        return False
    if slots.dtype != torch.int32 or (n > 1 and slots.stride(0) != 1):
        slots = slots[:n].to(torch.int32).contiguous()
    try:
        _core.gdn_decode_cpu(layer.sizes, layer.pointers, (x.data_ptr(), x.stride(0)),
                             (a.data_ptr(), b.data_ptr(), a.stride(0)), (slots.data_ptr(), n), caches.conv,
                             caches.state, out.data_ptr())
    except ValueError:
        return False
    return True


def decode_(layer: GdnLayer, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
            conv_cache: torch.Tensor, conv_channel_first: bool, state_cache: torch.Tensor,
            out: torch.Tensor) -> bool:
    """One decode step of ``n = slots.numel()`` sequences: ``x`` ``[≥ n, channels]``, ``a`` / ``b`` ``[n,
    value_heads]``, ``out`` ``[n, value_heads, value_dim]`` and the caches as :func:`bind_caches` and
    :func:`decode_bound` take them. False (nothing touched) where the kernel does not take these tensors."""
    n = slots.numel()
    if slots.dim() != 1 or a.dim() != 2 or b.dim() != 2 or out.dim() != 3 \
            or a.shape[0] != n or b.shape[0] != n or out.shape[0] != n:
        return False
    caches = bind_caches(layer, conv_cache, conv_channel_first, state_cache)
    return caches is not None and decode_bound(layer, caches, x, a, b, slots, n, out)
