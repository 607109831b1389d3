"""Decode one tensor of an open checkpoint (or a path to one) to the canonical :class:`TernaryTensor`:
the tensor's type (or an override) picks the codec, companion tensors are found by name (BitNet
``weight_scale``, MLX ``scales``/``biases``), a ternary_rs checkpoint's own pairs come back as views."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .. import _core
from .._core import TensorNotFoundError
from ..core.formats import GGUF_FORMATS
from ..core.tensor import DENSE_TYPES, REFUSED_LUT_TYPES, TernaryTensor, decode_bytes, repack, rows_cols
from .reader import open as open_checkpoint

__all__ = ["decode"]


def _companion(name: str, suffix: str) -> str:
    base = name[: -len("weight")] if name.endswith("weight") else name + "."
    return base + suffix


def _linear_class_from(config: Mapping | None) -> str | None:
    if not config:
        return None
    qc = config.get("quantization_config") or {}
    return qc.get("linear_class")


def _canonical_prefix(tensors: Mapping[str, Any], name: str) -> str | None:
    """``<prefix>`` when ``name`` names one of our own canonical pairs (``<prefix>.qweight`` +
    ``<prefix>.scales``): the qweight itself, the bare prefix, or ``<prefix>.weight`` the pair replaces."""
    for prefix in (name[: -len(".qweight")] if name.endswith(".qweight") else None,
                   name if name not in tensors else None,
                   name[: -len(".weight")] if name.endswith(".weight") and name not in tensors else None):
        if prefix and f"{prefix}.qweight" in tensors and f"{prefix}.scales" in tensors:
            return prefix
    return None


def _decode_canonical(f: Any, prefix: str, group_size: int | None, requantize: bool) -> TernaryTensor:
    """A ternary_rs checkpoint's pair, zero-copy, validated (code 3, non-finite scales), regrouped on request."""
    qinfo, sinfo = f.tensors[f"{prefix}.qweight"], f.tensors[f"{prefix}.scales"]
    if qinfo.type != "U8" or sinfo.type != "F16" or len(qinfo.shape) != 2 or len(sinfo.shape) != 2:
        raise _core.UnsupportedTypeError(
            f"tensor '{prefix}': a canonical pair is {prefix}.qweight U8 [N, K/4] + {prefix}.scales F16 [N, K/g], "
            f"got {qinfo.type} {list(qinfo.shape)} + {sinfo.type} {list(sinfo.shape)}")
    try:
        t = TernaryTensor(f.tensor(f"{prefix}.qweight"), f.tensor(f"{prefix}.scales"), name=prefix)
    except (TypeError, ValueError) as e:
        if isinstance(e, _core.TernaryError):
            raise
        raise _core.ValidationError(f"tensor '{prefix}': {e}") from None
    return t if group_size is None else repack(t, group_size, requantize)


def decode(file_or_path: Any, name: str, *, group_size: int | None = None, format: str | None = None,
           linear_class: str | None = None, requantize: bool = False) -> TernaryTensor:
    """Decode tensor ``name`` of a file opened with :func:`ternary_rs.open` (or a path to one).

    A ternary_rs checkpoint's own canonical pairs decode by ``<prefix>.qweight``, by the bare
    ``<prefix>`` or by ``<prefix>.weight`` (the weight the pair replaces); the arrays are views.

    The format comes from the tensor's type unless ``format`` overrides it. Companion tensors are
    found by name: BitNet ``<prefix>.weight_scale`` (uint8 weights), MLX ``<prefix>.scales`` and
    ``<prefix>.biases`` (uint32 weights). BitNet's scale convention comes from the checkpoint's
    ``quantization_config.linear_class`` (default ``bitlinear``: reciprocal) unless ``linear_class``
    overrides it.
    """
    f = file_or_path
    if isinstance(f, (str, os.PathLike)):
        f = open_checkpoint(f)
    # Bytes read from a file that shrank or changed under its map are not the tensor: say so instead
    # (a shrunk map reads zeros, see TernaryFile.check_unchanged).
    check = getattr(f, "check_unchanged", None)
    try:
        t = _decode_open(f, name, group_size=group_size, format=format, linear_class=linear_class,
                         requantize=requantize)
    except _core.TernaryError:
        if check is not None:
            check()
        raise
    if check is not None:
        check()
    return t


def _decode_open(f: Any, name: str, *, group_size: int | None, format: str | None, linear_class: str | None,
                 requantize: bool) -> TernaryTensor:
    prefix = _canonical_prefix(f.tensors, name)
    if prefix is not None and format is None:
        return _decode_canonical(f, prefix, group_size, requantize)
    try:
        info = f.tensors[name]
    except KeyError:
        raise TensorNotFoundError(f"no tensor named {name!r} in {getattr(f, 'path', f)!r}") from None
    kind = (format or info.type).upper()
    shape = tuple(info.shape)
    big_endian = getattr(f, "byte_order", "little") == "big"
    if big_endian and kind in GGUF_FORMATS:
        raise _core.UnsupportedTypeError(
            f"tensor '{name}': {kind} blocks in a big-endian GGUF file are not supported (llama.cpp writes "
            "quantized blocks little-endian only); convert the file on a little-endian host")
    if kind in REFUSED_LUT_TYPES or kind in GGUF_FORMATS:
        return decode_bytes(kind, f.raw(name), shape, group_size=group_size, requantize=requantize, name=name)
    if kind in ("U8", "BITNET"):
        scale_name = _companion(name, "weight_scale")
        if scale_name not in f.tensors:
            raise _core.UnsupportedTypeError(
                f"tensor '{name}': uint8 weight without a companion '{scale_name}' is not a BitNet pack")
        rows, cols = rows_cols(shape, name)
        lc = linear_class or _linear_class_from(getattr(f, "config", None))
        return decode_bytes("BITNET", f.raw(name), (rows * 4, cols), group_size=group_size,
                            requantize=requantize, weight_scale=f.tensor(scale_name), linear_class=lc, name=name)
    if kind in ("U32", "MLX"):
        s_name, b_name = _companion(name, "scales"), _companion(name, "biases")
        if s_name not in f.tensors or b_name not in f.tensors:
            raise _core.UnsupportedTypeError(
                f"tensor '{name}': uint32 weight without companions '{s_name}' and '{b_name}' is not an MLX pack")
        rows, cols = rows_cols(shape, name)
        return decode_bytes("MLX", f.tensor(name), (rows, cols * 16), group_size=group_size,
                            requantize=requantize, scales=f.tensor(s_name), biases=f.tensor(b_name), name=name)
    if kind in DENSE_TYPES or kind == "DENSE":
        if big_endian:  # byte-swap through NumPy (a copy); the Rust decoder reads little-endian
            arr = f.tensor(name)
            return decode_bytes("DENSE", arr.astype(arr.dtype.newbyteorder("=")), shape, group_size=group_size,
                                name=name)
        dt = info.type.upper() if info.type.upper() in DENSE_TYPES else None
        return decode_bytes("DENSE", f.raw(name), shape, group_size=group_size, dtype=dt, name=name)
    hint = ""
    if getattr(info, "type_id", None) in (38, 39):
        hint = (f" (GGUF type {info.type_id} is also bitnet.cpp's {'TL1' if info.type_id == 38 else 'TL2'}, a "
                "kernel-tiled LUT layout that cannot be decoded portably)")
    raise _core.UnsupportedTypeError(
        f"tensor '{name}': type {info.type} is not a ternary format{hint}; supported: {', '.join(GGUF_FORMATS)}, "
        "U8 (+weight_scale, BitNet), U32 (+scales/biases, MLX), F16/BF16/F32 (dense ternary)")
