"""Zero-copy access to GGUF and safetensors checkpoints (the writers are :mod:`ternary_rs.sinks.writers`).

Reading::

    with ternary_rs.open("model.gguf") as f:            # or a .safetensors, an *.index.json, a directory
        f.format, f.metadata, f.config                  # "gguf" | "safetensors", KV / __metadata__, config.json
        info = f.tensors["blk.0.attn_q.weight"]         # TensorInfo(name, shape, type, type_id, nbytes, offset, file)
        raw = f.raw(info.name)                          # read-only uint8 view of the bytes, no copy
        w = f.tensor("token_embd.weight")               # NumPy array for plain dtypes (F32/F16/BF16/ints/…)

Opening parses headers only (the Rust core validates every offset and size once, at open); tensor
bytes are read from the memory map when a view is used. Views keep the map alive, so they stay valid
after the file is closed. Errors derive from :class:`ternary_rs.TernaryError` and name file, tensor
and byte offset.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, Self

import numpy as np

from .. import _core
from .._core import FormatError, InvalidArgumentError, TensorNotFoundError, UnsupportedTypeError
from ..core.formats import FLOAT_BYTES, GGUF_TERNARY_GROUPS, SAFETENSORS_NUMPY_DTYPES

__all__ = ["TensorInfo", "TernaryFile", "not_found", "open"]

# The core's message for a type id it has no layout for (it lists every id it knows, most not ternary).
_UNKNOWN_GGML_TYPE = re.compile(r"^(.*?): tensor '(.*?)': unsupported ggml type id (\d+) \(at byte offset \d+\);")
# Ids outside ggml's own list that ternary GGUFs in the wild use, by their name.
_FOREIGN_GGML_TYPES = {
    38: "TL1, bitnet.cpp's per-CPU lookup-table layout: convert its I2_S GGUF or safetensors instead",
}
# What ``open`` accepts, for "not a model file" errors.
MODEL_FILE_KINDS = "a .gguf file, a .safetensors file, a *.safetensors.index.json or a model directory"

# GGUF types that are plain element arrays (everything else is block-quantized: use ternary_rs.decode).
_GGUF_PLAIN = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


class TensorInfo(NamedTuple):
    """One tensor of an open file (an immutable record).

    ``shape`` is in PyTorch order (GGUF ``ne`` reversed); ``ggml_ne`` is GGUF's own order (None for
    safetensors). ``type`` is the GGUF type name ("F16", "TQ2_0", "Q2_0", "Q2_0_G128", "PQ2_0",
    "PTQ1_0", "Q1_0", "STQ1_0", "I2_S", "Q8_0", …) or the safetensors dtype ("F16", "BF16", "U8", …).
    ``offset`` is the absolute byte offset in ``file`` (the file or shard holding the bytes).

    A NamedTuple, not a dataclass: the Rust core hands over rows in this field order and each becomes a
    TensorInfo with one ``tuple.__new__`` — building thousands of dataclass instances used to be most of
    the time of opening a file.
    """

    name: str
    shape: tuple[int, ...]
    type: str
    type_id: int | None
    nbytes: int
    offset: int
    file: str
    ggml_ne: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# Rows from the Rust core always have exactly TensorInfo's fields: skip _make's length check.
_new_tuple = tuple.__new__


def _find_in_directory(d: Path) -> Path:
    """The checkpoint file of a model directory: an index, a single safetensors file, or a single GGUF."""
    if not any(d.iterdir()):
        raise FormatError(f"{d}: the folder is empty (a model folder holds a .gguf file, .safetensors files or "
                          "a *.safetensors.index.json)")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return index
    indexes = sorted(d.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return indexes[0]
    if len(indexes) > 1:
        raise FormatError(f"{d}: several index files ({', '.join(p.name for p in indexes)}); open one of them")
    shards = sorted(d.glob("*.safetensors"))
    if len(shards) == 1:
        return shards[0]
    if len(shards) > 1:
        raise FormatError(f"{d}: {len(shards)} .safetensors files but no *.safetensors.index.json; open one file")
    ggufs = sorted(d.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        raise FormatError(f"{d}: several .gguf files ({', '.join(p.name for p in ggufs)}); open one of them")
    raise FormatError(f"{d}: no model.safetensors.index.json, *.safetensors or *.gguf file in this directory")


def not_found(path: str | os.PathLike[str]) -> FileNotFoundError:
    """The one "no such file" error of the package, a :class:`ternary_rs.TernaryFileNotFoundError` (a
    ``TernaryError`` and a ``FileNotFoundError``; ``str()``: ``[Errno 2] no such file or directory: 'p'``;
    the command line prints ``p: no such file or directory``)."""
    return _core.TernaryFileNotFoundError(errno.ENOENT, "no such file or directory", str(path))


# The ternary_rs checkpoint layouts this version reads (docs/checkpoint.md: quantization_config.format_version).
SUPPORTED_FORMAT_VERSIONS = (1,)


def check_format_version(config: Any, where: str | os.PathLike[str]) -> None:
    """Refuse a ternary_rs checkpoint (``quant_method: "ternary"``) whose ``format_version`` this version does
    not know: docs/checkpoint.md says a reader must (its layout may differ). A missing key means 1, as the vLLM
    plugin reads it."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict) or qc.get("quant_method") != "ternary" or "format_version" not in qc:
        return
    v = qc["format_version"]
    if type(v) is not int or v not in SUPPORTED_FORMAT_VERSIONS:
        supported = ", ".join(map(str, SUPPORTED_FORMAT_VERSIONS))
        raise FormatError(
            f"{where}: quantization_config.format_version is {json.dumps(v)}, but this ternary_rs "
            f"({_core.__version__}) reads format_version {supported} only; refusing to read the checkpoint "
            "(a newer ternary_rs may have written it)")


