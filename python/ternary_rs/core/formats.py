"""What a stored tensor is: the type tables and raw-bytes helpers every stage shares.

This module sits at the bottom (it imports only ``_core``, NumPy and ml_dtypes): the one list of ternary
GGUF types (:data:`TERNARY_GGUF_TYPES`) and every table derived from it (ggml type ids, native group
sizes, block layouts, the types ``convert`` writes), float storage types, safetensors dtypes, the packed
layouts of safetensors checkpoints, raw float bytes -> float32, and exact-ternary detection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._core import GROUP_SIZES, UnsupportedTypeError


class TernaryGgufType(NamedTuple):
    """One ternary GGUF tensor type (docs/formats.md#ggml-type-ids)."""

    name: str
    type_id: int  # ggml type id (Q2_0_G128 shares 42 with upstream Q2_0: told apart by block size)
    group: int | None  # native group size (None: one scale per tensor)
    block_values: int | None  # values per block (None: not block-packed)
    block_bytes: int | None
    scale_offset: int | None  # byte offset of the fp16 scale in a block
    code_bytes: tuple[int, int] | None  # (first, last) byte range of 2-bit code fields; None: base-3 packing


# The one list of ternary GGUF types; every table below is derived from it.
TERNARY_GGUF_TYPES = (
    TernaryGgufType("TQ1_0", 34, 256, 256, 54, 52, None),
    TernaryGgufType("TQ2_0", 35, 256, 256, 66, 64, (0, 64)),
    TernaryGgufType("PQ2_0", 142, 128, 128, 34, 0, (2, 34)),
    TernaryGgufType("PTQ1_0", 143, 128, 128, 28, 26, None),
    TernaryGgufType("Q2_0", 42, 64, 64, 18, 0, (2, 18)),
    TernaryGgufType("Q2_0_G128", 42, 128, 128, 34, 0, (2, 34)),
    TernaryGgufType("Q1_0", 41, 128, 128, 18, 0, None),
    TernaryGgufType("STQ1_0", 43, 256, 256, 42, 40, None),
    TernaryGgufType("I2_S", 36, None, None, None, None, None),
)
_BY_NAME = {t.name: t for t in TERNARY_GGUF_TYPES}

# Float storage types: bytes per element.
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
GGUF_FLOAT_TYPE_IDS = {"F32": 0, "F16": 1, "BF16": 30}
# Packed ternary GGUF source types and their native group size (None: one scale per tensor).
GGUF_TERNARY_GROUPS = {t.name: t.group for t in TERNARY_GGUF_TYPES}
#: GGUF tensor types decoded from their raw tensor bytes alone.
GGUF_FORMATS = tuple(GGUF_TERNARY_GROUPS)
# What ``convert`` reads from a GGUF: these ternary types and the float types; nothing else.
GGUF_READABLE_TYPES = tuple(GGUF_TERNARY_GROUPS) + tuple(FLOAT_BYTES)
# Where the fp16 scale sits in each block: (values per block, bytes per block, scale byte offset,
# (first, last) byte range of 2-bit code fields or None for base-3 packings, where every byte is valid).
GGUF_BLOCKS = {t.name: (t.block_values, t.block_bytes, t.scale_offset, t.code_bytes)
               for t in TERNARY_GGUF_TYPES if t.block_values is not None}


def gguf_output_types(*names: str) -> dict[str, tuple[int, int, int]]:
    """``name -> (type id, values per block, bytes per block)`` of the ternary types a writer emits."""
    return {n: (_BY_NAME[n].type_id, _BY_NAME[n].block_values, _BY_NAME[n].block_bytes) for n in names}


# llama.cpp ``general.file_type`` of a whole file of one ternary type (docs/formats.md#gguf-file-type):
# LLAMA_FTYPE_MOSTLY_TQ1_0 / TQ2_0, LLAMA_FTYPE_MOSTLY_STQ1_0 = 42 as PR #22836 numbers it since its rebase
# past Q1_0/Q2_0, and the PrismML fork's LLAMA_FTYPE_MOSTLY_PQ2_0 = 141. Each writer picks the ones it sets.
LLAMA_FILE_TYPES = {"TQ1_0": 36, "TQ2_0": 37, "STQ1_0": 42, "PQ2_0": 141}

# ggml type names ternary_rs knows that are not ternary (the ternary ones come from TERNARY_GGUF_TYPES).
_OTHER_GGML_TYPE_IDS = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q8_1": 9,
    "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_K": 15, "IQ2_XXS": 16,
    "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23,
    "I8": 24, "I16": 25, "I32": 26, "I64": 27, "F64": 28, "IQ1_M": 29, "BF16": 30,
    "MXFP4": 39, "NVFP4": 40,
}
# ggml type name -> id, by id (Q2_0_G128 shares id 42 with upstream Q2_0).
GGML_TYPE_IDS: dict[str, int] = dict(sorted(
    {**_OTHER_GGML_TYPE_IDS, **{t.name: t.type_id for t in TERNARY_GGUF_TYPES}}.items(), key=lambda kv: kv[1]))

# Dense detection works on groups of this many values, then merges them into larger groups.
DETECT_GROUP = 32
DETECT_CHUNK_BYTES = 64 << 20


