"""vLLM side of Bonsai 2's Hadamard rotation (``quantization_config["hadamard"]``).

:class:`~ternary_rs.vllm.config.TernaryConfig` calls

* :func:`make_input_transform` for each ternary linear / lm_head, after its weights are loaded: the returned
  callable maps the layer input ``x`` to ``fwht(x[..., gather] · s)`` (``None`` if the layer is not rotated);
* :func:`make_embedding_transform` for the embedding: rows stored inverse-rotated come back as
  ``fwht(row) · s``.

The rotation description is parsed and validated once (:class:`ternary_rs.core.hadamard.HadamardSpec`); anything
malformed or of an unknown version raises :class:`ternary_rs.ValidationError` while the model loads, so a
rotated checkpoint is never served without its rotation.

Tensor parallelism: a column-parallel layer sees the whole input, so it transforms the whole row. A
row-parallel layer (``o_proj``, ``down_proj``, ``out_proj``) sees only its K-slice; since the transform is
block-diagonal, the slice's own transform is exact when the slice is made of whole blocks (then the sign
slice is used). Otherwise — or when a GDN permutation mixes heads across slices — the input is all-gathered
across the TP group, transformed whole, and the local slice taken (one extra all-gather per such layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._core import ValidationError
from ..core import hadamard as _h
from ..serving import ops

# vLLM fused layer → the checkpoint (Hugging Face) layers it is made of (Qwen3.5 / Qwen3 / Llama names).
FUSED_LAYERS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}

_SPECS: dict[int, tuple[Any, _Index]] = {}


class _Index:
    """A parsed spec with prefix-independent lookups (``layers.N.…`` / ``lm_head`` / ``embed_tokens``)."""

    def __init__(self, spec: _h.HadamardSpec):
        self.spec = spec
        self.layers = {_h.canonical_module_name(n): v for n, v in spec.layers.items()}
        self.inverse = {_h.canonical_module_name(n) for n in spec.inverse_embeddings}
        if len(self.layers) != len(spec.layers):
            raise ValidationError(f"{spec.source}: two rotated layers map to the same module name")


def spec_index(hadamard_cfg: Any) -> _Index:
    """Parse (once per config object) and validate the checkpoint's hadamard entry."""
    hit = _SPECS.get(id(hadamard_cfg))
    if hit is not None and hit[0] is hadamard_cfg:
        return hit[1]
    index = _Index(_h.HadamardSpec.from_config(hadamard_cfg))
    _SPECS[id(hadamard_cfg)] = (hadamard_cfg, index)
    return index


class HadamardInputTransform:
    """``x → [all-gather] → fwht(x[..., gather] · s) → [local slice]`` with device tensors cached per device."""

    def __init__(
        self,
        prefix: str,
        block_size: int,
        signs: np.ndarray,
        gather: np.ndarray | None = None,
        local_slice: tuple[int, int] | None = None,
        all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
        inverse: bool = False,
    ):
        self.prefix = prefix
        self.block_size = int(block_size)
        self.width = int(signs.size)
        self.inverse = inverse
        self.local_slice = local_slice
        self.all_gather = all_gather
        self._signs = torch.from_numpy(np.asarray(signs, dtype=np.float32).copy())
        self._gather = None if gather is None else torch.from_numpy(np.asarray(gather, dtype=np.int32).copy())
        self._device = torch.device("cpu")

    def _on(self, device: torch.device) -> None:
        if device != self._device:
            self._signs = self._signs.to(device)
            self._gather = None if self._gather is None else self._gather.to(device)
            self._device = device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_gather is not None:
            x = self.all_gather(x)
        if x.shape[-1] != self.width:
            raise ValueError(
                f"hadamard transform of '{self.prefix}': input width {x.shape[-1]} != rotated width {self.width}"
            )
        self._on(x.device)
        y = ops.fwht(x, self.block_size, self._signs, self.inverse, self._gather)
        if self.local_slice is not None:
            y = y[..., self.local_slice[0] : self.local_slice[1]].contiguous()
        return y

    def __repr__(self) -> str:
        return (
            f"HadamardInputTransform({self.prefix!r}, width={self.width}, block={self.block_size}, "
            f"gather={self._gather is not None}, slice={self.local_slice}, all_gather={self.all_gather is not None})"
        )


def _tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(x.contiguous(), dim=-1)


def _listed_parts(index: _Index, prefix: str) -> tuple[list[str], list[str]]:
    key = _h.canonical_module_name(prefix)
    if key in index.layers:
        return [key], [key]
    head, _, proj = key.rpartition(".")
    parts = [f"{head}.{p}" if head else p for p in FUSED_LAYERS.get(proj, ())]
    return parts, [p for p in parts if p in index.layers]


