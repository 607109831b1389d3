"""``TernaryEmbeddingMethod``: ternary ``embed_tokens`` (row lookup) and ternary ``lm_head`` (the op).

The same canonical tensors as a linear layer (``qweight uint8 [V, K/4]``, ``scales fp16 [V, K/g]``, V =
this rank's padded vocabulary shard, K = hidden size), sharded along the vocabulary by vLLM's
``VocabParallelEmbedding.weight_loader`` (padding rows get code 0 and scale 0, i.e. zero weights).

* ``embedding``: gathers the packed rows and scales of the requested token ids and unpacks only those
  rows — the table is never materialised in bf16 (memory stays at 2.25 bits/weight + scales).
* ``apply`` (lm_head): ``torch.ops.ternary_rs.ternary_linear`` on the kernel layout from
  ``ops.prepare_weight``.
* ``tie_weights``: a tied lm_head shares the embedding's ``qweight``/``scales`` Parameters (so vLLM's
  loader skips the alias); the kernel layout is prepared once per shared tensor and cached on it. A tie to a
  dense placeholder table is deferred (see :mod:`ternary_rs.vllm.qwen3_5`) and refused if never redone.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from ..serving import ops as ternary_ops
from .linear import TernaryMethodBase, int8_only, validate_loaded
from .params import CODES_PER_BYTE

# Attribute cached on a canonical qweight Parameter shared by embed_tokens and a tied lm_head.
_KERNEL_CACHE_ATTR = "_ternary_kernel_tensors"


def unpack_rows(qweight_rows: torch.Tensor, scale_rows: torch.Tensor, group_size: int, dtype: torch.dtype):
    """Dequantize gathered rows: ``[..., K/4] uint8`` + ``[..., K/g] fp16`` -> ``[..., K]`` of ``dtype``."""
    shifts = torch.arange(0, 2 * CODES_PER_BYTE, 2, dtype=torch.uint8, device=qweight_rows.device)
    codes = (qweight_rows.unsqueeze(-1) >> shifts) & 3
    lead = qweight_rows.shape[:-1]
    k = qweight_rows.shape[-1] * CODES_PER_BYTE
    trits = codes.reshape(*lead, k // group_size, group_size).to(torch.float32) - 1.0
    # fp32 product is exact (t·fp16 scale); one rounding to the model dtype, as a dense checkpoint gets.
    rows = trits * scale_rows.to(torch.float32).unsqueeze(-1)
    return rows.reshape(*lead, k).to(dtype)


class TernaryEmbeddingMethod(TernaryMethodBase, QuantizeMethodBase):
    """Quant method of ``VocabParallelEmbedding`` and ``ParallelLMHead`` with ternary weights."""

    def _tp_size(self, layer: torch.nn.Module) -> int:
        return 1  # the vocabulary is sharded, never K

    def create_weights(self, layer: torch.nn.Module, *weight_args, **extra_weight_attrs) -> None:
        super().create_weights(layer, *weight_args, **extra_weight_attrs)
        layer.ternary_tied = False
        layer.ternary_embedding_transform = None

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module):
        if not isinstance(getattr(embed_tokens, "quant_method", None), TernaryEmbeddingMethod):
            # A model whose constructor builds embed_tokens without the quant config (vLLM's Qwen3.5) ties to
            # that placeholder first; ternary_rs.vllm.qwen3_5 then swaps in a ternary table and ties again.
            # Still untied when the weights are processed: the embedding really is dense (an error there).
            layer.ternary_tie_pending = True
            return layer
        layer.qweight = embed_tokens.qweight
        layer.scales = embed_tokens.scales
        layer.ternary_tied = True
        layer.ternary_tie_pending = False
        return layer

    def _kernel_tensors(self, layer: torch.nn.Module):
        """Kernel layout of the layer's canonical tensors, prepared once per (shared) Parameter."""
        cached = getattr(layer.qweight, _KERNEL_CACHE_ATTR, None)
        if cached is None:
            cached = ternary_ops.prepare_weight(layer.qweight.data, layer.scales.data, layer.ternary_group_size,
                                                int8_only=int8_only(layer))
            setattr(layer.qweight, _KERNEL_CACHE_ATTR, cached)
        return cached

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "ternary_tie_pending", False):
            raise ValueError(
                f"ternary checkpoint: {self.prefix!r} is tied to the input embeddings, which are not ternary"
            )
        if not getattr(layer.qweight, "_ternary_validated", False):
            validate_loaded(self.prefix, layer.qweight.data, layer.scales.data,
                            lambda: self.quant_config.locate_invalid(self.prefix))
            layer.qweight._ternary_validated = True
        if isinstance(layer, ParallelLMHead):
            qweight_k, scales_k = self._kernel_tensors(layer)
            layer.register_buffer("qweight_k", qweight_k, persistent=False)
            layer.register_buffer("scales_k", scales_k, persistent=False)
            if not layer.ternary_tied:
                # Only the kernel layout is needed by an untied head.
                del layer.qweight
                del layer.scales
            layer.ternary_input_transform = self.quant_config.get_input_transform(self.prefix, layer)
        else:
            layer.ternary_embedding_transform = self.quant_config.get_embedding_transform(self.prefix)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._ternary_linear(layer, x, layer.qweight_k, layer.scales_k, bias)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        rows = unpack_rows(layer.qweight[input_], layer.scales[input_], layer.ternary_group_size, layer.params_dtype)
        transform = layer.ternary_embedding_transform
        return rows if transform is None else transform(rows)
