"""``qwen3moe`` (Qwen3MoeForCausalLM: Qwen3-30B-A3B and kin): Qwen3 attention, every block a sparse
Mixture-of-Experts MLP (a dense router ``mlp.gate`` + ``num_experts`` SwiGLU experts, top-k); the stacked
GGUF experts are split as :mod:`ternary_rs.arch.moe` describes.

Hyper-parameters from the GGUF metadata: ``qwen3moe.expert_count`` -> ``num_experts``,
``expert_used_count`` -> ``num_experts_per_tok``, ``expert_feed_forward_length`` -> ``moe_intermediate_size``.
llama.cpp always renormalises the top-k router weights of qwen3moe (as every released Qwen3 MoE model
does), so ``norm_topk_prob`` is true unless the file says otherwise (``expert_weights_norm``). qwen3moe has
no shared expert (gguf-py's table has no ``ffn_*_shexp`` for it).
"""

from __future__ import annotations

from .moe import DENSE_MLP_NAMES, MOE_BLOCK_NAMES, MoEDecoderArch, gguf_output_refused
from .qwen3 import Qwen3Arch


class Qwen3MoeArch(MoEDecoderArch):
    gguf_arch = "qwen3moe"
    hf_model_types = ("qwen3_moe",)
    hf_architectures = ("Qwen3MoeForCausalLM",)
    # Qwen3's attention (q/k norms), experts instead of the dense MLP.
    hf_block_names = tuple(n for n in Qwen3Arch.hf_block_names if n not in DENSE_MLP_NAMES) + MOE_BLOCK_NAMES
    default_tokenizer_pre = "qwen2"
    gguf_vocab = "qwen2"  # Qwen2MoeModel.set_vocab: tokenizer.model if present, else byte-level BPE

    def write_gguf(self, src, out_path, options) -> None:
        # The generic GGUF writer knows 2-D weights only; llama.cpp wants the experts stacked into 3-D.
        from .._core import UnsupportedTypeError

        raise UnsupportedTypeError(gguf_output_refused(src.path, self.gguf_arch))


ARCH = Qwen3MoeArch()