def _safetensors_numpy_dtypes() -> dict[str, Any]:
    d: dict[str, Any] = {
        "F64": np.float64, "F32": np.float32, "F16": np.float16,
        "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
        "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
        "BOOL": np.bool_, "C64": np.complex64,
    }
    try:
        import ml_dtypes
    except ImportError:  # BF16/F8 then raise a clear error in tensor()
        return d
    d["BF16"] = ml_dtypes.bfloat16
    d["F8_E4M3"] = ml_dtypes.float8_e4m3fn
    d["F8_E5M2"] = ml_dtypes.float8_e5m2
    d["F8_E4M3FNUZ"] = ml_dtypes.float8_e4m3fnuz
    d["F8_E5M2FNUZ"] = ml_dtypes.float8_e5m2fnuz
    if hasattr(ml_dtypes, "float8_e8m0fnu"):
        d["F8_E8M0"] = ml_dtypes.float8_e8m0fnu
    return d


# safetensors dtype name -> NumPy dtype (the reader's views, the writer's dtype names).
SAFETENSORS_NUMPY_DTYPES = _safetensors_numpy_dtypes()


def non_ternary_gguf_tensors(tensors) -> list[tuple[str, str]]:
    """``(name, type)`` of the GGUF tensors whose type is neither ternary nor float (Q8_0, Q4_0, Q6_K …).

    The one rule ``convert``, ``verify``, ``inspect`` and ``plan`` share: such a tensor makes the file not a
    ternary model (``convert`` refuses it, ``verify`` fails, ``inspect`` says "really ternary: NO", ``plan``
    refuses)."""
    return [(name, info.type) for name, info in tensors.items() if info.type not in GGUF_READABLE_TYPES]


def describe_non_ternary_types(bad: Sequence[tuple[str, str]], shown: int = 3) -> str:
    """One sentence for :func:`non_ternary_gguf_tensors`' result: the types, and the first tensors of each."""
    by_type: dict[str, list[str]] = {}
    for name, typ in bad:
        by_type.setdefault(typ, []).append(name)
    parts = []
    for typ, names in sorted(by_type.items(), key=lambda kv: -len(kv[1])):
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        parts.append(f"{typ}: {', '.join(names[:shown])}{more}")
    return (f"not a ternary model: {len(bad)} tensor{'s' if len(bad) != 1 else ''} of non-ternary GGUF "
            f"type{'s' if len(by_type) > 1 else ''} ({'; '.join(parts)}); ternary_rs reads the ternary types "
            f"{', '.join(t for t in GGUF_TERNARY_GROUPS if t != 'Q2_0_G128')} and the float types "
            f"{', '.join(FLOAT_BYTES)}")


def float_view(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw little-endian bytes of a float tensor -> float32 (bf16 widened by a 16-bit shift)."""
    raw = np.asarray(raw).reshape(-1)
    if dtype == "F32":
        return raw.view(np.float32)
    if dtype == "F16":
        return raw.view(np.float16).astype(np.float32)
    if dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise UnsupportedTypeError(f"float type {dtype} (supported: {sorted(FLOAT_BYTES)})")


def row_chunks(n_rows: int, row_bytes: int, chunk_bytes: int = DETECT_CHUNK_BYTES):
    """``(r0, r1)`` row ranges of about ``chunk_bytes`` each (memory stays bounded on huge tensors)."""
    step = max(1, chunk_bytes // max(1, row_bytes))
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)


def dense_ternary_group(raw: np.ndarray, dtype: str, shape: Sequence[int]) -> int | None:
    """Largest group size g (from 32..256, dividing K) for which the float matrix is exactly
    ``t · a`` with t ∈ {-1,0,+1} and one fp16-exact ``a`` per g values of a row; None if not ternary.

    Every group of 32 must hold only 0 and ±(its absmax); a larger group is feasible when all non-zero
    32-group scales inside it are equal (an all-zero 32-group fits any scale).
    """
    if len(shape) != 2:
        return None
    n, k = int(shape[0]), int(shape[1])
    if k % DETECT_GROUP or n == 0:
        return None
    feasible = [g for g in GROUP_SIZES if k % g == 0]
    row_bytes = k * FLOAT_BYTES[dtype]
    raw = np.asarray(raw).reshape(n, row_bytes)
    for r0, r1 in row_chunks(n, row_bytes):
        w = float_view(raw[r0:r1], dtype).reshape(r1 - r0, k // DETECT_GROUP, DETECT_GROUP)
        mag = np.abs(w)
        a = mag.max(axis=-1)
        if not np.isfinite(a).all():
            return None
        if not np.all((mag == 0) | (mag == a[..., None])):
            return None
        if not np.array_equal(a.astype(np.float16).astype(np.float32), a):
            return None  # the scale would not survive fp16
        for g in list(feasible):
            if g == DETECT_GROUP:
                continue
            s = a.reshape(r1 - r0, k // g, g // DETECT_GROUP)
            top = s.max(axis=-1, keepdims=True)
            if not np.all((s == top) | (s == 0)):
                feasible.remove(g)
    return max(feasible) if feasible else None


def packed_safetensors(tensors) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Packed ternary weights of a safetensors checkpoint: main tensor -> (kind, auxiliary tensors).

    ``<p>.qweight`` + ``<p>.scales`` (ternary_rs canonical), ``<p>.weight`` U32 + ``<p>.scales`` +
    ``<p>.biases`` (MLX 2-bit), ``<p>.weight`` U8/I8 + ``<p>.weight_scale`` (transformers BitNet).
    """
    names = set(tensors)
    packs: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name, info in tensors.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith(".qweight") and f"{base}.scales" in names:
            packs[name] = ("canonical", (f"{base}.scales",))
        elif name.endswith(".weight") and info.type == "U32" and {f"{base}.scales", f"{base}.biases"} <= names:
            packs[name] = ("MLX", (f"{base}.scales", f"{base}.biases"))
        elif name.endswith(".weight") and info.type in ("U8", "I8") and f"{name}_scale" in names:
            packs[name] = ("BITNET", (f"{name}_scale",))
    return packs
