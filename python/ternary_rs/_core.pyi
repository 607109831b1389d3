"""Type stub of the ``ternary_rs._core`` extension (Rust, PyO3).

The public API lives in the pure-Python modules (``ternary_rs.sources.reader``, ``ternary_rs.core.tensor``, …); the
underscore classes here are their backends. Each area adds its own section below.
"""

import os
from typing import Any

from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

__version__: str
GROUP_SIZES: tuple[int, ...]

# ---- errors (rust/bindings/src/errors.rs) -----------------------------------------------------------
class TernaryError(Exception):
    """Base class of every ternary_rs error."""

class FormatError(TernaryError):
    """Malformed container (names file, field and byte offset)."""

class UnsupportedTypeError(TernaryError):
    """A tensor type or dtype ternary_rs does not handle here (names tensor and what is supported)."""

class ValidationError(TernaryError):
    """Well-formed but unacceptable data: NaN/Inf scale, code 3, non-ternary values, shape mismatch."""

class InvalidArgumentError(TernaryError, ValueError, TypeError):
    """A bad argument: an unknown dtype, a K that is no multiple of the group, a negative thread count,
    a closed file (also a ValueError and a TypeError)."""

class TensorNotFoundError(TernaryError, KeyError):
    """No tensor of that name in the file (also a KeyError)."""

class TernaryOSError(TernaryError, OSError):
    """A file could not be read or written (also an OSError; errno and filename as usual)."""

class TernaryFileNotFoundError(TernaryOSError, FileNotFoundError): ...
class TernaryFileExistsError(TernaryOSError, FileExistsError): ...
class TernaryPermissionError(TernaryOSError, PermissionError): ...
class TernaryIsADirectoryError(TernaryOSError, IsADirectoryError): ...
class TernaryNotADirectoryError(TernaryOSError, NotADirectoryError): ...

# ---- thread pool (rust/bindings/src/lib.rs) ---------------------------------------------------------
def set_num_threads(n: int) -> None:
    """Set the number of threads heavy work uses (0 = all cores)."""

def get_num_threads() -> int:
    """The number of threads heavy work uses."""

# ---- containers (rust/bindings/src/container.rs) ----------------------------------------------------
class _Mapping(Buffer):
    """A read-only memory map of a whole file, exported through the buffer protocol. NumPy views made
    from it (``np.frombuffer``) keep the map alive."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def check_unchanged(self) -> None:
        """Raise FormatError if the file shrank under the map (its lost pages read as zeros), changed
        size or modification time, or was replaced or removed since it was mapped."""

class _GgufFile:
    """An open GGUF file (header parsed and validated; data mapped). Raises FormatError /
    UnsupportedTypeError on malformed input, OSError when the file cannot be read."""

    def __init__(self, path: str | os.PathLike[str]) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def alignment(self) -> int: ...
    @property
    def data_offset(self) -> int: ...
    @property
    def byte_order(self) -> str:
        """"little" or "big"."""
    def tensor_infos(self) -> list[tuple[str, tuple[int, ...], str, int, int, int]]:
        """[(name, ne in GGUF order, type name, type id, nbytes, absolute offset)] in file order."""
    def metadata(self) -> list[tuple[str, str, Any]]:
        """[(key, type name, value)] in file order; type names "u8" … "f64", "bool", "string",
        "array[<elem>]"; strings that are not UTF-8 come back as bytes."""
    def mapping(self) -> _Mapping: ...

class _SafetensorsCheckpoint:
    """One safetensors file or the shards of a ``*.safetensors.index.json``."""

    @staticmethod
    def open_file(path: str | os.PathLike[str]) -> _SafetensorsCheckpoint: ...
    @staticmethod
    def open_index(path: str | os.PathLike[str]) -> _SafetensorsCheckpoint: ...
    @property
    def index_path(self) -> str | None: ...
    def index_metadata_json(self) -> str | None: ...
    def shard_paths(self) -> list[str]: ...
    def mappings(self) -> list[_Mapping]: ...
    def tensor_infos(self) -> list[tuple[str, tuple[int, ...], str, int, int, int]]:
        """[(name, shape, dtype, nbytes, absolute offset, shard index)] in checkpoint order."""
    def metadata(self) -> dict[str, str] | None: ...

class _GgufWriter:
    """Streaming GGUF v3 writer; see ``ternary_rs.sinks.writers.GGUFWriter``."""

    def __init__(self, path: str | os.PathLike[str], alignment: int = 32) -> None: ...
    def add_metadata(self, key: str, type: str, value: Any) -> None:
        """``type``: a scalar type name, "string", or "array" with ``value = (elem type, [items])``."""
    def add_tensor_info(self, name: str, ne: list[int], type_id: int, nbytes: int) -> None: ...
    def write_tensor_data(self, name: str, data: Buffer) -> None: ...
    def finish(self) -> None: ...
    def abort(self) -> None: ...

class _SafetensorsWriter:
    """Streaming safetensors writer; see ``ternary_rs.sinks.writers.SafetensorsWriter``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        tensors: list[tuple[str, str, list[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None: ...
    def write(self, name: str, data: Buffer) -> None: ...
    def finish(self) -> None: ...
    def abort(self) -> None: ...
