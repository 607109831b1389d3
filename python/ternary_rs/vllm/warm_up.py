"""vLLM CPU's warm-up pass without the ternary products (docs/cli.md#serve, "Start-up")."""

from __future__ import annotations


def install_cpu_warm_up_pass() -> None:
    """Make vLLM CPU's warm-up cheap for a ternary model (idempotent; a no-op off vLLM CPU).

    ``CPUModelRunner.warming_up_model`` runs one forward pass of ``max_num_batched_tokens`` dummy tokens
    (4096 for ``LLM()``, 2048 for the server) so that torch.compile builds the graph; vLLM discards its
    outputs. The ternary ops' products are nearly all of that pass's time — a 27B model's ran over an hour
    on a 2-core AVX2 machine before the first request — so during it they return zeros
    (:func:`ternary_rs.serving._ops_cpu.warm_up_pass`); the rest of the model, and the compile, run as
    before. Only when the KV cache space is explicit (the plugin's choice or the user's): otherwise vLLM
    sizes the cache from the resident memory after this pass.

    Called from ``TernaryConfig.get_quant_method`` (in the process that loads the model, where the runner
    module is already imported), not from ``plugin.register``, which also runs in the API server, where
    importing the runner would only cost seconds."""
    import sys

    runner = sys.modules.get("vllm.v1.worker.cpu_model_runner")
    cls = getattr(runner, "CPUModelRunner", None)
    if cls is None or getattr(cls.warming_up_model, "_ternary_rs", False):
        return
    original = cls.warming_up_model

    def warming_up_model(self, *args, **kwargs):
        import logging
        import time

        config = getattr(self, "vllm_config", None)
        quant = getattr(config, "quant_config", None)
        cache = getattr(config, "cache_config", None)
        if quant is None or quant.get_name() != "ternary" or getattr(cache, "kv_cache_memory_bytes", None) is None:
            return original(self, *args, **kwargs)
        from ternary_rs.serving._ops_cpu import warm_up_pass

        t0 = time.perf_counter()
        with warm_up_pass():
            result = original(self, *args, **kwargs)
        logging.getLogger("ternary_rs.vllm").info(
            "ternary_rs: vLLM's warm-up pass ran the ternary ops as zeros (its outputs are discarded): %.1f s",
            time.perf_counter() - t0)
        return result

    warming_up_model._ternary_rs = True  # type: ignore[attr-defined]
    cls.warming_up_model = warming_up_model
