"""Streaming GGUF and safetensors writers (constant memory; data streamed tensor by tensor in the
declared order)::

    with GGUFWriter("out.gguf", alignment=32) as w:
        w.add_metadata("general.architecture", "llama")
        w.add_metadata("tokenizer.ggml.scores", [0.0, -1.0], type="array[f32]")
        w.add_tensor_info("blk.0.ffn_up.weight", (n, k), "TQ2_0", nbytes)   # PyTorch-order shape
        w.write_tensor_data("blk.0.ffn_up.weight", data)                    # any buffer / ndarray

    with SafetensorsWriter("out.safetensors", [("w", "F16", (2, 3))], metadata={"format": "pt"}) as w:
        w.write("w", np.zeros((2, 3), np.float16))
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from .. import _core
from .._core import InvalidArgumentError
from ..core.formats import GGML_TYPE_IDS, SAFETENSORS_NUMPY_DTYPES

__all__ = ["GGUFWriter", "SafetensorsWriter"]

_GGUF_SCALARS = ("u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64", "f32", "f64", "bool", "string")
_NUMPY_SCALAR_TYPES = {
    np.uint8: "u8", np.int8: "i8", np.uint16: "u16", np.int16: "i16", np.uint32: "u32",
    np.int32: "i32", np.uint64: "u64", np.int64: "i64", np.float32: "f32", np.float64: "f64",
    np.bool_: "bool",
}


def _infer_gguf_type(value: Any) -> str:
    """gguf-py's GGUFValueType.get_type: str -> string, list -> array, float -> f32, bool -> bool,
    int -> i32; NumPy scalars keep their own width."""
    for t, name in _NUMPY_SCALAR_TYPES.items():
        if isinstance(value, t):
            return name
    if isinstance(value, (str, bytes, bytearray)):
        return "string"
    if isinstance(value, (list, tuple, np.ndarray)):
        return "array"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, float):
        return "f32"
    if isinstance(value, int):
        return "i32"
    raise InvalidArgumentError(f"cannot infer a GGUF type for {type(value).__name__} value {value!r}; pass type=")


def _split_array_type(t: str) -> str | None:
    """'array[<inner>]' -> '<inner>', 'array' -> None (infer), else error."""
    if t == "array":
        return None
    if t.startswith("array[") and t.endswith("]"):
        return t[len("array["):-1]
    raise InvalidArgumentError(f"unknown GGUF value type {t!r}; use one of {', '.join(_GGUF_SCALARS)}, array[<elem>]")


def _typed_value(value: Any, t: str | None) -> tuple[str, Any]:
    """(type, payload) for the Rust writer; arrays become ("array", (elem, [payload, ...]))."""
    if t is None:
        t = _infer_gguf_type(value)
    if t in _GGUF_SCALARS:
        if t == "string" and isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8")
        elif isinstance(value, np.generic):
            value = value.item()
        return t, value
    inner = _split_array_type(t)
    items = list(value.tolist() if isinstance(value, np.ndarray) else value)
    if inner is None:
        if not items:
            raise InvalidArgumentError("cannot infer the element type of an empty list; pass type='array[<elem>]'")
        inner = _infer_gguf_type(items[0])
    elem = "array" if inner.startswith("array") else inner
    payload = []
    for it in items:
        it_t, it_v = _typed_value(it, inner if inner != "array" else None)
        if it_t != elem:
            raise InvalidArgumentError(f"array element {it!r} is a {it_t}, but the array holds {elem}")
        payload.append(it_v)
    return "array", (elem, payload)


def _as_bytes_buffer(data: Any) -> Any:
    """A C-contiguous byte buffer for any ndarray (incl. ml_dtypes) or buffer object."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if type(data).__module__ == "torch" and hasattr(data, "untyped_storage"):  # a torch tensor
        import torch

        return data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return data


