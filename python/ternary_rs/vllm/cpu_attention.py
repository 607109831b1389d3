"""vLLM's CPU attention with the KV cache update inside the attention op: one Python op per layer and step.

vLLM 0.32's CPU backend (``CPU_ATTN``) declares ``forward_includes_kv_cache_update = False``, so every
attention layer puts two custom ops into the compiled graph: ``vllm::unified_kv_cache_update`` and
``vllm::unified_attention_with_output``. Both are Python functions that the graph (even inductor's C++
wrapper) calls back into through the dispatcher, each looking the layer up in the forward context and
re-deriving the cache views before it reaches its C++ kernel. On a small CPU that round trip, not the
kernels, is the cost: Bonsai-1.7B shape, batch 1, 2 AVX2 cores, the two ops took ~14 % of the decode step
(py-spy) of which the kernels were ~5 %.

:class:`FusedUpdateCPUAttentionBackend` is the same backend — the same metadata builder, cache layout and
C++ kernels (``_C::cpu_attn_reshape_and_cache``, ``_C::cpu_attention_with_kv_cache``) with the same
arguments — that declares the update part of its forward, as vLLM's own cross-attention wrapper and
several GPU backends do. The graph then holds one op per layer; the cache views are made once per cache
tensor instead of twice per step. Anything the plain decoder path does not cover (encoder attention,
sinks, zentorch, output quantization, keys the metadata's slot mapping does not cover) goes through vLLM's
own update and forward. The plugin selects it for ternary models on CPU (``plugin.attention_backend_path``).

Decode steps (one new token per sequence, vLLM's ``vec`` / ``vec16`` cache layout, no ALiBi, no fp8 cache)
run ``ternary_rs::decode_attention`` instead of vLLM's kernel (``ternary_core::attention``; the numbers in
docs/design.md#decode-attention): a decode step reads the whole KV cache once, and at serving context lengths
that is more bytes than the model's weights, so the kernel that streams it at the memory's speed sets the
step time. Its results agree with vLLM's to f32 rounding (the same softmax in f32, other summation orders);
``TERNARY_RS_CPU_ATTENTION=vllm`` keeps vLLM's kernel for every step. Prefill and mixed steps always run
vLLM's.
"""

from __future__ import annotations

import os

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

# vLLM's CPU kernels (its `_C` extension, loaded by the import above), resolved once: an OpOverload call
# skips vLLM's Python wrappers in `_custom_ops` and torch's overload lookup
_RESHAPE_AND_CACHE = torch.ops._C.cpu_attn_reshape_and_cache.default
_ATTENTION = torch.ops._C.cpu_attention_with_kv_cache.default
# vLLM's kernels whose cache layout ternary_rs's decode kernel reads (keys column-major per block, values
# row-major); its "amx" layout packs blocks for AMX tiles
_DECODE_LAYOUTS = ("vec", "vec16")


def _decode_op():
    """``ternary_rs::decode_attention``, where it is native and not switched off; else None."""
    if os.environ.get("TERNARY_RS_CPU_ATTENTION", "").strip().lower() == "vllm":
        return None
    from ternary_rs.serving import ops

    return None if ops.NATIVE_ATTENTION_UNAVAILABLE is not None else torch.ops.ternary_rs.decode_attention.default


class FusedUpdateCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention impl whose forward writes this step's keys and values into the cache first."""

    # (cache tensor, key view, value view) of the last cache this layer saw. The views share its storage:
    # they live as long as the layer keeps that cache, and are replaced when vLLM binds another one.
    _cache_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # ternary_rs's decode kernel where this layer's settings allow it (decided at the first forward)
    _decode = None
    _decode_decided = False

    def _decode_kernel(self, layer):
        if not self._decode_decided:
            self._decode_decided = True
            if (self.alibi_slopes is None and not self.is_fp8_kv_cache and self.head_size % 16 == 0
                    and getattr(layer, "isa", None) in _DECODE_LAYOUTS):
                self._decode = _decode_op()
        return self._decode

    def _views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        views = self._cache_views
        if views is None or views[0] is not kv_cache:
            # [blocks, kv heads, block size, 2 · head size] as [blocks, kv heads, 2 · block size, head size],
            # keys then values along dim 2 — exactly vLLM's forward and do_kv_cache_update
            blocks, kv_heads, block_size, _ = kv_cache.size()
            key_cache, value_cache = kv_cache.view((blocks, kv_heads, block_size * 2, -1)).chunk(2, dim=2)
            views = self._cache_views = (kv_cache, key_cache, value_cache)
        return views[1], views[2]

    def _writes_cache(self, key, value) -> bool:
        # what vLLM's Attention.forward checks before it emits the separate update op
        return self.kv_sharing_target_layer_name is None and key is not None and value is not None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # warm-up and memory profiling: no metadata, nothing to attend to
            return output
        slot_mapping = attn_metadata.slot_mapping
        if (self.attn_type != AttentionType.DECODER or self.sinks is not None or self.use_zentorch_sdpa
                or output_scale is not None or output_block_scale is not None
                or (key is not None and slot_mapping.shape[0] != key.shape[0])):
            # not the plain decoder path: vLLM's update (a no-op for encoder attention) and vLLM's forward
            if self._writes_cache(key, value):
                self.do_kv_cache_update(layer, key, value, kv_cache, self._step_slot_mapping(layer, slot_mapping, key))
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        key_cache, value_cache = self._views(kv_cache)
        if self._writes_cache(key, value):
            _RESHAPE_AND_CACHE(key, value, key_cache, value_cache, slot_mapping, layer.isa,
                               layer._k_scale_float, layer._v_scale_float, self.kv_cache_dtype)
        n = attn_metadata.num_actual_tokens
        q, out = (query, output) if n == query.shape[0] else (query[:n], output[:n])
        decode = self._decode_kernel(layer)
        seq_lens = attn_metadata.seq_lens
        if (decode is not None and attn_metadata.max_query_len == 1 and attn_metadata.dynamic_causal is None
                and seq_lens.shape[0] == n and seq_lens.dtype == torch.int32
                and attn_metadata.block_table.dtype == torch.int32):
            decode(out, q, kv_cache, seq_lens, attn_metadata.block_table, self.scale,
                   self.sliding_window, float(self.logits_soft_cap))
            return output
        _ATTENTION(q, key_cache, value_cache, out, attn_metadata.query_start_loc, seq_lens,
                   self.scale, attn_metadata.causal, self.alibi_slopes, self.sliding_window,
                   attn_metadata.block_table, self.logits_soft_cap, attn_metadata.scheduler_metadata,
                   None, attn_metadata.dynamic_causal, layer._k_scale_float, layer._v_scale_float,
                   self.kv_cache_dtype)
        return output

    @staticmethod
    def _step_slot_mapping(layer, slot_mapping: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """The metadata's slot mapping, or — where it does not cover the keys (padded tokens) — the forward
        context's for this layer, which is what vLLM's separate update op would use."""
        if slot_mapping.shape[0] == key.shape[0]:
            return slot_mapping
        from vllm.forward_context import get_forward_context

        mappings = get_forward_context().slot_mapping
        return mappings[layer.layer_name] if isinstance(mappings, dict) else slot_mapping


class FusedUpdateCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with the KV cache update inside its forward (see the module's doc)."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls() -> type[FusedUpdateCPUAttentionImpl]:
        return FusedUpdateCPUAttentionImpl
