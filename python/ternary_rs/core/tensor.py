"""Bit-exact ternary codecs and the canonical :class:`TernaryTensor`.

The canonical form (docs/checkpoint.md#canonical-layout): a linear weight ``W[N, K]`` is

* ``qweight`` — ``uint8 [N, K/4]``; ``W[n, k]`` is code ``c = t + 1`` in byte ``k // 4`` at bits
  ``2·(k % 4)`` (least significant first); code 3 is invalid;
* ``scales`` — ``float16 [N, K/g]``; ``W[n, k] = (c − 1) · scales[n, k // g]``, ``g ∈ {32, 64, 128, 256}``.

Every source format decodes to it (:func:`ternary_rs.sources.decode.decode` for a tensor in a file,
:func:`decode_bytes` for raw buffers) and :func:`encode` writes the GGUF/BitNet/MLX forms back. All heavy work runs in Rust with the
GIL released, on the pool sized by :func:`ternary_rs.set_num_threads`.

Zero-copy: MLX 2-bit packs *are* canonical bytes — their ``qweight``/``scales`` are views of the source
arrays (after a read-only validation pass). Block formats (PQ2_0, Q2_0, …) need one pass to strip the
per-block scales.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .. import _core
from .._core import InvalidArgumentError
from .formats import GGUF_FORMATS

__all__ = [
    "TernaryTensor",
    "decode_bytes",
    "encode",
    "pack_codes",
    "repack",
    "ternarize",
    "unpack_codes",
    "GGUF_FORMATS",
]

DENSE_TYPES = ("F16", "BF16", "F32")
# bitnet.cpp's kernel-tiled LUT layouts: refused by name, with their GGUF type id.
REFUSED_LUT_TYPES = {"TL1": 38, "TL2": 39}


def _bf16_numpy_dtype():
    try:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
        return None


def _dtype_name(dtype: Any) -> str:
    """Normalise a dtype given as str, NumPy dtype, ml_dtypes type or torch.dtype."""
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
    elif _is_torch_dtype(dtype):
        key = str(dtype).lower().removeprefix("torch.")
    else:
        try:
            key = np.dtype(dtype).name
        except TypeError:
            key = str(dtype)
    aliases = {
        "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
        "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
        "bfloat16": "bfloat16", "bf16": "bfloat16",
    }
    if key not in aliases:
        raise InvalidArgumentError(f"dequantize dtype must be float32, float16 or bfloat16, not {dtype!r}")
    return aliases[key]


def _is_torch_dtype(dtype: Any) -> bool:
    return type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"


def _as_u8(data: Any) -> np.ndarray:
    """A flat, C-contiguous uint8 view of bytes / memoryview / NumPy array (copy only if strided)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(data), dtype=np.uint8)


def _scale_bits(scales: np.ndarray) -> np.ndarray:
    scales = np.asarray(scales)
    if scales.dtype != np.float16:
        raise InvalidArgumentError(f"scales must be float16, got {scales.dtype}")
    return np.ascontiguousarray(scales).view(np.uint16)


def _from_core(result, name: str, *, validate: bool = False) -> TernaryTensor:
    qweight, scale_bits, group = result
    return TernaryTensor(qweight, scale_bits.view(np.float16), group, name=name, validate=validate)