class _StreamingWriter:
    """Finishing of the streaming writers (``self._w``, a Rust writer): :meth:`close` checks completeness,
    :meth:`abort` deletes the partial file, and as a context manager an exception aborts."""

    _w: Any

    def close(self) -> None:
        self._w.finish()

    def abort(self) -> None:
        """Stop and delete the partial file."""
        self._w.abort()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class GGUFWriter(_StreamingWriter):
    """Streaming GGUF v3 writer (llama.cpp's byte layout), constant memory.

    Call order: :meth:`add_metadata` and :meth:`add_tensor_info` for everything, then
    :meth:`write_tensor_data` for each tensor in the order its info was added (a tensor may be
    written in several chunks), then :meth:`close`, which checks every tensor got exactly
    ``nbytes`` bytes. As a context manager, an exception deletes the partial file.

    ``alignment`` (a power of two) is written as ``general.alignment`` when it is not 32.
    """

    def __init__(self, path: str | os.PathLike[str], alignment: int = 32):
        self.path = str(path)
        self._w = _core._GgufWriter(self.path, alignment)

    def add_metadata(self, key: str, value: Any, type: str | None = None) -> None:
        """Add a key. ``type`` is one of "u8","i8","u16","i16","u32","i32","u64","i64","f32","f64",
        "bool","string" or "array[<elem>]" (nestable, e.g. "array[array[u8]]"); without it the type is
        inferred like gguf-py (int -> i32, float -> f32, bool -> bool, str -> string, list -> array of
        the first element's type)."""
        t, payload = _typed_value(value, type)
        self._w.add_metadata(key, t, payload)

    def add_tensor_info(self, name: str, shape: Sequence[int], type_id: int | str, nbytes: int) -> None:
        """Declare a tensor. ``shape`` is in PyTorch order (reversed into GGUF ``ne``); ``type_id`` is
        a ggml type id (any id, incl. 142 PQ2_0 / 143 PTQ1_0) or a name from ``GGML_TYPE_IDS``;
        ``nbytes`` the raw byte size (checked against the shape for known types)."""
        if isinstance(type_id, str):
            try:
                type_id = GGML_TYPE_IDS[type_id]
            except KeyError:
                raise InvalidArgumentError(f"unknown ggml type name {type_id!r}; known: {', '.join(GGML_TYPE_IDS)}") from None
        ne = [int(d) for d in reversed(tuple(shape))]
        self._w.add_tensor_info(name, ne, int(type_id), int(nbytes))

    def write_tensor_data(self, name: str, data: Any) -> None:
        """Append bytes (any buffer, NumPy array or CPU torch tensor) to tensor ``name``."""
        self._w.write_tensor_data(name, _as_bytes_buffer(data))


def _safetensors_dtype(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    dt = np.dtype(dtype)
    for name, d in SAFETENSORS_NUMPY_DTYPES.items():
        if np.dtype(d) == dt:
            return name
    raise InvalidArgumentError(f"no safetensors dtype for {dt}")


class SafetensorsWriter(_StreamingWriter):
    """Streaming safetensors writer, constant memory.

    ``tensors`` lists every (name, dtype, shape) up front (dtype a safetensors name such as "F16",
    "U8", "BF16", or a NumPy dtype); the header is written at once, then :meth:`write` streams each
    tensor's bytes in that order (several chunks allowed); :meth:`close` checks completeness. Data
    offsets follow the given order without gaps, so put wider dtypes first if aligned reads matter.
    As a context manager, an exception deletes the partial file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tensors: Sequence[tuple[str, Any, Sequence[int]]],
        metadata: dict[str, str] | None = None,
    ):
        self.path = str(path)
        spec = [(n, _safetensors_dtype(d), [int(x) for x in s]) for n, d, s in tensors]
        self._w = _core._SafetensorsWriter(self.path, spec, metadata)

    def write(self, name: str, data: Any) -> None:
        """Append bytes (any buffer, NumPy array or CPU torch tensor) to tensor ``name``."""
        self._w.write(name, _as_bytes_buffer(data))
