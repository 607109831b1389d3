"""``llama`` (LlamaForCausalLM): llama.cpp stores q/k rows permuted for its rotary layout."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import DenseDecoderArch, llama_qk_permutation
from .rope import ROPE_FREQS_TENSOR, llama3_rope_factors


class LlamaArch(DenseDecoderArch):
    gguf_arch = "llama"
    # llama.cpp's converter writes Mistral as llama (LlamaModel handles MistralForCausalLM), so GGUF output of
    # a Hugging Face Mistral is llama's; a GGUF of it reads back as LlamaForCausalLM (the same network).
    hf_model_types = ("llama", "mistral")
    hf_architectures = ("LlamaForCausalLM", "MistralForCausalLM")
    default_tokenizer_pre = "llama-bpe"
    gguf_vocab = "llama"  # LlamaModel.set_vocab: tokenizer.model, else byte-fallback or byte-level BPE

    def _qk_heads(self, hf_name: str, config: dict[str, Any]) -> int | None:
        heads = int(config["num_attention_heads"])
        if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return heads
        if hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return int(config.get("num_key_value_heads") or heads)
        return None

    def rows_to_gguf(self, hf_name, config, n_rows):
        heads = self._qk_heads(hf_name, config)
        return None if heads is None else llama_qk_permutation(n_rows, heads)

    def rows_from_gguf(self, hf_name, config, n_rows):
        heads = self._qk_heads(hf_name, config)
        return None if heads is None else np.argsort(llama_qk_permutation(n_rows, heads))

    def config_fixups_from_gguf(self, config, metadata):
        super().config_fixups_from_gguf(config, metadata)
        if "llama.rope.dimension_count" in metadata and "llama.attention.key_length" not in metadata:
            config["head_dim"] = int(metadata["llama.rope.dimension_count"])

    def gguf_hparams(self, writer, config):
        super().gguf_hparams(writer, config)
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        writer.add_vocab_size(int(config["vocab_size"]))
        writer.add_rope_dimension_count(int(config.get("head_dim") or hidden // heads))

    def gguf_extra_tensors(self, config):
        # LlamaModel.generate_extra_tensors: llama3 rope scaling is a tensor, not a key
        factors = llama3_rope_factors(config)
        return [] if factors is None else [(ROPE_FREQS_TENSOR, factors)]


ARCH = LlamaArch()