class TernaryTensor:
    """A canonical ternary weight ``W[N, K]``: ``qweight`` uint8 ``[N, K/4]``, ``scales`` float16
    ``[N, K/g]``.

    The arrays may be read-only views of a memory-mapped file; treat them as immutable. Construction
    validates (no code 3, finite scales) unless ``validate=False`` (used internally after a decoder that
    already validated).
    """

    __slots__ = ("qweight", "scales", "group_size", "name")

    def __init__(self, qweight: np.ndarray, scales: np.ndarray, group_size: int | None = None, *,
                 name: str = "<tensor>", validate: bool = True):
        qweight = np.asarray(qweight)
        scales = np.asarray(scales)
        if qweight.dtype != np.uint8 or qweight.ndim != 2:
            raise InvalidArgumentError(f"qweight must be a 2-D uint8 array [N, K/4], got {qweight.dtype} {qweight.shape}")
        if scales.dtype != np.float16 or scales.ndim != 2:
            raise InvalidArgumentError(f"scales must be a 2-D float16 array [N, K/g], got {scales.dtype} {scales.shape}")
        rows, cols = qweight.shape[0], qweight.shape[1] * 4
        if scales.shape[0] != rows or scales.shape[1] == 0 or cols % scales.shape[1]:
            raise InvalidArgumentError(f"scales {scales.shape} do not fit qweight {qweight.shape} (K = {cols})")
        inferred = cols // scales.shape[1]
        if group_size is not None and group_size != inferred:
            raise InvalidArgumentError(f"group_size {group_size} does not match scales {scales.shape} for K = {cols}")
        if inferred not in _core.GROUP_SIZES:
            raise InvalidArgumentError(f"group size {inferred} is not one of {', '.join(map(str, _core.GROUP_SIZES))}")
        self.qweight = qweight
        self.scales = scales
        self.group_size = inferred
        self.name = name
        if validate:
            _core.validate(*self._args(), tensor=name)

    # -- shape ---------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` = ``(out_features, in_features)``."""
        return (self.qweight.shape[0], self.qweight.shape[1] * 4)

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def _args(self):
        q = np.ascontiguousarray(self.qweight)
        s = _scale_bits(self.scales)
        return q, s, self.shape[0], self.shape[1], self.group_size

    def __repr__(self) -> str:
        return f"TernaryTensor({self.name!r}, shape={self.shape}, group_size={self.group_size})"

    def equal(self, other: TernaryTensor) -> bool:
        """Bitwise equality of codes and scales (same group size)."""
        return (self.group_size == other.group_size
                and np.array_equal(self.qweight, other.qweight)
                and np.array_equal(self.scales.view(np.uint16), other.scales.view(np.uint16)))

    # -- views -----------------------------------------------------------------------------------
    def trits(self) -> np.ndarray:
        """int8 ``[N, K]`` with values in {-1, 0, 1}."""
        return _core.unpack_codes(np.ascontiguousarray(self.qweight))

    def dequantize(self, dtype: Any = "float32", *, out: Any = None):
        """Dense ``W = t · scale``. ``dtype``: float32, float16 or bfloat16 (str, NumPy dtype, or a
        ``torch.dtype`` — then a torch tensor is returned). The product is exact in f32 and rounded
        once (nearest even) to the output dtype. A NumPy bfloat16 result uses ``ml_dtypes``; without it
        a torch tensor is returned. ``out``: an existing C-contiguous ``[N, K]`` array or CPU tensor of
        that dtype to fill (no allocation)."""
        name = _dtype_name(dtype)
        want_torch = _is_torch_dtype(dtype) or (out is not None and not isinstance(out, np.ndarray))
        if out is None:
            if want_torch or (name == "bfloat16" and _bf16_numpy_dtype() is None):
                import torch

                out = torch.empty(self.shape, dtype=getattr(torch, name))
                want_torch = True
            else:
                out = np.empty(self.shape, dtype=np.float32 if name == "float32" else np.uint16)
        if isinstance(out, np.ndarray):
            target = out if name == "float32" or out.dtype == np.uint16 else out.view(np.uint16)
        else:  # a torch tensor: write through a NumPy view of its memory
            import torch

            if out.dtype != getattr(torch, name) or out.device.type != "cpu":
                raise InvalidArgumentError(f"out must be a CPU torch.{name} tensor, got {out.dtype} on {out.device}")
            target = out.numpy() if name == "float32" else out.view(torch.int16).numpy().view(np.uint16)
        if target.shape != self.shape:
            raise InvalidArgumentError(f"out has shape {target.shape}, expected {self.shape}")
        _core.dequantize_into(*self._args(), target, dtype=name)
        if want_torch or not isinstance(out, np.ndarray):
            return out
        if name == "float32":
            return out
        if name == "float16":
            return out.view(np.float16)
        return out.view(_bf16_numpy_dtype())

    def to_torch(self):
        """``(qweight, scales)`` as torch tensors sharing memory with this tensor (no copy)."""
        return _to_torch(self.qweight), _to_torch(self.scales)

    def regroup(self, group_size: int, requantize: bool = False) -> TernaryTensor:
        return repack(self, group_size, requantize=requantize)


def _to_torch(arr: np.ndarray):
    import torch

    with warnings.catch_warnings():
        # Views of a read-only mapping: torch warns that writing would be undefined; we never write.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(arr))


# -- helpers on plain arrays ----------------------------------------------------------------------

def pack_codes(trits: np.ndarray) -> np.ndarray:
    """int8 trits ``[..., K]`` (values -1, 0, 1) → canonical code bytes uint8 ``[..., K/4]``."""
    trits = np.asarray(trits)
    if trits.dtype != np.int8:
        if not np.issubdtype(trits.dtype, np.integer):
            raise InvalidArgumentError(f"trits must be an integer array, got {trits.dtype}")
        bad = np.flatnonzero((trits < -1) | (trits > 1))
        if bad.size:
            raise _core.ValidationError(
                f"tensor '<trits>': trit outside {{-1, 0, 1}} (first at index {bad[0]}, {bad.size} in total)")
        trits = trits.astype(np.int8)
    if trits.ndim == 0 or trits.shape[-1] % 4:
        raise InvalidArgumentError(f"the last dimension of trits must be a multiple of 4, got shape {trits.shape}")
    return _core.pack_codes(np.ascontiguousarray(trits))


