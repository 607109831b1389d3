"""``qwen2moe`` (Qwen2MoeForCausalLM: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases), every
block a sparse MLP of routed SwiGLU experts (stacked in the GGUF, split as :mod:`ternary_rs.arch.moe`
describes) plus one **shared expert** ``mlp.shared_expert.{gate,up,down}_proj`` (llama.cpp's
``ffn_{gate,up,down}_shexp``: ordinary linears, ternary like the others) whose output is scaled by
``sigmoid(mlp.shared_expert_gate · x)`` (``ffn_gate_inp_shexp``, a dense ``[1, hidden]`` row that
llama.cpp keeps in F32).

Hyper-parameters from the GGUF metadata as for qwen3moe, plus ``expert_shared_feed_forward_length`` ->
``shared_expert_intermediate_size``. llama.cpp's qwen2moe graph does not renormalise the selected
experts' weights (``norm_w = false`` in its ``build_moe_ffn`` call), so ``norm_topk_prob`` is false unless
the file says otherwise (``expert_weights_norm``). vLLM runs the shared expert itself (``SharedExperts``
beside the ternary routed-expert method), through the ternary linear method.
"""

from __future__ import annotations

from typing import Any

from .base import DenseDecoderArch
from .moe import DENSE_MLP_NAMES, MOE_BLOCK_NAMES, MoEDecoderArch, gguf_output_refused

SHARED_EXPERT_NAMES = (
    "model.layers.{bid}.mlp.shared_expert.gate_proj.weight",
    "model.layers.{bid}.mlp.shared_expert.up_proj.weight",
    "model.layers.{bid}.mlp.shared_expert.down_proj.weight",
    "model.layers.{bid}.mlp.shared_expert_gate.weight",
)


class Qwen2MoeArch(MoEDecoderArch):
    gguf_arch = "qwen2moe"
    hf_model_types = ("qwen2_moe",)
    hf_architectures = ("Qwen2MoeForCausalLM",)
    hf_block_names = (tuple(n for n in DenseDecoderArch.hf_block_names if n not in DENSE_MLP_NAMES)
                      + MOE_BLOCK_NAMES + SHARED_EXPERT_NAMES)
    moe_keys = MoEDecoderArch.moe_keys + (("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),)
    default_tokenizer_pre = "qwen2"
    gguf_vocab = "qwen2"  # Qwen2MoeModel.set_vocab is Qwen2Model's: tokenizer.model if present, else BPE
    default_norm_topk_prob = False

    def config_fixups_from_gguf(self, config: dict[str, Any], metadata: dict[str, Any]) -> None:
        super().config_fixups_from_gguf(config, metadata)
        # A file without a shared expert length describes blocks without one (vLLM then builds none).
        config.setdefault("shared_expert_intermediate_size", 0)
        config["qkv_bias"] = True  # Qwen2's attention; vLLM's Qwen2MoeAttention always has them

    def write_gguf(self, src, out_path, options) -> None:
        from .._core import UnsupportedTypeError

        raise UnsupportedTypeError(gguf_output_refused(src.path, self.gguf_arch))


ARCH = Qwen2MoeArch()