def make_input_transform(
    hadamard_cfg: Any,
    prefix: str,
    layer: torch.nn.Module,
    tp_rank: int,
    tp_size: int,
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The input transform of vLLM layer ``prefix`` (``None``: not rotated). Raises on anything inconsistent.

    ``all_gather`` (tests) replaces the TP all-gather used when a row-parallel slice is not block-aligned.
    """
    index = spec_index(hadamard_cfg)
    spec = index.spec
    parts, listed = _listed_parts(index, prefix)
    key = _h.canonical_module_name(prefix)
    if not listed:
        # A head tied to an inverse-rotated embedding E' computes E·h = E'·(H·D·h): the forward transform.
        if key == "lm_head" and "embed_tokens" in index.inverse and getattr(layer, "ternary_tied", False):
            width = int(getattr(layer, "embedding_dim", 0) or getattr(layer, "ternary_in_features", 0))
            if width not in spec.signs:
                raise ValidationError(f"{spec.source}: tied lm_head width {width} has no sign vector")
            return HadamardInputTransform(prefix, spec.block_size, spec.signs[width])
        return None
    if len(listed) != len(parts):
        raise ValidationError(
            f"{spec.source}: fused layer '{prefix}' has rotated parts {listed} and unrotated parts "
            f"{sorted(set(parts) - set(listed))}; one input cannot be both"
        )
    entries = {index.layers[p] for p in listed}
    if len(entries) != 1:
        raise ValidationError(f"{spec.source}: parts of fused layer '{prefix}' disagree on the rotation: {entries}")
    width, perm = entries.pop()
    full_in = getattr(layer, "input_size", None)
    if full_in is None:  # ParallelLMHead: the input is the whole hidden state
        full_in = getattr(layer, "embedding_dim", width)
    if int(full_in) != width:
        raise ValidationError(
            f"{spec.source}: layer '{prefix}' is listed with input width {width} but has {full_in} inputs"
        )
    signs = spec.signs[width]
    gather = perm.gather() if perm is not None else None
    local_in = int(getattr(layer, "input_size_per_partition", width))
    if local_in == width or tp_size == 1:
        return HadamardInputTransform(prefix, spec.block_size, signs, gather)
    start, stop = tp_rank * local_in, (tp_rank + 1) * local_in
    if local_in % spec.block_size == 0 and gather is None:
        # Whole blocks: the local slice's transform is the slice of the full transform.
        return HadamardInputTransform(prefix, spec.block_size, signs[start:stop])
    return HadamardInputTransform(
        prefix, spec.block_size, signs, gather, local_slice=(start, stop), all_gather=all_gather or _tp_all_gather
    )


def make_embedding_transform(hadamard_cfg: Any, prefix: str, *_args, **_kwargs) -> Callable | None:
    """Rows of an inverse-rotated embedding → ``fwht(row) · s`` (``None`` if ``prefix`` is not listed)."""
    index = spec_index(hadamard_cfg)
    key = _h.canonical_module_name(prefix)
    if key in index.layers:
        raise ValidationError(
            f"{index.spec.source}: embedding '{prefix}' is listed as a rotated linear layer, not an embedding"
        )
    if key not in index.inverse:
        return None
    spec = index.spec
    transforms: dict[int, HadamardInputTransform] = {}

    def transform(rows: torch.Tensor) -> torch.Tensor:
        width = rows.shape[-1]
        t = transforms.get(width)
        if t is None:
            if width not in spec.signs:
                raise ValidationError(
                    f"{spec.source}: embedding '{prefix}' rows have width {width}, no sign vector of that width"
                )
            t = transforms[width] = HadamardInputTransform(prefix, spec.block_size, spec.signs[width], inverse=True)
        return t(rows)

    return transform


def refuse_dense(hadamard_cfg: Any, prefix: str) -> None:
    """Raise if vLLM is about to serve ``prefix`` dense (no ternary method, so no input transform) although
    the rotation lists it: its stored weight is rotated and would silently give garbage."""
    index = spec_index(hadamard_cfg)
    _, listed = _listed_parts(index, prefix)
    key = _h.canonical_module_name(prefix)
    if listed or key in index.inverse:
        raise ValidationError(
            f"{index.spec.source}: '{prefix}' is Hadamard-rotated ({listed or [key]}) but would be served as a "
            "dense layer without its transform; store it ternary (qweight/scales) or un-rotate it when converting"
        )