_OS_ERROR_CLASSES = {
    errno.ENOENT: "TernaryFileNotFoundError", errno.EACCES: "TernaryPermissionError",
    errno.EPERM: "TernaryPermissionError", errno.EEXIST: "TernaryFileExistsError",
    errno.EISDIR: "TernaryIsADirectoryError", errno.ENOTDIR: "TernaryNotADirectoryError",
}


def as_ternary_error(e: BaseException) -> BaseException:
    """``e`` if it is a :class:`TernaryError` (or not an ``OSError``), else the same ``OSError`` (errno,
    message, file names) as ternary_rs's subclass of it, which is also a ``TernaryError``."""
    if isinstance(e, _core.TernaryError) or not isinstance(e, OSError):
        return e
    cls = getattr(_core, _OS_ERROR_CLASSES.get(e.errno or 0, "TernaryOSError"))
    if e.errno is None:
        return cls(str(e))
    args = (e.errno, e.strerror) + ((e.filename,) if e.filename is not None else ())
    if e.filename2 is not None:
        args += (None, e.filename2)
    return cls(*args)


class ternary_errors:  # noqa: N801 - used as a decorator and a context manager
    """Re-raise built-in ``OSError`` s as ternary_rs's subclasses (see :func:`as_ternary_error`), so every
    error of the public API is a ``TernaryError`` and ``except OSError`` still catches them."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            fixed = as_ternary_error(exc)
            if fixed is not exc:
                raise fixed.with_traceback(tb) from exc.__cause__
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with ternary_errors():
                return fn(*args, **kwargs)

        return wrapped


def _sniff_is_gguf(p: Path) -> bool:
    with builtins.open(p, "rb") as fh:
        return fh.read(4) == b"GGUF"


def _looks_like_safetensors(p: Path) -> bool:
    """A safetensors file starts with a little-endian u64 header length followed by ``{``."""
    with builtins.open(p, "rb") as fh:
        head = fh.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (1 << 32)


class TernaryFile:
    """An open GGUF file or safetensors checkpoint. Use :func:`ternary_rs.open` to create one."""

    def __init__(self, path: str | os.PathLike[str]):
        p = Path(path)
        if p.is_dir():
            directory: Path | None = p
            target = _find_in_directory(p)
        else:
            directory = None
            target = p
            if not p.exists():
                raise not_found(p)
        self.path: str = str(p)
        self._target = target
        self._config_dir = directory if directory is not None else target.parent
        name = target.name
        self._gguf = None
        self._st = None
        if name.endswith(".index.json"):
            self._st = _core._SafetensorsCheckpoint.open_index(str(target))
        elif name.endswith(".gguf") or (not name.endswith(".safetensors") and _sniff_is_gguf(target)):
            self._gguf = _core._GgufFile(str(target))
        elif name.endswith(".safetensors") or _looks_like_safetensors(target):
            self._st = _core._SafetensorsCheckpoint.open_file(str(target))
        else:  # e.g. config.json: say what it is not, rather than a header-size error
            raise FormatError(f"{target}: not a model file (expected {MODEL_FILE_KINDS})")
        self.format: str = "gguf" if self._gguf is not None else "safetensors"
        if self._gguf is not None:
            self._mappings = [self._gguf.mapping()]
            self._files = [str(target)]
            self.gguf_version: int | None = self._gguf.version
            self.alignment: int | None = self._gguf.alignment
            self.byte_order: str = self._gguf.byte_order
        else:
            self._mappings = self._st.mappings()
            self._files = [str(s) for s in self._st.shard_paths()]
            self.gguf_version = None
            self.alignment = None
            self.byte_order = "little"
        self._tensors: dict[str, TensorInfo] | None = None
        self._shard_of: dict[str, int] = {}
        self._metadata: dict[str, Any] | None = None
        self._metadata_types: dict[str, str] | None = None
        self._config: Any = ...
        self._closed = False
        if self._st is not None:  # a checkpoint of an unknown layout is not read at all
            try:
                config = self.config
            except FormatError:
                config = None  # unreadable config.json: reported when .config is used
            check_format_version(config, self._config_dir / "config.json")

    # ---- header information -------------------------------------------------------------------
    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Name -> :class:`TensorInfo`, in file order (shards in name order for an index)."""
        if self._tensors is None:
            self._check_open()
            if self._gguf is not None:
                rows = self._gguf.tensor_infos(self._files[0])
            else:
                rows, shards = self._st.tensor_infos(self._files)
                self._shard_of = dict(zip((r[0] for r in rows), shards))
            self._tensors = {row[0]: _new_tuple(TensorInfo, row) for row in rows}
        return self._tensors

    @property
    def metadata(self) -> dict[str, Any]:
        """GGUF key/values as Python values (ints, floats, bools, str, lists; bytes for non-UTF-8
        strings), or the safetensors ``__metadata__`` (merged over shards; empty if absent)."""
        if self._metadata is None:
            self._check_open()
            if self._gguf is not None:
                items = self._gguf.metadata()
                self._metadata = {k: v for k, _, v in items}
                self._metadata_types = {k: t for k, t, _ in items}
            else:
                self._metadata = dict(self._st.metadata() or {})
                self._metadata_types = {k: "string" for k in self._metadata}
        return self._metadata

    @property
    def metadata_types(self) -> dict[str, str]:
        """GGUF value type of each key: "u8" … "f64", "bool", "string", "array[<elem>]"."""
        self.metadata  # noqa: B018 - fills both dicts
        assert self._metadata_types is not None
        return self._metadata_types

    @property
    def index_metadata(self) -> dict[str, Any] | None:
        """The ``metadata`` object of a safetensors index (e.g. ``total_size``), if any."""
        if self._st is None:
            return None
        text = self._st.index_metadata_json()
        return None if text is None else json.loads(text)

    @property
    def files(self) -> list[str]:
        """The file(s) holding tensor data (the shards of an index)."""
        return list(self._files)

    @property
    def config(self) -> dict[str, Any] | None:
        """``config.json`` next to the checkpoint (opened as a directory or a file inside one), else None."""
        if self._config is ...:
            cfg = self._config_dir / "config.json"
            if cfg.is_file():
                try:
                    self._config = json.loads(cfg.read_text(encoding="utf-8"))
                except (ValueError, UnicodeDecodeError) as e:
                    raise FormatError(f"{cfg}: not valid JSON: {e}") from None
            else:
                self._config = None
        return self._config

    # ---- tensor data ---------------------------------------------------------------------------
    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise TensorNotFoundError(f"{self._target}: no tensor named {name!r}") from None

    def _mapping_for(self, name: str):
        return self._mappings[self._shard_of.get(name, 0)]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only ``uint8`` array viewing the memory map (no copy).

        The view keeps the map alive: it stays valid after :meth:`close` and after this object is gone.
        """
        self._check_open()
        info = self._info(name)
        if info.nbytes == 0:
            a = np.empty(0, dtype=np.uint8)
            a.flags.writeable = False
            return a
        return np.frombuffer(self._mapping_for(name), dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as a NumPy array of its own dtype and PyTorch-order shape, for plain element
        types (F32, F16, BF16, F64, signed/unsigned ints, BOOL, C64, F8_*). Zero-copy and read-only
        when the bytes are aligned for the dtype; an aligned copy otherwise (e.g. MLX-written files).
        Big-endian GGUF files give big-endian dtypes. Quantized types raise UnsupportedTypeError
        (decode them with ``ternary_rs.decode``)."""
        info = self._info(name)
        if self.format == "gguf" and info.type not in _GGUF_PLAIN:
            raise UnsupportedTypeError(
                f"{info.file}: tensor '{name}': type {info.type} is block-quantized, not a plain array; "
                f"use ternary_rs.decode (plain types: {', '.join(_GGUF_PLAIN)})"
            )
        dtype = SAFETENSORS_NUMPY_DTYPES.get(info.type)
        if dtype is None:
            hint = " (install ml_dtypes for BF16/F8)" if info.type in ("BF16",) or info.type.startswith("F8") else ""
            raise UnsupportedTypeError(
                f"{info.file}: tensor '{name}': dtype {info.type} has no NumPy equivalent{hint}; "
                f"supported: {', '.join(sorted(SAFETENSORS_NUMPY_DTYPES))}; use .raw() for the bytes"
            )
        dt = np.dtype(dtype)
        if self.byte_order == "big":
            dt = dt.newbyteorder(">")
        raw = self.raw(name)
        if info.offset % dt.alignment == 0:
            arr = raw.view(dt)
        else:
            arr = raw.copy().view(dt)  # the copy is aligned
        return arr.reshape(info.shape)

    def check_unchanged(self) -> None:
        """Raise :class:`FormatError` (naming the file) if a file of this checkpoint shrank, changed,
        or was replaced or removed since it was opened: bytes read from it since cannot be trusted.

        A file truncated under the map would kill the process with SIGBUS when read; ternary_rs turns
        that into zero bytes plus the mark this reports, so anything derived from the bytes must be
        checked before it is kept (``convert`` checks every tensor and again before its output is
        renamed into place).
        """
        self._check_open()
        for m in self._mappings:
            m.check_unchanged()

    # ---- lifetime ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"{self._target}: file is closed")

    def close(self) -> None:
        """Release this object's reference to the map(s). Views from :meth:`raw` stay valid."""
        self._closed = True
        self._gguf = None
        self._st = None
        self._mappings = []

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        state = "closed " if self._closed else ""
        n = len(self._tensors) if self._tensors is not None else "?"
        extra = f" v{self.gguf_version}" if self.gguf_version is not None else f", {len(self._files)} file(s)"
        return f"<{state}TernaryFile {self.format}{extra} {str(self._target)!r}, {n} tensors>"


@ternary_errors()
def open(path: str | os.PathLike[str]) -> TernaryFile:
    """Open a ``.gguf``, a ``.safetensors``, an ``*.index.json`` or a model directory (which must hold
    ``model.safetensors.index.json``, a single ``*.safetensors``, or a single ``*.gguf``)."""
    try:
        return TernaryFile(path)
    except UnsupportedTypeError as e:
        m = _UNKNOWN_GGML_TYPE.match(str(e))
        if m is None:
            raise
        type_id = int(m.group(3))
        name = _FOREIGN_GGML_TYPES.get(type_id)
        what = f"ggml type id {type_id}" + (f" ({name})" if name else ", which ternary_rs does not know")
        raise UnsupportedTypeError(
            f"{m.group(1)}: tensor '{m.group(2)}' has {what}; ternary_rs reads the ternary types "
            f"{', '.join(t for t in GGUF_TERNARY_GROUPS if t != 'Q2_0_G128')} and the float types "
            f"{', '.join(FLOAT_BYTES)}") from None
    except FormatError as e:
        text = str(e)
        # The core gives every format error an offset; 0 is a real one only for the file's first bytes
        # (magic, header length). A shard an index names, a metadata key's value: no offset applies.
        if text.endswith(" (at byte offset 0)") and not re.search(r"magic|header length|header size", text):
            raise FormatError(text[: -len(" (at byte offset 0)")]) from None
        raise
