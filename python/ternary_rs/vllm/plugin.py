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
    _install_cpu_defaults()
    _registered = True


def _install_cpu_defaults() -> None:
    """On vLLM CPU, wrap the platform's ``check_and_update_config`` (the one place that sees the whole
    config before vLLM reads ``VLLM_CPU_KVCACHE_SPACE`` and before the workers are bound) so that a ternary
    model gets the fast settings of :mod:`ternary_rs.serving.cpu` that the user did not set."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    cls = type(current_platform)
    if getattr(cls.check_and_update_config, "_ternary_rs_defaults", False):
        return
    original = cls.check_and_update_config.__func__

    def check_and_update_config(klass, vllm_config):
        apply_cpu_defaults(vllm_config)
        return original(klass, vllm_config)

    check_and_update_config._ternary_rs_defaults = True  # type: ignore[attr-defined]
    cls.check_and_update_config = classmethod(check_and_update_config)

    # The attention backend is chosen later, in the process that builds the model (engine core or worker:
    # register() runs there too), with that model's config current
    original_attention = cls.get_attn_backend_cls.__func__

    def get_attn_backend_cls(klass, selected_backend, *args, **kwargs):
        path = original_attention(klass, selected_backend, *args, **kwargs)
        return attention_backend_path(path, selected_backend)

    cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    _install_cpu_sampler()


def _install_cpu_sampler() -> None:
    """Top-p (and top-k with it) on CPU by selection instead of vLLM's sort of every row
    (:mod:`ternary_rs.serving.sampling`), unless ``TERNARY_RS_CPU_SAMPLER=vllm``. The sampler looks the
    function up in its module at each call, so replacing the module attribute is enough."""
    from vllm.v1.sample.ops import topk_topp_sampler

    from ternary_rs.serving import sampling

    if sampling.enabled() and not getattr(topk_topp_sampler.apply_top_k_top_p, "_ternary_rs", False):
        topk_topp_sampler.apply_top_k_top_p = sampling.fast_apply_top_k_top_p(topk_topp_sampler.apply_top_k_top_p)


def vllm_paging(cache_config):
    """How this engine's cache settings page a sequence (``serving.cpu.Paging``)."""
    from ternary_rs.serving.cpu import Paging

    user_block = getattr(cache_config, "user_specified_block_size", False)
    return Paging.of(getattr(cache_config, "enable_prefix_caching", None) is not False,  # None: vLLM's default, on
                     str(getattr(cache_config, "mamba_cache_mode", "none") or "none"),
                     int(cache_config.block_size) if user_block and cache_config.block_size else None,
                     str(getattr(cache_config, "mamba_ssm_cache_dtype", "auto") or "auto"))


def apply_cpu_defaults(vllm_config) -> None:
    """Reserved cores and, for tensor parallel on fewer NUMA nodes than ranks, the thread binding
    (environment, read later by vLLM's worker binding) and the KV cache space
    (``cache_config.kv_cache_memory_bytes``) for a ternary model, unless the user set them."""
    import logging
    import os

    from ternary_rs.serving import cpu as cpu_serving

    log = logging.getLogger("ternary_rs.vllm")
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or not _is_ternary(vllm_config):
        return
    cache = vllm_config.cache_config
    kv = str(getattr(cache, "cache_dtype", "auto") or "auto")
    kv_dtype = "fp8" if kv.startswith("fp8") else "fp16"
    kv_given = cache.kv_cache_memory_bytes is not None

    def choose(kv_bytes_given: bool, env: dict | None = None):
        return cpu_serving.choose(
            model_config.model, env=env, max_model_len=model_config.max_model_len,
            max_num_seqs=getattr(vllm_config.scheduler_config, "max_num_seqs", None),
            kv_dtype=kv_dtype, kv_bytes_given=kv_bytes_given,
            tensor_parallel=int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1),
            paging=vllm_paging(cache))

    try:
        try:
            settings = choose(kv_given)
        except cpu_serving.DoesNotFit as e:
            # max_model_len is too long for this machine: the other settings still apply, and vLLM gets the
            # budget's KV space, so that its own check names the length that fits (with max_model_len=-1
            # it fits to it) instead of failing for want of VLLM_CPU_KVCACHE_SPACE.
            settings = choose(True, {k: v for k, v in os.environ.items() if k != cpu_serving.KV_ENV})
            space = 0 if kv_given or os.environ.get(cpu_serving.KV_ENV) else \
                cpu_serving.budget_space(model_config.model, kv_dtype=kv_dtype)
            settings.kv_bytes = space or None
            log.warning("ternary_rs: %s; KV cache space: %s", e,
                        f"{space // cpu_serving.GIB} GiB (the budget)" if space else "as set")
    except Exception as e:  # noqa: BLE001 - choosing defaults must never stop vLLM from starting
        # (a damaged checkpoint is refused by the loader, with its own message naming file and tensor)
        log.warning("ternary_rs: vLLM CPU settings left as vLLM's: %s", e)
        return
    # (choose leaves out VLLM_USE_LAYERNAME here: vLLM read it when it was imported; written now it would
    # only reach the processes it starts, and make them disagree with this one)
    for name, value in settings.env.items():
        if name != cpu_serving.KV_ENV:
            os.environ.setdefault(name, value)
    wrapper = cpp_wrapper_choice(getattr(vllm_config, "compilation_config", None))
    if wrapper is not None:
        settings.choices.append(wrapper)
    settings.choices.append(attention_choice(vllm_config))
    dtype = dtype_hint(model_config)
    if dtype is not None:
        settings.choices.append(dtype)
    if settings.kv_bytes is not None:
        cache.kv_cache_memory_bytes = settings.kv_bytes
    log.warning("ternary_rs: vLLM CPU settings: %s", settings.summary())


