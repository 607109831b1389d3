"""vLLM quantization backend for ternary checkpoints (``quant_method: "ternary"``)."""