def unpack_codes(qweight: np.ndarray) -> np.ndarray:
    """Canonical code bytes uint8 ``[..., K/4]`` → int8 trits ``[..., K]`` (code 3 reads as +2)."""
    qweight = np.asarray(qweight)
    if qweight.dtype != np.uint8:
        raise InvalidArgumentError(f"qweight must be uint8, got {qweight.dtype}")
    return _core.unpack_codes(np.ascontiguousarray(qweight))


def rows_cols(shape, name: str = "<tensor>") -> tuple[int, int]:
    shape = tuple(int(x) for x in shape)
    if len(shape) < 2:
        raise _core.ValidationError(
            f"tensor '{name}': a ternary weight needs at least 2 dimensions [N, K], got shape {shape}")
    return int(np.prod(shape[:-1])), shape[-1]


def _default_group(cols: int, preferred: int = 128) -> int:
    if cols % preferred == 0:
        return preferred
    for g in (256, 128, 64, 32):
        if cols % g == 0:
            return g
    raise InvalidArgumentError(f"K = {cols} is not a multiple of any group size {_core.GROUP_SIZES}")


def _float_array(w: Any) -> np.ndarray:
    """Any float array (NumPy incl. ml_dtypes bfloat16, or torch) → C-contiguous float32 (exact)."""
    if type(w).__module__.startswith("torch"):
        w = w.detach().to("cpu").float().numpy()
    return np.ascontiguousarray(np.asarray(w).astype(np.float32, copy=False))


def _dense_bytes(data: Any, dtype: str | None) -> tuple[np.ndarray, str]:
    if type(data).__module__.startswith("torch"):
        import torch

        names = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}
        if data.dtype not in names:
            raise InvalidArgumentError(f"dense ternary tensors must be float16, bfloat16 or float32, not {data.dtype}")
        t = data.detach().to("cpu").contiguous()
        return t.view(torch.uint8).numpy().reshape(-1), names[data.dtype]
    if isinstance(data, np.ndarray) and data.dtype != np.uint8:
        names = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}
        bf16 = _bf16_numpy_dtype()
        if bf16 is not None:
            names[bf16] = "BF16"
        if data.dtype not in names:
            raise InvalidArgumentError(f"dense ternary tensors must be float16, bfloat16 or float32, not {data.dtype}")
        return _as_u8(data), names[data.dtype]
    if dtype is None:
        raise InvalidArgumentError("raw dense bytes need dtype='F16', 'BF16' or 'F32'")
    return _as_u8(data), dtype.upper()


# -- dense recovery -------------------------------------------------------------------------------

# Rows handed to the Rust recovery per call: about this many bytes of source (see recover_dense).
DENSE_CHUNK_BYTES = 64 << 20


