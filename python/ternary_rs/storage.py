"""What a stored tensor is: the tables and helpers shared by ``convert``, ``inspect``/``verify`` and ``plan``.

This module sits below all three (it imports only ``_core`` and NumPy), so none of them needs another:
float storage types and their GGUF ids, ternary GGUF types and their native group sizes, the packed
layouts of safetensors checkpoints, raw float bytes -> float32, and exact-ternary detection.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._core import GROUP_SIZES, UnsupportedTypeError

# Float storage types: bytes per element.
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
GGUF_FLOAT_TYPE_IDS = {"F32": 0, "F16": 1, "BF16": 30}
# Packed ternary GGUF source types and their native group size (None: one scale per tensor).
GGUF_TERNARY_GROUPS = {
    "TQ1_0": 256, "TQ2_0": 256, "PQ2_0": 128, "PTQ1_0": 128,
    "Q2_0": 64, "Q2_0_G128": 128, "Q1_0": 128, "STQ1_0": 256, "I2_S": None,
}
# What ``convert`` reads from a GGUF: these ternary types and the float types; nothing else.
GGUF_READABLE_TYPES = tuple(GGUF_TERNARY_GROUPS) + tuple(FLOAT_BYTES)
# Dense detection works on groups of this many values, then merges them into larger groups.
DETECT_GROUP = 32
DETECT_CHUNK_BYTES = 64 << 20


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
