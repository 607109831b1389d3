"""Top-k / top-p masking of CPU logits without sorting the vocabulary (``_core.top_k_top_p_mask_cpu``).

vLLM's CPU sampler applies top-p (and top-k with it) by sorting every row of the logits: at a 248 320-token
vocabulary that is ~18 ms per sequence and step on two Zen 5 cores (152 ms for 16 sequences, 640 ms for 64)
— longer than the 27B model's decode step at 16, and than the 1.7B's whole step at 64. Checkpoints ship
``generation_config.json`` defaults with top-p (Qwen3: top-p 0.95, top-k 20), which vLLM applies to every
request that does not set its own, so this is the common case, not a corner. The kernel selects instead
of sorting (the rules, and where a kept set can differ from vLLM's — ties at the boundary only — are in
``rust/ternary-core/src/sampling.rs``). The plugin puts :func:`apply_top_k_top_p` in vLLM's place on CPU
(``TERNARY_RS_CPU_SAMPLER=vllm`` keeps vLLM's).
"""

from __future__ import annotations

import torch

from .. import _core
from .cpu import ours_unless_vllm

SAMPLER_ENV = "TERNARY_RS_CPU_SAMPLER"


def enabled() -> bool:
    """Whether the plugin replaces vLLM's CPU top-k / top-p (``TERNARY_RS_CPU_SAMPLER``: ``auto``, the
    default, or ``vllm``)."""
    return ours_unless_vllm(SAMPLER_ENV)


def mask_top_k_top_p_(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> bool:
    """Mask ``logits`` (``[rows, vocab]`` float32 on CPU) in place to each row's top-k, then top-p set.
    False, with ``logits`` untouched, where the kernel does not take the call (another dtype or device,
    a non-contiguous tensor, a NaN logit, a p outside (0, 1]): the caller then uses its own path."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 \
            or not logits.is_contiguous() or logits.numel() == 0:
        return False
    rows, vocab = logits.shape
    kk = None if k is None else k.to(device="cpu", dtype=torch.int64).contiguous()
    pp = None if p is None else p.to(device="cpu", dtype=torch.float32).contiguous()
    if (kk is not None and kk.numel() != rows) or (pp is not None and pp.numel() != rows):
        return False
    try:
        _core.top_k_top_p_mask_cpu(logits.data_ptr(), rows, vocab, 0 if kk is None else kk.data_ptr(),
                                   0 if pp is None else pp.data_ptr())
    except ValueError:
        return False
    return True


def fast_apply_top_k_top_p(original):
    """vLLM's ``apply_top_k_top_p(logits, k, p)`` with top-p on CPU taken by the kernel; top-k alone (vLLM
    already uses ``topk`` there, no sort) and anything the kernel declines go to ``original``."""

    def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        if p is not None and mask_top_k_top_p_(logits, k, p):
            return logits
        return original(logits, k, p)

    apply_top_k_top_p._ternary_rs = True  # type: ignore[attr-defined]
    apply_top_k_top_p.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_top_k_top_p
