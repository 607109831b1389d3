"""vLLM general-plugin entry point (``vllm.general_plugins`` -> ``ternary_rs.vllm.plugin:register``).

vLLM calls ``register()`` in every process it starts (engine core, TP workers, API server), possibly more
than once; registering is idempotent. vLLM is imported here only, never at ``import ternary_rs`` time.
"""

from __future__ import annotations

_registered = False

# Architecture name -> "module:class" of the model classes the plugin supplies (imported lazily by vLLM,
# only when such a model loads): Qwen3.5 with a ternary embed_tokens (ternary_rs.vllm.qwen3_5), and
# BitNet b1.58, which vLLM has no model for (ternary_rs.vllm.bitnet).
MODEL_CLASSES = {
    "Qwen3_5ForCausalLM": "ternary_rs.vllm.qwen3_5:TernaryQwen3_5ForCausalLM",
    "Qwen3_5MTP": "ternary_rs.vllm.qwen3_5:TernaryQwen3_5MTP",
    "BitNetForCausalLM": "ternary_rs.vllm.bitnet:BitNetForCausalLM",
}


def register() -> None:
    """Register the ``"ternary"`` quantization config and the model classes with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.model_executor.layers.quantization import (
        _CUSTOMIZED_METHOD_TO_QUANT_CONFIG,
        register_quantization_config,
    )

    from .config import QUANT_METHOD, TernaryConfig

    if _CUSTOMIZED_METHOD_TO_QUANT_CONFIG.get(QUANT_METHOD) is not TernaryConfig:
        register_quantization_config(QUANT_METHOD)(TernaryConfig)
    for arch, target in MODEL_CLASSES.items():
        ModelRegistry.register_model(arch, target)
    _registered = True
