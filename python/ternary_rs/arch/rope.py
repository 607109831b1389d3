"""Rotary-embedding (RoPE) hyper-parameters of a Hugging Face config, as llama.cpp's converter writes them.

``convert_hf_to_gguf.py`` reads ``rope_parameters`` (transformers 5) or ``rope_scaling`` (transformers 4),
with the top-level ``rope_theta`` / ``original_max_position_embeddings`` mirrored in
(``TextModel.__init__``), then writes (``TextModel.set_gguf_parameters``):

* ``linear``: ``rope.scaling.type = linear`` and ``rope.scaling.factor``;
* ``yarn``: type, factor, ``rope.scaling.original_context_length`` and the optional YaRN keys
  (``extrapolation_factor``, ``attention_factor``/``attn_factor``, ``beta_fast``, ``beta_slow``);
* ``su`` / ``longrope``: the type only; ``dynamic``: nothing (model classes handle it);
* ``llama3``: no key, but ``LlamaModel.generate_extra_tensors`` writes a ``rope_freqs.weight`` tensor of
  per-frequency divisors (:func:`llama3_rope_factors`), which llama.cpp applies to every position.

The same functions serve every dense architecture; which of them an architecture uses (only llama writes
``rope_freqs``) is the architecture's choice, as in upstream's model classes.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from .._core import FormatError

log = logging.getLogger("ternary_rs.convert")

# find_hparam's key lists in TextModel.__init__, first present wins.
_ROPE_THETA_KEYS = ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta", "rotary_emb_base")
_LOCAL_ROPE_THETA_KEYS = ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                          "rope_local_base_freq")
_PARTIAL_ROTARY_KEYS = ("partial_rotary_factor", "rope_pct", "rope_percent")
# The GGUF tensor of llama3 rope factors (gguf.MODEL_TENSOR.ROPE_FREQS).
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if key in config:
            return config[key]
    return None


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """``TextModel.rope_parameters``: a copy of ``rope_parameters`` (else ``rope_scaling``) with the
    top-level values mirrored in where the dict does not have them."""
    params = config["rope_parameters"] if "rope_parameters" in config else config.get("rope_scaling")
    params = dict(params or {})
    if "full_attention" not in params and "sliding_attention" not in params:
        local_theta = _first(config, _LOCAL_ROPE_THETA_KEYS)
        if local_theta is not None:
            params["sliding_attention"] = {"rope_theta": local_theta}
        mirrored = (("rope_theta", _first(config, _ROPE_THETA_KEYS)), ("rope_type", params.get("type")),
                    ("partial_rotary_factor", _first(config, _PARTIAL_ROTARY_KEYS)),
                    ("original_max_position_embeddings", config.get("original_max_position_embeddings")))
        for key, value in mirrored:
            if key not in params and value is not None:
                params[key] = value
    return params


def full_attention_rope(config: dict[str, Any]) -> dict[str, Any]:
    """The parameters of full-attention layers (``rope_parameters["full_attention"]`` when split)."""
    params = rope_parameters(config)
    return params.get("full_attention", params)


def add_rope_keys(writer, config: dict[str, Any]) -> None:
    """The rope-scaling keys and ``rope.freq_base`` (+ ``_swa``) on a ``gguf.GGUFWriter``, in upstream's order."""
    import gguf

    params = rope_parameters(config)
    full = params.get("full_attention", params)
    rope_type = full.get("rope_type")
    if rope_type is not None:
        factor = full.get("factor")
        if rope_type == "linear" and factor is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(factor)
        elif rope_type == "yarn" and factor is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(factor)
            if full.get("original_max_position_embeddings") is None:
                raise FormatError("config.json: rope_type yarn without original_max_position_embeddings "
                                  "(llama.cpp needs the pre-YaRN context length)")
            writer.add_rope_scaling_orig_ctx_len(int(full["original_max_position_embeddings"]))
            optional = ((writer.add_rope_scaling_yarn_ext_factor, full.get("extrapolation_factor")),
                        (writer.add_rope_scaling_yarn_attn_factor,
                         full.get("attention_factor", full.get("attn_factor"))),
                        (writer.add_rope_scaling_yarn_beta_fast, full.get("beta_fast")),
                        (writer.add_rope_scaling_yarn_beta_slow, full.get("beta_slow")))
            for add, value in optional:
                if value is not None:
                    add(value)
        elif rope_type in ("su", "longrope"):
            writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        elif rope_type == "dynamic" or str(rope_type).lower() == "llama3":
            pass  # dynamic: model-specific; llama3: the rope_freqs tensor (llama3_rope_factors)
        elif rope_type != "default":
            log.warning("config.json: unknown rope_type %r; no rope scaling written to the GGUF", rope_type)
    if full.get("rope_theta") is not None:
        writer.add_rope_freq_base(full["rope_theta"])
    local_theta = params.get("sliding_attention", {}).get("rope_theta")
    if local_theta is not None:
        writer.add_rope_freq_base_swa(local_theta)


def llama3_rope_factors(config: dict[str, Any], use_torch: bool | None = None) -> np.ndarray | None:
    """``rope_freqs.weight`` for a ``llama3`` rope (``LlamaModel.generate_extra_tensors``): one float32
    divisor per rotary frequency pair; ``None`` for any other rope type.

    Computed with torch exactly as upstream does (the same float32 operations, so the same bits) when torch
    is importable (``use_torch=None``); otherwise with numpy in float32, whose ``pow`` can differ from
    torch's vectorised one in the last bits of a few factors (harmless: llama.cpp's rope is float32)."""
    full = full_attention_rope(config)
    if str(full.get("rope_type", "")).lower() != "llama3":
        return None
    dim = config.get("head_dim")
    if dim is None:
        dim = config["hidden_size"] // config["num_attention_heads"]
    args = (full.get("rope_theta", 10000.0), int(dim), full.get("factor", 8.0), full.get("low_freq_factor", 1.0),
            full.get("high_freq_factor", 4.0), full.get("original_max_position_embeddings", 8192))
    if use_torch is None:
        try:
            import torch  # noqa: F401
        except ImportError:
            use_torch = False
        else:
            use_torch = True
    return _llama3_factors_torch(*args) if use_torch else _llama3_factors_numpy(*args)


def _llama3_factors_torch(base, dim, factor, low_freq_factor, high_freq_factor, old_context_len) -> np.ndarray:
    # upstream's code, line for line
    import torch

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def _llama3_factors_numpy(base, dim, factor, low_freq_factor, high_freq_factor, old_context_len) -> np.ndarray:
    # the same float32 steps (torch's ``scalar / tensor`` is ``reciprocal(tensor) * scalar``)
    f32 = np.float32
    powers = np.power(f32(base), np.arange(0, dim, 2, dtype=f32) / f32(dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for power in powers:
        wavelen = (f32(1) / (f32(1) / power)) * f32(2 * math.pi)
        if wavelen < high_freq_wavelen:
            rope_factors.append(f32(1))
        elif wavelen > low_freq_wavelen:
            rope_factors.append(f32(factor))
        else:
            smooth = ((f32(1) / wavelen) * f32(old_context_len) - f32(low_freq_factor)) / f32(
                high_freq_factor - low_freq_factor)
            rope_factors.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return np.asarray(rope_factors, dtype=f32)
