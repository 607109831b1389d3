"""``qwen3`` (Qwen3ForCausalLM, the base of first-generation Ternary-Bonsai): per-head q/k RMS norms,
no q/k row permutation in llama.cpp (``Qwen3Model`` in convert_hf_to_gguf.py does not permute)."""

from __future__ import annotations

from .base import DenseDecoderArch


class Qwen3Arch(DenseDecoderArch):
    gguf_arch = "qwen3"
    hf_model_types = ("qwen3",)
    hf_architectures = ("Qwen3ForCausalLM",)
    hf_block_names = DenseDecoderArch.hf_block_names + (
        "model.layers.{bid}.self_attn.q_norm.weight",
        "model.layers.{bid}.self_attn.k_norm.weight",
    )
    default_tokenizer_pre = "qwen2"
    gguf_vocab = "qwen2"  # Qwen2Model.set_vocab: tokenizer.model if present, else byte-level BPE


ARCH = Qwen3Arch()
