"""vLLM quantization backend for ternary checkpoints (``quant_method: "ternary"``).

Loaded by vLLM through the ``vllm.general_plugins`` entry point (:func:`plugin.register`); nothing here is
imported by ``import ternary_rs``. Modules:

* :mod:`.config` — :class:`~.config.TernaryConfig` (reads ``quantization_config``, picks a method per layer);
* :mod:`.params` — the packing constants the config and the methods share (below both: the config builds
  the methods, the methods never import the config);
* :mod:`.linear` — :class:`~.linear.TernaryLinearMethod` (TP sharding via vLLM parameter classes);
* :mod:`.embedding` — :class:`~.embedding.TernaryEmbeddingMethod` (ternary ``embed_tokens`` / ``lm_head``);
* :mod:`.moe` — :class:`~.moe.TernaryMoEMethod` (routed experts of vLLM's fused-MoE layers, e.g. Qwen3-MoE:
  2-bit in memory, one ``torch.ops.ternary_rs.ternary_moe`` call per layer, TP over the intermediate size);
* :mod:`.qwen3_5` — Qwen3.5 model classes (main model and MTP drafter) whose ``embed_tokens`` is built with
  the quant config, registered under vLLM's own architecture names by :func:`plugin.register`.
* :mod:`.bitnet` — ``BitNetForCausalLM`` (BitNet b1.58; registered with vLLM's ``ModelRegistry`` by
  :func:`.plugin.register`), whose linear layers ask the op for int8-per-token activations.

Hook for rotated checkpoints (Bonsai 2 Hadamard, docs/formats.md#bonsai2-rotation)
-------------------------------------------------------------------
Every key of ``quantization_config`` that the contract does not define is kept in ``TernaryConfig.extra``.
When it has a ``"hadamard"`` entry (``TernaryConfig.hadamard``), the module ``ternary_rs.vllm.hadamard``
must provide:

* ``make_input_transform(hadamard, prefix, layer, tp_rank, tp_size) -> Callable[[Tensor], Tensor] | None``
  — called once per ternary linear / lm_head after its weights are loaded (``layer`` is the vLLM module,
  ``prefix`` its vLLM name, e.g. ``model.layers.0.self_attn.qkv_proj``; ``tp_rank``/``tp_size`` describe
  this rank's K shard for row-parallel layers). The callable is applied to the activations ``x[..., K]``
  right before ``torch.ops.ternary_rs.ternary_linear`` and must be traceable by ``torch.compile``.
* ``make_embedding_transform(hadamard, prefix) -> Callable[[Tensor], Tensor] | None`` — applied to the
  looked-up rows ``[..., hidden]`` of a ternary ``embed_tokens``.

Checkpoints without ``"hadamard"`` never import that module; ones with it fail with a clear error when
it is missing.
"""
