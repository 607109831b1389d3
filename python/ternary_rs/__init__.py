"""ternary_rs — load, convert and serve ternary LLMs fast.

Public API (see README):

* ``ternary_rs.open(path)`` — zero-copy reader of GGUF / safetensors / sharded index / model directory.
* ``ternary_rs.decode / encode / repack`` and :class:`TernaryTensor` — bit-exact ternary codecs.
* ``ternary_rs.convert / inspect / verify / plan`` — the ``ternary-rs`` command's functions.
* ``ternary_rs.set_num_threads / get_num_threads`` — size of the worker pool for heavy work.

Every error derives from :class:`TernaryError` (those that are also a built-in exception —
``OSError`` and its subclasses, ``ValueError``/``TypeError``, ``KeyError`` — derive from both).
"""

from ._core import (
    FormatError,
    InvalidArgumentError,
    TensorNotFoundError,
    TernaryError,
    TernaryFileExistsError,
    TernaryFileNotFoundError,
    TernaryIsADirectoryError,
    TernaryNotADirectoryError,
    TernaryOSError,
    TernaryPermissionError,
    UnsupportedTypeError,
    ValidationError,
    __version__,
    get_num_threads,
    set_num_threads,
)
from .convert import convert, dequantize_checkpoint
from .core.tensor import TernaryTensor, decode_bytes, encode, pack_codes, repack, ternarize, unpack_codes
from .inspection.planner import plan
from .inspection.report import inspect, verify
from .sources.decode import decode
from .sources.reader import TensorInfo, TernaryFile, open

__all__ = [
    "FormatError",
    "InvalidArgumentError",
    "TensorNotFoundError",
    "TernaryFileExistsError",
    "TernaryFileNotFoundError",
    "TernaryIsADirectoryError",
    "TernaryNotADirectoryError",
    "TernaryOSError",
    "TernaryPermissionError",
    "TensorInfo",
    "TernaryError",
    "TernaryFile",
    "TernaryTensor",
    "UnsupportedTypeError",
    "ValidationError",
    "__version__",
    "convert",
    "decode",
    "decode_bytes",
    "dequantize_checkpoint",
    "encode",
    "get_num_threads",
    "inspect",
    "open",
    "pack_codes",
    "plan",
    "repack",
    "set_num_threads",
    "ternarize",
    "unpack_codes",
    "verify",
]