def dtype_hint(model_config):
    """A float16 model on a CPU with native bf16 but not fp16 runs faster in bfloat16
    (``ternary_rs.serving.cpu.dtype_choice``, which ``ternary-rs serve`` applies). vLLM has resolved the
    dtype before any plugin hook runs, and a ``float16`` of the user's looks the same as one read from the
    config, so inside vLLM it is only reported, with how to get bf16."""
    import torch

    from ternary_rs.serving.cpu import Choice, bf16_not_fp16

    if getattr(model_config, "dtype", None) != torch.float16 or not bf16_not_fp16():
        return None
    return Choice("dtype", "float16", "this CPU has native bf16 arithmetic, not fp16: dtype='bfloat16' "
                  "(--dtype bfloat16) decodes faster", vllm_default=True, variable=False)


CPP_WRAPPER = "cpp_wrapper"
CPP_WRAPPER_BUILD_SEPARATE = "cpp_wrapper_build_separate"


def layer_names_are_strings() -> bool:
    """Whether vLLM in this process passes layer names to its custom ops as strings (``VLLM_USE_LAYERNAME=0``
    when vLLM was imported, or a torch without opaque types) rather than as opaque ``LayerName`` objects."""
    try:
        from vllm.utils import torch_utils
    except ImportError:
        return False
    return getattr(torch_utils, "_USE_LAYERNAME", True) is False


def cpp_wrapper_choice(compilation_config):
    """Inductor's C++ graph wrapper for a model vLLM compiles (``inductor_compile_config["cpp_wrapper"]``),
    unless the user chose: the compiled graph's Python wrapper (one Python statement per buffer and kernel
    call, ~40 per layer) is a large share of a CPU decode step. It needs the layer names as strings (the
    opaque ``LayerName`` objects cannot pass through it: compiling fails), so it is turned on only where
    they are; ``ternary-rs serve`` starts vLLM with ``VLLM_USE_LAYERNAME=0`` for this. Returns the choice
    to report, ``None`` where nothing is compiled."""
    from vllm.config import CompilationMode

    from ternary_rs.serving.cpu import LAYER_NAME_ENV, Choice

    name = f"inductor {CPP_WRAPPER}"
    if compilation_config is None or getattr(compilation_config, "mode", None) != CompilationMode.VLLM_COMPILE:
        # eager (enforce_eager) or torch's stock compile; a LoRA model vLLM CPU makes eager afterwards, and
        # the option then goes unused
        return None
    options = compilation_config.inductor_compile_config
    if CPP_WRAPPER in options:
        return Choice(name, str(bool(options[CPP_WRAPPER])), "", by_user=True, variable=False)
    if not layer_names_are_strings():
        return Choice(name, "False", f"vLLM was imported without {LAYER_NAME_ENV}=0: set it before importing vLLM "
                      "for the C++ graph wrapper", vllm_default=True, variable=False)
    options[CPP_WRAPPER] = True
    # The wrapper compiled apart from the kernels, at -O1: compiled together, all at -O3, the 1.7B shape's
    # first start took 130 s instead of 75 (apart: 89 s, the same tokens/s) and the 27B shape's ran past
    # 25 minutes in one compiler process
    options.setdefault(CPP_WRAPPER_BUILD_SEPARATE, True)
    return Choice(name, "True", "the compiled graph runs without per-step Python", variable=False)


FUSED_ATTENTION = "ternary_rs.vllm.cpu_attention.FusedUpdateCPUAttentionBackend"


def _is_ternary(vllm_config) -> bool:
    quant = getattr(vllm_config, "quant_config", None)
    return quant is not None and quant.get_name() == "ternary"


def _default_cpu_attention() -> bool:
    """Whether ``CPU_ATTN`` still names vLLM's own class (nobody ``register_backend``-ed another)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.CPU_ATTN.get_path() == AttentionBackendEnum.CPU_ATTN.value


def attention_backend_path(path: str, selected_backend) -> str:
    """The attention backend class for a model vLLM CPU builds: :mod:`ternary_rs.vllm.cpu_attention`'s
    where vLLM picked its own ``CPU_ATTN`` by itself (no ``attention_config.backend`` of the user's, no
    override of that backend) for a ternary model; otherwise ``path``, vLLM's choice, unchanged."""
    from vllm.config import get_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if selected_backend is not None or path != AttentionBackendEnum.CPU_ATTN.value:  # the user's, or an override
        return path
    return FUSED_ATTENTION if _is_ternary(get_current_vllm_config()) else path


def attention_choice(vllm_config):
    """What :func:`attention_backend_path` will pick for this config, for the settings line."""
    from ternary_rs.serving.cpu import Choice

    name = "attention"
    user = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if user is not None:
        return Choice(name, getattr(user, "name", str(user)), "", by_user=True, variable=False)
    if not _default_cpu_attention():
        return Choice(name, "CPU_ATTN", "a registered override of CPU_ATTN is kept", by_user=True, variable=False)
    return Choice(name, "CPU_ATTN+update", "the KV cache update inside the attention op: one Python op per layer "
                  "and step instead of two; decode steps on ternary_rs's paged decode kernel "
                  "(TERNARY_RS_CPU_ATTENTION=vllm keeps vLLM's)", variable=False)
