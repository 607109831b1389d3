"""Writing a vLLM checkpoint directory safely: staging, shards, index, manifest.

Contract (docs/checkpoint.md#checkpoint-contract): ``config.json`` with ``quantization_config``, ``model-0000i-of-0000n.safetensors``
+ ``model.safetensors.index.json``, tokenizer files, ``generation_config.json`` and the
``ternary_rs.json`` manifest. Everything is written into a temporary sibling of the destination and
renamed into place only when complete, so an interrupted run never leaves a destination that looks valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._core import GROUP_SIZES, InvalidArgumentError, TernaryError, TernaryFileExistsError, __version__

MANIFEST_NAME = "ternary_rs.json"
INDEX_NAME = "model.safetensors.index.json"
SHARD_PATTERN = "model-{index:05d}-of-{count:05d}.safetensors"
MANIFEST_FORMAT_VERSION = 1
QUANT_FORMAT_VERSION = 1
SUPPORTED_GROUP_SIZES = GROUP_SIZES
# Temporary siblings: ".<dst name>.ternary_rs-tmp-<pid>-<nonce>"; never mistaken for a checkpoint.
TMP_MARK = ".ternary_rs-tmp-"
OLD_MARK = ".ternary_rs-old-"
HASH_CHUNK_BYTES = 8 << 20
# Decoded tensors kept in flight ahead of the writer (bounds memory: a few tensors at most).
PREFETCH_DEPTH = 2
# Named test hook: seconds to sleep after each tensor, so tests can interrupt a conversion mid-way.
SLEEP_ENV = "TERNARY_RS_TEST_SLEEP_PER_TENSOR"

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


class ConversionError(TernaryError):
    """A conversion could not be completed (the message names the file and tensor)."""


def describe_error(e: BaseException, path: str | os.PathLike | None = None) -> str:
    """One line for an error, as the command line prints it: a missing file in one wording
    (``<path>: no such file or directory``), no Python class name or errno, and ``path`` not repeated
    when the message already starts with it (bulk reports name each input once)."""
    if isinstance(e, FileNotFoundError) and e.filename:
        text = f"{e.filename}: no such file or directory"
    elif isinstance(e, OSError) and e.filename is not None:  # Python's: one "<path>: <reason>" wording
        text = f"{e.filename}: {_os_reason(e.strerror or str(e))}"
        if e.filename2 is not None:
            text += f" ({e.filename2})"
    elif isinstance(e, OSError) and e.strerror:  # Rust I/O errors: OSError(errno, "<path>: <io error>")
        text = _os_reason(e.strerror)
    elif isinstance(e, KeyError) and e.args:
        text = str(e.args[0])
    else:
        text = str(e)
    if path is not None and text.startswith(f"{os.fspath(path)}: "):
        text = text[len(f"{os.fspath(path)}: "):]
    return text  # no Python class name: the message says what happened


def _os_reason(text: str) -> str:
    """An OS error's reason as the command line words it: ``Permission denied (os error 13)`` (Rust) and
    ``Permission denied`` (Python) both read ``Permission denied``; a leading path is kept."""
    return re.sub(r"\s*\(os error \d+\)$", "", text)


def parse_size(value: int | str) -> int:
    """``"5GB"`` -> 5·10⁹, ``"2GiB"`` -> 2·2³⁰, ints pass through (Hugging Face's convention)."""
    if isinstance(value, int):
        if value <= 0:
            raise InvalidArgumentError(f"size must be positive, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise InvalidArgumentError(f"cannot parse size {value!r} (examples: 5GB, 500MB, 2GiB)")
    size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if size <= 0:
        raise InvalidArgumentError(f"size must be positive, got {value!r}")
    return size


def quantization_config(group_size: int, modules_not_converted: Sequence[str] = ()) -> dict[str, Any]:
    """The ``quantization_config`` block of ``config.json`` (checkpoint contract, format_version 1)."""
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise InvalidArgumentError(f"group size {group_size} not in {SUPPORTED_GROUP_SIZES}")
    return {
        "quant_method": "ternary",
        "format_version": QUANT_FORMAT_VERSION,
        "group_size": int(group_size),
        "scale_dtype": "float16",
        "modules_not_converted": sorted(modules_not_converted),
    }


# ------------------------------------------------------------------------------------------ staging
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# A temporary of any destination: ".<name>.ternary_rs-tmp-<pid>-<8 hex>" (or -old-), optionally with the
# "-meta-<random>" suffix of a GGUF conversion's scratch folder.
_TEMPORARY = re.compile(r"^\..+?\.ternary_rs-(?:tmp|old)-(\d+)-[0-9a-f]+(?:-meta-[A-Za-z0-9_]+)?$")


def remove_stale_temporaries(dst: Path) -> list[Path]:
    """Delete the temporaries in ``dst``'s folder left by runs whose process is gone (crash, SIGKILL), for
    any destination in that folder (a killed run to another name leaves its staging folder there too)."""
    removed = []
    if not dst.parent.is_dir():
        return removed
    for p in dst.parent.iterdir():
        m = _TEMPORARY.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            if _remove(p):
                removed.append(p)
    return removed


def _make_writable(func, path, _exc) -> None:
    """``shutil.rmtree`` error handler: a read-only folder cannot have entries removed; make it (and the
    entry) writable by its owner and try once more."""
    import stat

    for q in (os.path.dirname(path), path):
        try:
            os.chmod(q, os.lstat(q).st_mode | stat.S_IRWXU if os.path.isdir(q) and not os.path.islink(q)
                     else os.lstat(q).st_mode | stat.S_IWUSR)
        except OSError:
            pass
    try:
        func(path)
    except FileNotFoundError:
        pass


def _remove(p: Path) -> bool:
    """Remove a file or folder of ours (read-only entries too); whether it is gone."""
    if p.is_dir() and not p.is_symlink():
        try:
            if sys.version_info >= (3, 12):
                shutil.rmtree(p, onexc=_make_writable)
            else:
                shutil.rmtree(p, onerror=_make_writable)
        except OSError:
            pass
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            return False
    return not (p.exists() or p.is_symlink())


# Metadata key every GGUF written by ternary_rs carries (value: tool version): ``--force`` may replace
# such a file, and no other.
GGUF_MARK_KEY = "ternary_rs.version"


def is_ternary_rs_output(path: str | os.PathLike) -> bool:
    """Whether ``path`` is something ``convert`` wrote (and so may replace with ``--force``).

    A directory qualifies when its ``ternary_rs.json`` manifest names the tool and lists every file the
    directory holds (an output a user has since added files to is theirs now); an empty directory
    qualifies too (nothing to lose). A file qualifies when it is a GGUF whose header carries
    :data:`GGUF_MARK_KEY`. Anything unreadable does not.
    """
    p = Path(path)
    if p.is_symlink():
        return False
    if p.is_dir():
        entries = list(p.iterdir())
        if not entries:
            return True
        try:
            manifest = json.loads((p / MANIFEST_NAME).read_text())
        except (OSError, ValueError):
            return False
        if not isinstance(manifest, dict) or manifest.get("tool") != "ternary_rs":
            return False
        listed = set(manifest.get("files") or {}) | {MANIFEST_NAME}
        present = {q.relative_to(p).as_posix() for q in p.rglob("*") if not q.is_dir()}
        return present <= listed
    if p.is_file():
        try:
            from ..sources.reader import open as open_checkpoint

            with open_checkpoint(p) as f:
                return f.format == "gguf" and GGUF_MARK_KEY in f.metadata
        except (TernaryError, OSError, ValueError):
            return False
    return False


def _refuse_foreign(dst: Path, when: str, shown: str | os.PathLike | None = None) -> None:
    shown = dst if shown is None else shown
    if dst.is_symlink():
        raise TernaryFileExistsError(
            f"{shown} {when} and is a symbolic link (to {os.readlink(dst)}); ternary_rs never replaces a link, "
            "even with --force: remove the link, or name its target as the destination")
    if not is_ternary_rs_output(dst):
        raise TernaryFileExistsError(
            f"{shown} {when} and was not written by ternary_rs (or holds files its manifest does not list); "
            f"refusing to replace it, even with --force: move it away or choose another destination")


def enclosing_output(dst: str | os.PathLike) -> Path | None:
    """The nearest existing folder above ``dst`` that is a ternary_rs output directory (holds a manifest
    written by ternary_rs), or None. Writing inside one adds files its manifest does not list: the
    output is damaged for verify and can no longer be replaced with --force."""
    for parent in Path(dst).absolute().parents:
        manifest = parent / MANIFEST_NAME
        if manifest.is_file():
            try:
                if json.loads(manifest.read_text()).get("tool") == "ternary_rs":
                    return parent
            except (OSError, ValueError, AttributeError):
                continue
    return None


def check_destination_folder(dst: str | os.PathLike, parents: bool) -> None:
    """Refuse, before anything is written, a destination whose folder cannot be: a *file* on the way (one
    message, not "no such folder" then "exists"), a missing folder without ``parents``, or a folder inside
    an existing ternary_rs output."""
    shown = Path(dst)
    absolute = shown.absolute()
    for parent in reversed(absolute.parents):  # from the root down: the first file on the way
        if parent.exists() and not parent.is_dir():
            raise ConversionError(f"{_as_given(parent, shown)} is a file, not a folder, so the destination {shown} "
                                  "cannot be created inside it; choose another destination")
        if not parent.exists():
            break
    if not absolute.parent.is_dir() and not parents:  # a mistyped folder is not created silently
        raise ConversionError(f"{_as_given(absolute.parent, shown)}: no such file or directory (the folder of the destination "
                              f"{shown}; pass --parents to create it)")
    inside = enclosing_output(absolute)
    if inside is not None:
        raise ConversionError(
            f"{shown} lies inside {_as_given(inside, shown)}, an existing ternary_rs output: its files would be "
            "mixed with that checkpoint's (which verify then fails and --force can no longer replace); "
            "choose a destination outside it")


def _as_given(path: Path, given: Path) -> str:
    """``path`` (absolute, an ancestor of ``given``'s absolute form) spelled as the user spelled ``given``."""
    if given.is_absolute():
        return str(path)
    try:
        rel = path.relative_to(Path.cwd())
    except ValueError:
        return str(path)
    return str(rel) if str(rel) != "." else "."


def warn_literal_tilde(dst: str | os.PathLike) -> str | None:
    """A warning for a destination starting with a literal ``~`` (quoted, so the shell did not expand it):
    it names a folder called ``~`` in the current folder, not the home folder."""
    text = os.fspath(dst)
    if text == "~" or text.startswith("~/") or text.startswith("~" + os.sep):
        return (f"{text}: the destination starts with a literal '~' (quoted, so the shell did not expand it); "
                f"it names a folder called '~' in {Path.cwd()}, not your home folder {Path.home()}")
    return None


class EditedFiles:
    """Which files of a ternary_rs output directory no longer match its manifest (size or SHA-256).

    Such a file was changed after ternary_rs wrote it: a user's edit (a chat template in
    ``tokenizer_config.json``), so it is user data. Digests are remembered by (size, mtime): the check
    before a conversion and the one again just before the rename hash each unchanged file once.
    """

    def __init__(self) -> None:
        self._known: dict[tuple[str, int, int], str] = {}

    def __call__(self, out_dir: Path) -> list[str]:
        try:
            manifest = json.loads((out_dir / MANIFEST_NAME).read_text())
        except (OSError, ValueError):
            return []
        edited = []
        for rel, want in sorted((manifest.get("files") or {}).items()):
            p = out_dir / rel
            try:
                st = p.stat()
            except FileNotFoundError:
                continue  # a deleted output file holds nothing to lose
            if not isinstance(want, dict) or st.st_size != want.get("size"):
                edited.append(rel)
                continue
            key = (str(p), st.st_size, st.st_mtime_ns)
            if key not in self._known:
                self._known[key] = sha256_file(p)
            if self._known[key] != want.get("sha256"):
                edited.append(rel)
        return edited


def _refuse_edited(dst: Path, edited: list[str], when: str) -> None:
    if edited:
        shown = ", ".join(edited[:5]) + (f" and {len(edited) - 5} more" if len(edited) > 5 else "")
        raise TernaryFileExistsError(
            f"{dst} {when}, and {shown} changed since ternary_rs wrote it (its SHA-256 no longer matches "
            f"{MANIFEST_NAME}); refusing to replace it with --force, as that would lose the change: copy "
            f"what you need first, or pass --discard-edits as well to replace it anyway")


class Staging:
    """Write ``dst`` (a directory or a file) through a temporary sibling; :meth:`commit` renames it in.

    On an exception (including KeyboardInterrupt) the temporary is removed and ``dst`` is untouched.
    An existing ``dst`` is replaced only with ``force`` and only when it is a ternary_rs output
    (:func:`is_ternary_rs_output`): a user's own files are never deleted, whatever the flags. An output
    directory with a file edited since it was written (:class:`EditedFiles`) is replaced only when
    ``discard_edits`` says so as well.
    """

    def __init__(self, dst: str | os.PathLike, *, force: bool = False, directory: bool = True,
                 parents: bool = False, discard_edits: bool = False):
        self.shown = Path(dst)  # messages name the destination as the user gave it
        self.dst = Path(dst).absolute()
        self.created: list[Path] = []  # folders --parents made, removed again if the run fails
        self.force = force
        self.discard_edits = discard_edits
        self._edited = EditedFiles()
        self.directory = directory
        self.parents = parents
        self.tmp = self.dst.parent / f".{self.dst.name}{TMP_MARK}{os.getpid()}-{os.urandom(4).hex()}"
        self.committed = False

    def check_replaceable(self, when: str = "already exists") -> None:
        """Raise ``FileExistsError`` unless ``dst`` is absent or may be replaced (see the class doc)."""
        if not (self.dst.exists() or self.dst.is_symlink()):
            return
        if self.dst.is_symlink():  # refused with or without --force, and said so
            _refuse_foreign(self.dst, when, self.shown)
        if not self.force:
            raise TernaryFileExistsError(f"{self.shown} {when}; pass --force to replace a ternary_rs output")
        _refuse_foreign(self.dst, when, self.shown)
        if self.dst.is_dir() and not self.discard_edits:
            _refuse_edited(self.shown, self._edited(self.dst), when)

    def __enter__(self) -> Path:
        self.check_replaceable("already exists")
        check_destination_folder(self.shown, self.parents)
        if not self.dst.parent.is_dir():
            missing = [p for p in reversed(self.dst.parents) if not p.exists()]
            self.dst.parent.mkdir(parents=True, exist_ok=True)
            self.created = missing
        remove_stale_temporaries(self.dst)
        if self.directory:
            self.tmp.mkdir()
        return self.tmp

    def commit(self) -> Path:
        _sleep_hook()  # tests: a window with every output file closed, before the rename
        old = None
        # Checked again: the destination may have appeared (or changed) while we were writing.
        self.check_replaceable("exists now (it appeared or changed during the conversion)")
        if self.dst.exists() and (self.directory or self.dst.is_dir()):
            old = self.dst.parent / f".{self.dst.name}{OLD_MARK}{os.getpid()}-{os.urandom(4).hex()}"
            os.replace(self.dst, old)
        os.replace(self.tmp, self.dst)  # atomic within one filesystem
        self.committed = True
        if old is not None and not _remove(old):  # read-only entries are made writable first
            import logging

            logging.getLogger("ternary_rs").warning(
                "%s: the replaced output could not be removed completely; what is left is in %s", self.shown, old)
        return self.dst

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.committed:
            _remove(self.tmp)
            for folder in reversed(self.created):  # innermost first; only while still empty
                try:
                    folder.rmdir()
                except OSError:
                    break


def check_disjoint(sources: Iterable[str | os.PathLike], dst: str | os.PathLike) -> None:
    """Refuse a destination that is, contains, or lies inside a source (a replace or a failed run
    could then delete the user's input)."""
    d = Path(dst).resolve()
    for src in sources:
        s = Path(src).resolve()
        if s == d:
            raise ConversionError(f"{src}: the destination {dst} is this source itself; choose another destination")
        if d in s.parents:
            raise ConversionError(f"{src}: the destination {dst} contains this source; choose a destination "
                                  f"outside it")
        if s in d.parents:
            raise ConversionError(f"{src}: the destination {dst} lies inside this source; choose a destination "
                                  f"outside it")


# ------------------------------------------------------------------------------------------ shards
@dataclass(frozen=True)
class OutTensor:
    """One tensor of the output: safetensors dtype string (``U8``, ``F16``, ``BF16``, ``F32``…)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Job:
    """A unit of work: produces the buffers of ``outputs`` (in order) from one source tensor.

    ``source`` names the source file and tensor for error messages; ``source_bytes`` feeds the progress bar.
    """

    outputs: list[OutTensor]
    produce: Callable[[], Sequence[Any]]
    source: str = ""
    source_bytes: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


def plan_shards(jobs: Sequence[Job], shard_size: int) -> list[list[int]]:
    """Greedy: consecutive jobs fill a shard up to ``shard_size`` bytes (a job never straddles shards,
    so one decode feeds both ``qweight`` and ``scales``; a job larger than the limit gets its own shard)."""
    shards: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, job in enumerate(jobs):
        if current and used + job.nbytes > shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(i)
        used += job.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def in_context(label: str, message: str) -> str:
    """``"<file>: tensor <t>: <what>"``, naming the tensor once even when ``message`` (a codec error)
    starts with ``tensor '<t>':`` itself."""
    m = re.search(r"tensor (\S+)$", label)
    if m:
        for own in (f"tensor '{m.group(1)}': ", f"tensor {m.group(1)}: "):
            if message.startswith(own):
                return f"{label}: {message[len(own):]}"
    return f"{label}: {message}"


def _sleep_hook() -> None:
    delay = os.environ.get(SLEEP_ENV)
    if delay:
        time.sleep(float(delay))


def run_jobs(jobs: Sequence[Job], consume: Callable[[int, Job, Sequence[Any]], None], progress=None) -> None:
    """Produce jobs on a worker thread (decoders release the GIL) ``PREFETCH_DEPTH`` ahead of ``consume``.

    Errors are re-raised as :class:`ConversionError` naming the source tensor. On any exception
    (Ctrl-C included) queued jobs are cancelled and the running one is not waited for: its result
    would be thrown away, and waiting for a large tensor's decode is what made an interrupt slow.
    """
    pending: deque[tuple[int, Future]] = deque()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ternary_rs-decode")
    it = iter(range(len(jobs)))

    def submit_next() -> None:
        i = next(it, None)
        if i is not None:
            pending.append((i, pool.submit(jobs[i].produce)))

    try:
        for _ in range(PREFETCH_DEPTH):
            submit_next()
        while pending:
            i, fut = pending.popleft()
            try:
                buffers = fut.result()
            except TernaryError as e:
                if isinstance(e, ConversionError):
                    raise
                raise type(e)(in_context(jobs[i].source, str(e))) from e
            except (ValueError, KeyError, OSError) as e:
                raise ConversionError(in_context(jobs[i].source, str(e))) from e
            submit_next()
            consume(i, jobs[i], buffers)
            if progress is not None:
                progress.update(jobs[i].source_bytes or jobs[i].nbytes)
                progress.set_postfix_str(f"tensor {i + 1}/{len(jobs)}", refresh=False)
            _sleep_hook()
    except BaseException:
        for _, fut in pending:
            fut.cancel()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)  # nothing is left in flight here


def write_shards(out_dir: Path, jobs: Sequence[Job], shard_size: int, progress=None,
                 digests: dict[str, Future] | None = None) -> dict[str, str]:
    """Write all jobs' outputs as sharded safetensors + index into ``out_dir``; returns the weight map.

    With ``digests``, each finished shard's SHA-256 is computed on a background thread (while later
    shards are written, from the page cache) and its future stored under the shard's file name.
    """
    hash_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ternary_rs-hash") if digests is not None else None
    stop_hashing = threading.Event()

    def finished(s: int) -> None:
        if hash_pool is not None:
            digests[files[s]] = hash_pool.submit(sha256_file, out_dir / files[s], stop_hashing)

    from .writers import SafetensorsWriter

    shards = plan_shards(jobs, shard_size)
    count = len(shards)
    shard_of_job = {}
    files = []
    for s, members in enumerate(shards):
        fname = SHARD_PATTERN.format(index=s + 1, count=count)
        files.append(fname)
        for j in members:
            shard_of_job[j] = s
    weight_map: dict[str, str] = {}
    seen: set[str] = set()
    for j, job in enumerate(jobs):
        for o in job.outputs:
            if o.name in seen:
                raise ConversionError(f"{job.source}: output tensor {o.name} written twice")
            seen.add(o.name)
            weight_map[o.name] = files[shard_of_job[j]]

    writers: dict[int, Any] = {}

    def open_shard(s: int):
        tensors = [(o.name, o.dtype, tuple(o.shape)) for j in shards[s] for o in jobs[j].outputs]
        return SafetensorsWriter(out_dir / files[s], tensors=tensors, metadata={"format": "pt"})

    def consume(j: int, job: Job, buffers: Sequence[Any]) -> None:
        s = shard_of_job[j]
        if s not in writers:
            for prev in list(writers):  # shards are filled in order: close the finished one
                writers.pop(prev).close()
                finished(prev)
            writers[s] = open_shard(s)
        if len(buffers) != len(job.outputs):
            raise ConversionError(f"{job.source}: produced {len(buffers)} buffers for {len(job.outputs)} outputs")
        for o, buf in zip(job.outputs, buffers):
            nbytes = memoryview(buf).nbytes
            if nbytes != o.nbytes:
                raise ConversionError(f"{job.source}: {o.name} has {nbytes} bytes, expected {o.nbytes}")
            writers[s].write(o.name, buf)

    try:
        run_jobs(jobs, consume, progress)
        for s in list(writers):
            writers.pop(s).close()
            finished(s)
        for s in range(len(shards)):  # shards with no tensors (empty model) still get a file
            if not (out_dir / files[s]).exists():
                open_shard(s).close()
                finished(s)
    except BaseException:
        if hash_pool is not None:
            stop_hashing.set()  # a running hash stops within one chunk
            hash_pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        for w in writers.values():  # only left here on error: drop the partial shard
            try:
                w.abort()
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
    total = sum(job.nbytes for job in jobs)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    if hash_pool is not None:
        hash_pool.shutdown(wait=False)  # queued hashes still run; write_manifest waits for them
    return weight_map


# ------------------------------------------------------------------------------------------ manifest
def sha256_file(path: str | os.PathLike, stop: threading.Event | None = None) -> str:
    """SHA-256 hex digest of a file, read in ``HASH_CHUNK_BYTES`` chunks.

    With ``stop``, the event is checked between chunks and :class:`concurrent.futures.CancelledError`
    raised once it is set: hashing a multi-GB file on a background thread must not hold up an
    interrupted conversion (the interpreter joins such threads before it exits).
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            if stop is not None and stop.is_set():
                raise CancelledError(f"{path}: hashing stopped")
            h.update(chunk)  # hashlib releases the GIL for large buffers
    return h.hexdigest()


class SourceHasher:
    """Hashes source files on a background thread while the conversion runs; :meth:`cancel` stops it
    within one chunk."""

    def __init__(self, paths: Iterable[str | os.PathLike]):
        self.paths = [Path(p).absolute() for p in paths]
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ternary_rs-hash")
        self._futures = [self._pool.submit(sha256_file, p, self._stop) for p in self.paths]

    def result(self) -> list[dict[str, Any]]:
        try:
            return [
                {"path": str(p), "size": p.stat().st_size, "sha256": f.result()}
                for p, f in zip(self.paths, self._futures)
            ]
        finally:
            self._pool.shutdown(wait=False)

    def cancel(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


def write_manifest(out_dir: Path, sources: list[dict[str, Any]], details: dict[str, Any],
                   digests: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``ternary_rs.json``: tool version, sources (size + SHA-256) and every written file's SHA-256.

    ``digests`` may hold already computed (or pending: futures) SHA-256 values by relative path.
    """
    files = {}
    digests = digests or {}
    for p in sorted(out_dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST_NAME:
            rel = p.relative_to(out_dir).as_posix()
            known = digests.get(rel)
            digest = known.result() if isinstance(known, Future) else known
            files[rel] = {"size": p.stat().st_size, "sha256": digest or sha256_file(p)}
    manifest = {
        "manifest_version": MANIFEST_FORMAT_VERSION,
        "tool": "ternary_rs",
        "tool_version": __version__,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sources": sources,
        **details,
        "files": files,
    }
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
