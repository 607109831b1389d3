"""Floor 7, serving: the torch custom ops (:mod:`.ops` and its CPU / CUDA / MoE kernels), the vLLM-on-CPU
settings (:mod:`.cpu`), ``ternary-rs serve`` (:mod:`.serve`) and the server health poll (:mod:`.health`)."""