def recover_dense(raw: np.ndarray, dtype: str, rows: int, cols: int, group_size: int, *, name: str = "<bytes>",
                  stop=None) -> TernaryTensor:
    """The one dense → canonical recovery (``decode_bytes("DENSE")`` and ``convert`` both use it).

    Every group of ``group_size`` values must be exactly ``{-a, 0, +a}`` with ``a = max|group|`` exactly
    representable in fp16; the canonical scale is that ``a``. An all-zero group gets scale **0**
    (``max|group|``, what llama.cpp's quantizers and :func:`ternarize` write too), never an invented 1.0,
    so the stored scales say exactly what the source held. Anything else is refused (Rust
    ``dense::recover``: first offending index, count).

    Runs ``dense::recover`` (reads the little-endian bytes in place: no float copy) on row chunks of
    about :data:`DENSE_CHUNK_BYTES` of source into one preallocated output, so the working set stays at
    the canonical output plus one chunk, and ``stop`` (a ``threading.Event``) is checked between chunks:
    an interrupted conversion does not wait for a multi-GB tensor. A chunk that fails is re-checked over
    the whole tensor, so the error's first index and count are the tensor's, not the chunk's.
    """
    from concurrent.futures import CancelledError

    raw = np.asarray(raw).reshape(-1)
    elem = {"F16": 2, "BF16": 2, "F32": 4}.get(dtype.upper())
    if elem is None or raw.size != rows * cols * elem or rows == 0 or cols % group_size:
        # not chunkable: let the Rust checks word the error
        return _from_core(_core.recover_dense(raw, dtype, rows, cols, group_size, tensor=name), name)
    row_bytes = cols * elem
    step = max(1, DENSE_CHUNK_BYTES // row_bytes)
    if step >= rows:
        return _from_core(_core.recover_dense(raw, dtype, rows, cols, group_size, tensor=name), name)
    qweight = np.empty((rows, cols // 4), dtype=np.uint8)
    scales = np.empty((rows, cols // group_size), dtype=np.float16)
    for r0 in range(0, rows, step):
        if stop is not None and stop.is_set():
            raise CancelledError(f"tensor '{name}': stopped")
        r1 = min(rows, r0 + step)
        try:
            q, sb, _ = _core.recover_dense(raw[r0 * row_bytes:r1 * row_bytes], dtype, r1 - r0, cols, group_size,
                                           tensor=name)
        except _core.ValidationError:
            _core.recover_dense(raw, dtype, rows, cols, group_size, tensor=name)  # raises the whole-tensor error
            raise
        qweight[r0:r1] = q
        scales[r0:r1] = sb.view(np.float16)
    return TernaryTensor(qweight, scales, group_size, name=name, validate=False)


# -- decoding -------------------------------------------------------------------------------------

def decode_bytes(format: str, data: Any, shape, *, group_size: int | None = None,
                 requantize: bool = False, weight_scale: Any = None, linear_class: str | None = None,
                 scales: np.ndarray | None = None, biases: np.ndarray | None = None,
                 dtype: str | None = None, name: str = "<bytes>") -> TernaryTensor:
    """Decode one tensor from raw data.

    ``format``: a GGUF type (``TQ1_0 TQ2_0 Q2_0 Q2_0_G128 PQ2_0 PTQ1_0 Q1_0 STQ1_0 I2_S``; ``data`` = the tensor's
    bytes, ``shape`` = PyTorch ``[N, K]``), ``"BITNET"`` (``data`` = uint8 ``[N/4, K]``, ``shape`` = the
    unpacked ``[N, K]``, plus ``weight_scale`` and ``linear_class``), ``"MLX"`` (``data`` = uint32
    ``[N, K/16]``, plus fp16 ``scales``/``biases``; zero-copy), or ``"DENSE"``/``F16``/``BF16``/``F32``
    (``data`` = a float array, or raw bytes with ``dtype``).

    ``group_size``: the canonical group size wanted (default: the format's own; 128 for dense; the
    largest dividing K for per-tensor formats). Merging to a larger group is refused unless lossless or
    ``requantize=True``.
    """
    fmt = format.upper()
    if fmt in REFUSED_LUT_TYPES:
        raise _core.UnsupportedTypeError(
            f"tensor '{name}': bitnet.cpp {fmt} (GGUF type {REFUSED_LUT_TYPES[fmt]}) is a kernel-tiled LUT layout tied to one "
            f"model's kernel_config.ini and cannot be decoded portably; supported: {', '.join(GGUF_FORMATS)}, "
            "BITNET, MLX, DENSE")
    rows, cols = rows_cols(shape, name)
    if fmt in GGUF_FORMATS:
        out = _core.decode_gguf(fmt, _as_u8(data), rows, cols, group_size, requantize, tensor=name)
        return _from_core(out, name)
    if fmt == "BITNET":
        if weight_scale is None:
            raise InvalidArgumentError(f"tensor '{name}': BitNet decoding needs the companion weight_scale")
        ws = _float_array(weight_scale).reshape(-1)
        if ws.size != 1:
            raise _core.ValidationError(
                f"tensor '{name}': BitNet weight_scale must hold one value, got {ws.size} "
                "(first at index 1, {} in total)".format(ws.size - 1))
        out = _core.decode_bitnet(_as_u8(data), rows, cols, float(ws[0]), linear_class, group_size, tensor=name)
        return _from_core(out, name)
    if fmt == "MLX":
        if scales is None or biases is None:
            raise InvalidArgumentError(f"tensor '{name}': MLX decoding needs the companion scales and biases")
        weight = np.asarray(data)
        if weight.dtype not in (np.dtype("<u4"), np.dtype(np.uint8)):
            if weight.dtype.kind != "u" or weight.dtype.itemsize != 4:
                raise InvalidArgumentError(f"tensor '{name}': MLX 2-bit weight must be uint32, got {weight.dtype}")
            weight = weight.astype("<u4")  # big-endian words: the one case that needs a copy
        w8 = np.ascontiguousarray(weight).reshape(-1).view(np.uint8)
        s = np.asarray(scales)
        b = np.asarray(biases)
        g = _core.validate_mlx(w8, _scale_bits(s), _scale_bits(b), rows, cols, tensor=name)
        tensor = TernaryTensor(w8.reshape(rows, cols // 4), np.ascontiguousarray(s).reshape(rows, cols // g), g,
                               name=name, validate=False)
        if group_size is not None and group_size != g:
            return repack(tensor, group_size, requantize=requantize)
        return tensor
    if fmt in ("DENSE",) + DENSE_TYPES:
        raw, dt = _dense_bytes(data, dtype or (fmt if fmt != "DENSE" else None))
        return recover_dense(raw, dt, rows, cols, group_size or _default_group(cols), name=name)
    raise _core.UnsupportedTypeError(
        f"tensor '{name}': unsupported format {format!r}; supported: {', '.join(GGUF_FORMATS)}, BITNET, MLX, DENSE")


# -- encoding and regrouping ----------------------------------------------------------------------

def encode(tensor: TernaryTensor, format: str, *, requantize: bool = False, linear_class: str | None = None):
    """Encode a canonical tensor.

    GGUF types → ``np.ndarray`` uint8 (the GGUF tensor data bytes). The tensor is first regrouped to
    the format's block size (TQ*_0/STQ1_0: 256, Q2_0: 64, PQ2_0/PTQ1_0/Q2_0_G128/Q1_0: 128) — refused if
    that would lose information, unless ``requantize``. STQ1_0 also refuses a 4-lane group that is not one
    zero and three ±1 (naming row and group); with ``requantize`` it runs llama.cpp's STQ1_0 quantizer
    (``quantize_row_stq1_0_ref``) on the dequantized weights instead. ``"BITNET"`` → ``{"weight": uint8 [N/4, K],
    "weight_scale": float32 [1]}`` (all scales must be equal); ``"MLX"`` → ``{"weight": uint32
    [N, K/16], "scales", "biases"}`` (views of this tensor's arrays).
    """
    fmt = format.upper()
    args = tensor._args()
    if fmt in GGUF_FORMATS:
        return _core.encode_gguf(fmt, *args, requantize=requantize, tensor=tensor.name)
    if fmt == "BITNET":
        packed, ws = _core.encode_bitnet(*args, linear_class=linear_class, tensor=tensor.name)
        return {"weight": packed, "weight_scale": np.array([ws], dtype=np.float32)}
    if fmt == "MLX":
        rows, cols = tensor.shape
        q = np.ascontiguousarray(tensor.qweight)
        return {"weight": q.reshape(-1).view("<u4").reshape(rows, cols // 16),
                "scales": tensor.scales, "biases": -tensor.scales}
    raise _core.UnsupportedTypeError(
        f"tensor '{tensor.name}': cannot encode to {format!r}; supported: {', '.join(GGUF_FORMATS)}, BITNET, MLX")


def repack(tensor: TernaryTensor, group_size: int, requantize: bool = False) -> TernaryTensor:
    """Change the group size: to a divisor, lossless (scales repeat); to a multiple, only when every
    merged sub-group holding a nonzero trit has the same scale — else ``ValidationError`` unless
    ``requantize`` (re-ternarize the dequantized weights at the new group size with absmax)."""
    if group_size == tensor.group_size:
        return tensor
    out = _core.regroup(*tensor._args(), group_size, requantize, tensor=tensor.name)
    return _from_core(out, tensor.name)


def ternarize(w: Any, group_size: int = 128, method: str = "absmax", *, per_tensor: bool = False,
              name: str = "<tensor>") -> TernaryTensor:
    """Post-training ternarization of dense weights ``[..., K]`` (NumPy or torch, any float dtype).

    * ``absmax`` (Bonsai / ternary-qat): ``a = max(amax|group|, 1e-8)``, ``t = round(clamp(w/a, -1, 1))``.
    * ``absmean`` (BitNet): ``s = max(mean|group|, 1e-5)`` (or over the whole tensor with
      ``per_tensor=True``), ``t = clamp(round(w/s), -1, 1)``.

    ``round`` is half-to-even in f32 and ``t`` is decided against the f32 scale (matching those
    libraries' trits); the stored scale is ``fp16(scale)``, so ``dequantize()`` is exactly
    ``t · fp16(scale)``.
    """
    arr = _float_array(w)
    rows, cols = rows_cols(arr.shape, name)
    out = _core.ternarize(arr.reshape(rows, cols), rows, cols, group_size, method, per_tensor, tensor=name)
    return _from_core(out, name)
