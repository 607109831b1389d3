"""``ternary-rs plan``: will this model fit, and how much context × concurrency does it leave?

Memory model (bytes; every term is reported separately):

* ``weights``: the served (canonical) form — per ternary weight ``N·K/4`` code bytes + ``N·K/g·2`` fp16
  scale bytes (BitNet master weights count as ternary: they are served after ``convert --ternarize``);
  every other tensor at 2 bytes per parameter (vLLM loads floats in the model dtype).
* ``kv_cache_per_token = 2 · L_attn · kv_heads · head_dim · kv_bytes`` (K and V; GQA-aware; ``L_attn``
  counts only attention layers: ``layer_types`` / per-layer KV heads / ``full_attention_interval`` for
  hybrids such as qwen35, all layers otherwise); ``kv_bytes`` = 2 (fp16) or 1 (fp8).
* ``state_per_sequence`` (hybrid linear-attention layers only, ``L_lin = layers − L_attn``):
  ``L_lin · (v_heads · k_dim · v_dim · 4 + (conv_kernel − 1) · (2·k_heads·k_dim + v_heads·v_dim) · 2)``
  (fp32 recurrent state + fp16 conv state; reported apart as ``recurrent_state_per_sequence``). vLLM holds
  the recurrent state in the model dtype unless told otherwise, and vLLM CPU in fp32 on AVX512_BF16 CPUs:
  the plan counts the larger; ``serve``'s KV sizing uses the width vLLM CPU will use
  (``serving.cpu.recurrent_state_bytes``).
* ``activations = BATCHED_TOKENS · (4·hidden + 2·intermediate + q_dim + 2·kv_dim) · 2`` (one forward step
  of vLLM's default token budget, fp16) ``+ concurrency · vocab · 8`` (fp32 logits and probabilities).
* ``overhead = RUNTIME_OVERHEAD`` (CUDA context, library workspaces, CUDA graphs).
* usable memory = ``gpu_memory · GPU_MEMORY_UTILIZATION`` (vLLM's default utilization).

``fits`` iff ``weights + overhead + activations + concurrency · (state + context · kv_per_token) ≤ usable``.

GPU memory is counted in binary units, as vendors and ``nvidia-smi`` do (a "24 GB" card has 24 GiB): a
bare number is GiB, and ``G``/``GB``/``GiB`` (likewise ``M``/``T``) all mean powers of 1024.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .._core import InvalidArgumentError, UnsupportedTypeError
from ..sources.reader import ternary_errors
from .report import build_report

GPU_MEMORY_UTILIZATION = 0.9
RUNTIME_OVERHEAD = 1 << 30
BATCHED_TOKENS = 8192
ACTIVATION_BYTES = 2
LOGIT_BYTES_PER_ENTRY = 8
KV_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "auto": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
DEFAULT_GROUP_SIZE = 128
# --gpu-memory units (case-insensitive); a bare number is GiB.
GPU_MEMORY_UNITS = {
    "": 2**30, "B": 1,
    **dict.fromkeys(("K", "KB", "KIB"), 2**10), **dict.fromkeys(("M", "MB", "MIB"), 2**20),
    **dict.fromkeys(("G", "GB", "GIB"), 2**30), **dict.fromkeys(("T", "TB", "TIB"), 2**40),
}


def parse_gpu_memory(value: int | float | str) -> int:
    """GPU memory in bytes: ``24``, ``24G``, ``24GB`` and ``24GiB`` are all 24·2³⁰; ``80000MiB``, ``512B``."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"GPU memory {value!r}: expected a size such as 24, 24G or 80GiB")
    text = str(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in GPU_MEMORY_UNITS:
        raise InvalidArgumentError(f"GPU memory {value!r}: expected a size such as 24 (GiB), 24G, 80GiB or 16000MiB")
    size = int(float(m.group(1)) * GPU_MEMORY_UNITS[m.group(2).upper()])
    if size <= 0:
        raise InvalidArgumentError(f"GPU memory {value!r} must be positive")
    return size


def _attention_layers(cfg: dict[str, Any]) -> int:
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("attention_layers") is not None:
        return int(cfg["attention_layers"])
    interval = cfg.get("full_attention_interval")
    if interval:
        return layers // int(interval)
    return layers


def _state_per_sequence(cfg: dict[str, Any], linear_layers: int) -> tuple[int, int]:
    """``(recurrent, conv)`` state bytes of one sequence: the fp32 recurrent state and the fp16 conv state."""
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    if linear_layers <= 0 or any(cfg.get(k) is None for k in keys):
        return 0, 0
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    conv = int(cfg.get("linear_conv_kernel_dim") or 4)
    return linear_layers * nv * dk * dv * 4, linear_layers * (conv - 1) * (2 * nk * dk + nv * dv) * 2


def served_weight_bytes(report: dict[str, Any]) -> tuple[int, int]:
    """``(bytes, group size)`` of the weights as the vLLM backend holds them."""
    qc = report.get("quantization_config") or {}
    groups = report["ternary"]["group_sizes"]
    g = int(qc.get("group_size") or (min(groups) if groups else DEFAULT_GROUP_SIZE)) if isinstance(qc, dict) \
        else (min(groups) if groups else DEFAULT_GROUP_SIZE)
    total = 0
    for e in report["tensor_table"]:
        params = int(e["params"])
        if (e["kind"] in ("ternary", "dense-ternary") or e.get("ternarize")) and len(e["shape"]) == 2:
            n, k = e["shape"]
            total += n * k // 4 + n * -(-k // g) * 2
        else:
            total += params * 2
    return total, g


@ternary_errors()
def plan(path, context: int = 8192, concurrency: int = 8, gpu_memory: int | float | str = 24,
         kv_dtype: str = "fp16", gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION) -> dict[str, Any]:
    """Memory budget for serving ``path`` (see the module doc for every formula and the units of
    ``gpu_memory``; ``gpu_memory_utilization`` is vLLM's option of that name). ``warnings`` lists what
    makes the numbers doubtful (a context above the model's)."""
    if context <= 0 or concurrency <= 0:
        raise InvalidArgumentError("context and concurrency must be positive")
    if kv_dtype not in KV_DTYPE_BYTES:
        raise InvalidArgumentError(f"kv_dtype {kv_dtype!r}: expected one of {sorted(KV_DTYPE_BYTES)}")
    report, _, _ = build_report(Path(path), "sample")  # float weights: would convert store them ternary?
    if report.get("not_ternary"):  # convert refuses it and ternary_rs cannot serve it: no plan to make
        raise UnsupportedTypeError(f"{path}: {report['not_ternary']}; ternary_rs serves ternary models only, so "
                                   "there is nothing to plan")
    cfg = report["config"]
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        if not cfg.get(key):
            raise InvalidArgumentError(f"{path}: cannot plan without {key} in the config/metadata")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    vocab = int(cfg.get("vocab_size") or 0)
    layers = int(cfg["num_hidden_layers"])
    attn_layers = _attention_layers(cfg)
    kv_bytes = KV_DTYPE_BYTES[kv_dtype]
    gpu = parse_gpu_memory(gpu_memory)
    if not 0 < gpu_memory_utilization <= 1:
        raise InvalidArgumentError(f"gpu_memory_utilization {gpu_memory_utilization}: expected a fraction in (0, 1]")
    usable = int(gpu * gpu_memory_utilization)

    weights, group = served_weight_bytes(report)
    kv_per_token = 2 * attn_layers * kv_heads * head_dim * kv_bytes
    recurrent, conv_state = _state_per_sequence(cfg, layers - attn_layers)
    state = recurrent + conv_state
    per_token_act = (4 * hidden + 2 * inter + heads * head_dim + 2 * kv_heads * head_dim) * ACTIVATION_BYTES
    act_fixed = BATCHED_TOKENS * per_token_act
    logits_per_seq = vocab * LOGIT_BYTES_PER_ENTRY
    activations = act_fixed + concurrency * logits_per_seq
    kv_total = kv_per_token * context * concurrency
    needed = weights + RUNTIME_OVERHEAD + activations + concurrency * state + kv_total
    free_for_seqs = usable - weights - RUNTIME_OVERHEAD - act_fixed
    max_tokens = (free_for_seqs - concurrency * (state + logits_per_seq)) // kv_per_token if kv_per_token else 0
    per_seq = kv_per_token * context + state + logits_per_seq
    max_context = max(0, max_tokens // concurrency)
    warnings = []
    model_max = int(cfg["max_position_embeddings"]) if cfg.get("max_position_embeddings") else None
    if model_max:
        max_context = min(max_context, model_max)
        if context > model_max:
            warnings.append(f"context {context} exceeds the model's maximum of {model_max} tokens "
                            "(max_position_embeddings); vLLM refuses a longer max_model_len")
    return {
        "path": str(path),
        "architecture": report["architecture"],
        "group_size": group,
        "gpu_memory": gpu,
        "usable_memory": usable,
        "gpu_memory_utilization": gpu_memory_utilization,
        "weights": weights,
        "kv_dtype": kv_dtype,
        "attention_layers": attn_layers,
        "linear_attention_layers": layers - attn_layers if state else 0,
        "kv_cache_per_token": kv_per_token,
        "kv_cache": kv_total,
        "state_per_sequence": state,
        "recurrent_state_per_sequence": recurrent,
        "activations": activations,
        "overhead": RUNTIME_OVERHEAD,
        "context": context,
        "concurrency": concurrency,
        "total": needed,
        "fits": needed <= usable,
        # False when the weights, runtime and one forward step alone exceed the usable memory: then no
        # context or concurrency fits at all.
        "weights_fit": free_for_seqs > 0,
        "fixed_memory": weights + RUNTIME_OVERHEAD + act_fixed,  # needed before any sequence
        "headroom": usable - needed,
        "max_total_tokens": max(0, int(max_tokens)),
        "max_context_at_concurrency": int(max_context),
        "max_concurrency_at_context": max(0, int(free_for_seqs // per_seq)) if per_seq else 0,
        "model_max_context": model_max,
        "warnings": warnings,
    }
