"""Qwen3.5 model classes whose ``embed_tokens`` is built with the quant config (Bonsai 2's ternary table).

vLLM 0.32's ``Qwen3_5Model`` and its MTP drafter ``Qwen3_5MultiTokenPredictor`` create ``embed_tokens`` as a
plain ``VocabParallelEmbedding`` — no quant config — so a ternary table could only be served dense (about
2.5 GB in bf16 at 27B instead of 0.34 GB). These subclasses replace that one layer, right after the stock
constructor, by a ``VocabParallelEmbedding`` built with the checkpoint's :class:`TernaryConfig`: the table
stays ternary (2 bits + a scale per group) and only looked-up rows are unpacked (and un-rotated for an
inverse-rotated Bonsai 2 table, see :mod:`ternary_rs.vllm.hadamard`). A tied ``lm_head`` is re-tied to the
new table; the stock constructor's tie to the dense placeholder was deferred by
:meth:`TernaryEmbeddingMethod.tie_weights`. Everything else is vLLM's own code.

With any other quantization (or none) the classes are the stock ones, unchanged. The plugin's ``register()``
puts them in vLLM's ``ModelRegistry`` under the stock architecture names ``Qwen3_5ForCausalLM`` and
``Qwen3_5MTP`` (the name vLLM's speculative config gives the MTP drafter), lazily (see
:data:`ternary_rs.vllm.plugin.MODEL_CLASSES`): this module is imported only when such a model loads.

The placeholder dense table is allocated by the stock constructor and dropped at once: on CPU its pages are
never touched (no resident memory); on CUDA it returns to the caching allocator before weights load.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM
from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MTP
from vllm.model_executor.models.utils import maybe_prefix

from .config import TernaryConfig


def _ternary_embedding(owner: torch.nn.Module, head_owner: torch.nn.Module, quant_config, vocab_size: int,
                       hidden_size: int, prefix: str, tie: bool) -> None:
    """Replace ``owner.embed_tokens`` by one built with ``quant_config``; re-tie ``head_owner.lm_head``."""
    old = owner.embed_tokens
    owner.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size, quant_config=quant_config, prefix=prefix)
    del old
    if tie and hasattr(head_owner, "lm_head") and hasattr(head_owner.lm_head, "tie_weights"):
        head_owner.lm_head = head_owner.lm_head.tie_weights(owner.embed_tokens)


class TernaryQwen3_5ForCausalLM(Qwen3_5ForCausalLM):
    """``Qwen3_5ForCausalLM`` with a quantized ``model.embed_tokens`` under a ternary checkpoint."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        quant_config = vllm_config.quant_config
        if isinstance(quant_config, TernaryConfig):
            config = self.config
            _ternary_embedding(self.model, self, quant_config, config.vocab_size, config.hidden_size,
                               maybe_prefix(prefix, "model.embed_tokens"), bool(config.tie_word_embeddings))


class TernaryQwen3_5MTP(Qwen3_5MTP):
    """vLLM's Qwen3.5 MTP drafter with a quantized ``embed_tokens``: it loads the checkpoint's (ternary)
    ``model.embed_tokens``, which vLLM then replaces by the target model's own table anyway.

    Also (any quantization): vLLM 0.32 strips M-RoPE from a text-only Qwen3.5's config
    (``Qwen3_5ForCausalLMConfig``), so its layers — the drafter's too — use a 1-D rotary embedding, but the
    drafter's own config keeps ``mrope_section`` and its proposer passes ``[3, T]`` positions. The CPU rotary
    kernel then reads ``3·T`` positions and writes past the query/key tensors (heap corruption: vLLM CPU's
    own dense Qwen3.5 MTP crashes the same way). vLLM's fused CUDA path takes row 0 in exactly this case;
    :meth:`forward` does the same (text-only M-RoPE rows are identical, so nothing changes numerically)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        quant_config = vllm_config.quant_config
        if isinstance(quant_config, TernaryConfig):
            config = self.config
            # Checkpoint name of the table the drafter loads (load_weights keeps "model.embed_tokens.*").
            _ternary_embedding(self.model, self, quant_config, config.vocab_size, config.hidden_size,
                               "model.embed_tokens", bool(config.tie_word_embeddings))
        self._layers_use_mrope = any(
            getattr(m, "mrope_section", None) for n, m in self.model.named_modules() if n.endswith("rotary_emb")
        )

    def forward(self, input_ids, positions, hidden_states, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        if positions.ndim == 2 and not self._layers_use_mrope:
            positions = positions[0]
        return super().forward(input_ids, positions, hidden_states, intermediate_tensors, inputs_embeds, **kwargs)
