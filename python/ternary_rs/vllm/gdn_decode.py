"""The Gated DeltaNet decode step in one native call, in place of vLLM CPU's (docs/design.md#gated-deltanet-decode).

vLLM CPU decodes a GDN layer's sequences through ~15 torch operations issued from Python (a staged copy of
the convolution windows, the convolution, splitting and copying ``q, k, v``, the gated delta rule, copying
its output) around two C++ kernels. Measured on two Zen 5 cores at Bonsai 2's widths (10 240 convolution
channels, 16 key / 48 value heads of 128), batch 1: ~276 µs per layer, of which the two kernels take ~180
(the delta rule reads and writes the slot's 3 MB of f32 state) — ~130 µs per layer and 48 layers per token
of Python and copies. :func:`fast_nonspec` runs the decode sequences through
:func:`ternary_rs.serving.gdn.decode_bound` (one call, the state read and written once) and leaves everything
else — prefill sequences of a mixed batch, speculative decoding, layouts or dtypes the kernel does not
read — to vLLM's own function. ``TERNARY_RS_CPU_GDN=vllm`` keeps vLLM's for every step. A layer's caches
are checked once and kept bound on the layer (:func:`layer_caches`); each step checks only its own tensors.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from ..serving.cpu import ours_unless_vllm
from ..serving.gdn import GdnCaches, GdnLayer, bind_caches, decode_bound
from .gdn_prefill import GDN_ATTENTION_MODULE

GDN_ENV = "TERNARY_RS_CPU_GDN"
# Cached on each GDN layer: its GdnLayer, or False where the kernel cannot run it.
_LAYER_ATTR = "_ternary_rs_gdn"
# Cached on each GDN layer: its caches as bound (GdnCaches, or None where the kernel does not read them),
# and the two cache tensors they were bound from.
_CACHES_ATTR = "_ternary_rs_gdn_caches"


def enabled() -> bool:
    """Whether the plugin replaces vLLM's CPU GDN decode (``TERNARY_RS_CPU_GDN``: ``auto``, the default, or
    ``vllm``)."""
    return ours_unless_vllm(GDN_ENV)


def _unpacked_conv_weight(conv1d) -> torch.Tensor | None:
    """The convolution's ``[channels, width]`` weight: vLLM CPU packs it for its own kernel where the CPU has
    native bf16 and keeps the plain one beside it."""
    plain = getattr(conv1d, "_cpu_unpacked_conv_weight", None)
    if plain is not None:
        return plain
    weight = conv1d.weight
    return weight if weight.dim() == 3 and weight.shape[1] == 1 else None


def layer_params(layer) -> GdnLayer | None:
    """``layer``'s :class:`GdnLayer` (built once and kept on the layer), or None where the kernel does not
    run it: another activation than SiLU, a convolution weight it cannot read."""
    cached = layer.__dict__.get(_LAYER_ATTR)
    if cached is not None:
        return cached or None
    built = None
    try:
        tp = layer.tp_size
        weight = _unpacked_conv_weight(layer.conv1d)
        if layer.activation == "silu" and weight is not None:
            built = GdnLayer.build(layer.num_k_heads // tp, layer.num_v_heads // tp, layer.head_k_dim,
                                   layer.head_v_dim, weight, layer.conv1d.bias, layer.A_log, layer.dt_bias)
    except AttributeError:  # not the GDN layer this was written against
        built = None
    layer.__dict__[_LAYER_ATTR] = built if built is not None else False
    return built


def _prefill_part(meta, num_decodes: int):
    """``meta`` for its prefill sequences alone, as if the batch had no decodes (vLLM puts decodes first,
    one token each)."""
    qsl = meta.non_spec_query_start_loc
    return dataclasses.replace(
        meta, num_decodes=0, num_decode_tokens=0,
        non_spec_state_indices_tensor=meta.non_spec_state_indices_tensor[num_decodes:],
        non_spec_query_start_loc=qsl[num_decodes:] - num_decodes,
        has_initial_state=None if meta.has_initial_state is None else meta.has_initial_state[num_decodes:])


def layer_caches(layer, params: GdnLayer) -> GdnCaches | None:
    """``layer``'s KV caches bound for the kernel (:func:`ternary_rs.serving.gdn.bind_caches`), kept on the
    layer while ``layer.kv_cache`` holds the same two tensors (vLLM binds them once per engine); None
    where the kernel does not read them."""
    conv_cache, state_cache = layer.kv_cache[0], layer.kv_cache[1]
    cached = layer.__dict__.get(_CACHES_ATTR)
    if cached is not None and cached[1] is conv_cache and cached[2] is state_cache:
        return cached[0]
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    bound = None
    state = state_cache
    if state.dim() == 4:  # vLLM's CPU kernels read a slot's [V, K] state as [K, V]
        try:
            state = state.view(state.shape[0], state.shape[1], state.shape[3], state.shape[2])
        except RuntimeError:  # not contiguous per slot: not a layout the kernel reads
            state = None
    if state is not None:
        bound = bind_caches(params, conv_cache, is_conv_state_dim_first(), state)
    layer.__dict__[_CACHES_ATTR] = (bound, conv_cache, state_cache)
    return bound


def fast_nonspec(original):
    """vLLM's ``_cpu_gdn_attention_nonspec(layer, metadata, mixed_qkv, b, a, core_attn_out)`` with the decode
    sequences taken by the native step."""

    def _cpu_gdn_attention_nonspec(layer, meta, mixed_qkv, b, a, core_attn_out):
        nd = meta.num_decodes
        params = layer_params(layer) if nd and meta.num_decode_tokens == nd else None
        caches = layer_caches(layer, params) if params is not None else None
        if caches is None or (meta.num_prefills and not dataclasses.is_dataclass(meta)):
            return original(layer, meta, mixed_qkv, b, a, core_attn_out)
        # vLLM puts the decodes first, one token each: rows and slots 0 .. nd
        if not decode_bound(params, caches, mixed_qkv, a, b, meta.non_spec_state_indices_tensor, nd,
                            core_attn_out):
            return original(layer, meta, mixed_qkv, b, a, core_attn_out)
        if meta.num_prefills:
            original(layer, _prefill_part(meta, nd), mixed_qkv[nd:], b[nd:], a[nd:], core_attn_out[nd:])
        return None

    _cpu_gdn_attention_nonspec._ternary_rs = True  # type: ignore[attr-defined]
    _cpu_gdn_attention_nonspec.__wrapped__ = original  # type: ignore[attr-defined]
    return _cpu_gdn_attention_nonspec


def install_cpu_gdn_decode() -> bool:
    """Put :func:`fast_nonspec` in vLLM's CPU GDN attention module (idempotent; that module's name only);
    whether it is in place. A no-op until vLLM CPU has imported the module (its GDN layers import it when
    they are built, before their projections ask ``TernaryConfig.get_quant_method``, which calls this) and
    where ``TERNARY_RS_CPU_GDN=vllm``."""
    module = sys.modules.get(GDN_ATTENTION_MODULE)
    original = getattr(module, "_cpu_gdn_attention_nonspec", None)
    if original is None or not enabled():
        return False
    if not getattr(original, "_ternary_rs", False):
        module._cpu_gdn_attention_nonspec = fast_nonspec(original)
    return True
