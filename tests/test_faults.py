"""Faults during conversion: each must end in a clean error (exit 1, one line naming the file), leave
nothing that looks like an output, and a rerun once the fault is gone must succeed.

Faults: the destination file system fills up mid-write (a small tmpfs), the destination turns read-only
mid-run (the tmpfs remounted ``ro``), the source is truncated, rewritten or replaced while it is read,
SIGKILL at many points of a bulk job, and stale staging folders from earlier crashes. ``verify`` must
reject every output cut short. Every conversion runs the real CLI in a subprocess; the outcome is
judged by ``ternary-rs verify`` and by listing the destination's parent (hidden temporaries are the
only thing allowed to remain, and only where the file system refused their removal).

The tmpfs tests mount file systems, which needs root (CAP_SYS_ADMIN); without it they are skipped with
that reason.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ternary_rs

sys.path.insert(0, str(Path(__file__).parent))
from support.models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

TMP_MARK = ".ternary_rs-tmp-"
SLEEP_ENV = "TERNARY_RS_TEST_SLEEP_PER_TENSOR"
CLI_TIMEOUT_S = 300


def cli(*args: str, env: dict | None = None, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ternary_rs", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, check=False)


def convert_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ternary_rs", "convert", *args, "--no-progress"]


def verify_ok(path: Path) -> bool:
    return cli("verify", str(path)).returncode == 0


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir()) if parent.is_dir() else []


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny ternarized Qwen3 (Hugging Face directory, 25 tensors, ~1 MB)."""
    hf = tmp_path_factory.mktemp("faults") / "hf"
    build_tiny_model(hf, hidden=128, intermediate=256, layers=2, seed=3)
    return hf


@pytest.fixture(scope="module")
def reference_output(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults_ref") / "out"
    r = cli("convert", str(source), str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def reference_gguf(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults_ref_gguf") / "out.gguf"
    r = cli("convert", str(source), str(out), "--to", "gguf", "--no-progress")
    assert r.returncode == 0, r.stderr
    return out


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------- tmpfs
class Tmpfs:
    """A tmpfs of a given size mounted on a fresh directory (unmounted at the end)."""

    def __init__(self, where: Path, size: int):
        self.path = where
        self.path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")

    def remount(self, *options: str) -> subprocess.CompletedProcess:
        return subprocess.run(["mount", "-o", ",".join(("remount",) + options), str(self.path)],
                              capture_output=True, text=True, check=False)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def tmpfs(tmp_path):
    mounted: list[Tmpfs] = []

    def make(size: int) -> Tmpfs:
        fs = Tmpfs(tmp_path / f"mnt{len(mounted)}", size)
        mounted.append(fs)
        return fs

    yield make
    for fs in mounted:
        fs.close()


@pytest.mark.parametrize("src, to, fraction", [
    ("hf", "vllm", 0.1), ("hf", "vllm", 0.5), ("hf", "vllm", 0.95),
    ("hf", "gguf", 0.1), ("hf", "gguf", 0.5), ("hf", "gguf", 0.95),
    # A GGUF source also writes the tokenizer through a scratch folder beside the destination.
    ("gguf", "vllm", 0.5), ("gguf", "vllm", 0.95),
])
def test_disk_full_mid_write(source, reference_output, reference_gguf, tmpfs, src, to, fraction):
    """ENOSPC at several points (early in the shards, mid-way, at the very end): a clean error, an
    empty destination file system, and the same command succeeds once there is room."""
    need = _du(reference_gguf if to == "gguf" else reference_output)
    fs = tmpfs(max(4096, int(need * fraction)))
    dst = fs.path / ("out.gguf" if to == "gguf" else "out")
    src_path = reference_gguf if src == "gguf" else source
    args = ["convert", str(src_path), str(dst), "--to", to, "--no-progress"]
    r = cli(*args)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "No space left on device" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert leftovers(fs.path) == [], "a failed conversion left files behind"
    assert fs.remount(f"size={4 * need + (1 << 20)}").returncode == 0
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert verify_ok(dst)
    assert leftovers(fs.path) == [dst.name]


def test_destination_turns_read_only(source, reference_output, tmpfs):
    """The destination file system is remounted read-only while the conversion writes: the run fails
    cleanly, no output appears, and after the file system is writable again a rerun succeeds and
    sweeps the staging folder the failed run could not remove."""
    fs = tmpfs(8 * _du(reference_output) + (1 << 20))
    dst = fs.path / "out"
    proc = subprocess.Popen(convert_cmd(str(source), str(dst)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, SLEEP_ENV: "0.15"})
    try:
        # Wait until the run is writing, then flip to read-only. A remount fails (EBUSY) while a file
        # is open for writing, so retry until it lands between two files.
        deadline = time.time() + CLI_TIMEOUT_S
        while not any(TMP_MARK in n for n in leftovers(fs.path)):
            assert proc.poll() is None and time.time() < deadline, "conversion never started writing"
            time.sleep(0.02)
        while fs.remount("ro").returncode != 0:
            assert proc.poll() is None, "conversion finished before the file system could be made read-only"
            time.sleep(0.005)
        out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (out, err)
    assert "Read-only file system" in err and "Traceback" not in err, err
    assert not dst.exists()
    # Only the hidden staging folder may remain (a read-only file system refuses its removal).
    assert all(n.startswith(f".{dst.name}{TMP_MARK}") for n in leftovers(fs.path)), leftovers(fs.path)
    assert fs.remount("rw").returncode == 0
    r = cli("convert", str(source), str(dst), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert verify_ok(dst)
    assert leftovers(fs.path) == [dst.name], "the rerun did not sweep the dead run's staging folder"


# ---------------------------------------------------------------------------------------------- source changes
def _gguf_source(source: Path, where: Path) -> Path:
    out = where / "src.gguf"
    r = cli("convert", str(source), str(out), "--to", "gguf", "--no-progress")
    assert r.returncode == 0, r.stderr
    return out


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 3)


def _rewrite_in_place(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)  # same size, later tensors zeroed
    with open(path, "r+b") as f:
        f.write(data)


def _replace(path: Path) -> None:
    other = path.with_name(path.name + ".new")
    shutil.copyfile(path, other)
    with open(other, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\x55" * 8)
    os.replace(other, path)


@pytest.mark.parametrize("change, message", [
    (_truncate, "shrank|changed size"),
    (_rewrite_in_place, "was modified"),
    (_replace, "replaced"),
])
@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_source_changes_while_read(source, tmp_path, change, message, kind):
    """The source is truncated (a mapped file that shrinks raises SIGBUS on access: guarded), rewritten
    in place or replaced while the conversion reads it: a clean error naming the source, nothing that
    looks like an output, and a rerun on the restored source succeeds."""
    work = tmp_path / "work"
    if kind == "gguf":
        src = _gguf_source(source, tmp_path)
        victim = src
    else:
        src = work / "hf"
        shutil.copytree(source, src)
        victim = src / "model.safetensors"
    pristine = tmp_path / "pristine"
    shutil.copyfile(victim, pristine)
    dst = tmp_path / "out"
    proc = subprocess.Popen(convert_cmd(str(src), str(dst)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, SLEEP_ENV: "0.15"})
    try:
        deadline = time.time() + CLI_TIMEOUT_S
        # Change the source once tensors are being written (the shard exists in the staging folder).
        while not any(p.suffix in (".safetensors", ".gguf") for d in tmp_path.glob(f".{dst.name}{TMP_MARK}*")
                      for p in (d.iterdir() if d.is_dir() else [d])):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.02)
        change(victim)
        out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (proc.returncode, out, err)
    assert str(victim) in err and "Traceback" not in err, err
    assert __import__("re").search(message, err), err
    assert not dst.exists()
    assert leftovers(tmp_path) == sorted(n for n in ("work", "src.gguf", "pristine") if (tmp_path / n).exists())
    shutil.copyfile(pristine, victim)
    r = cli("convert", str(src), str(dst), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert verify_ok(dst)


# ---------------------------------------------------------------------------------------------- SIGKILL
def _only_outputs_or_hidden_temporaries(out_root: Path, names: list[str]) -> list[str]:
    """Every entry of a bulk job's folder is a complete output (verify passes) or a hidden temporary."""
    complete = []
    for n in leftovers(out_root):
        if n.startswith(".") and (TMP_MARK in n or ".ternary_rs-old-" in n):
            continue
        assert n in names, f"unexpected entry {n}"
        assert verify_ok(out_root / n), f"{n} looks like an output but does not verify"
        complete.append(n)
    return complete


def test_sigkill_at_random_points_of_a_bulk_job(source, tmp_path):
    """SIGKILL at 12 random moments of a 3-input bulk job: whatever exists then is either a complete,
    verified output or a hidden temporary; the rerun (``--force``) completes every output and sweeps
    the dead runs' temporaries."""
    inputs = []
    for i in range(3):
        d = tmp_path / f"model{i}"
        shutil.copytree(source, d)
        inputs.append(d)
    out_root = tmp_path / "out"
    names = [d.name for d in inputs]
    env = {**os.environ, SLEEP_ENV: "0.03"}
    # One undisturbed run for the job's duration.
    t0 = time.time()
    r = subprocess.run(convert_cmd(*map(str, inputs), str(tmp_path / "timing")), capture_output=True, text=True,
                       env=env, timeout=CLI_TIMEOUT_S, check=False)
    assert r.returncode == 0, r.stderr
    duration = time.time() - t0
    shutil.rmtree(tmp_path / "timing")
    rng = random.Random(13)
    mid_write = 0
    for _ in range(12):
        proc = subprocess.Popen(convert_cmd(*map(str, inputs), str(out_root), "--force"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        time.sleep(rng.uniform(0.2, duration))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out_root.is_dir():
            complete = _only_outputs_or_hidden_temporaries(out_root, names)
            mid_write += len(leftovers(out_root)) > len(complete)
    assert mid_write >= 1, "no kill landed while an output was being written"
    r = subprocess.run(convert_cmd(*map(str, inputs), str(out_root), "--force"), capture_output=True, text=True,
                       timeout=CLI_TIMEOUT_S, check=False)
    assert r.returncode == 0, r.stderr
    assert leftovers(out_root) == sorted(names), "the rerun left temporaries of the killed runs"
    assert all(verify_ok(out_root / n) for n in names)


# ---------------------------------------------------------------------------------------------- stale staging
def test_stale_staging_is_swept_and_never_taken_for_output(source, reference_output, tmp_path):
    """A complete-looking staging folder of a dead run (and a half-replaced old one) next to the
    destination: convert removes them and writes its own output; a staging folder of a live process is
    left alone and does not stop the conversion."""
    dst = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a PID that no longer runs
    stale = tmp_path / f".out{TMP_MARK}{dead.pid}-deadbeef"
    shutil.copytree(reference_output, stale)
    (stale / "config.json").write_text("{}")  # if it were taken for the output, verify would fail
    old = tmp_path / f".out.ternary_rs-old-{dead.pid}-cafe0000"
    shutil.copytree(reference_output, old)
    live = tmp_path / f".out{TMP_MARK}{os.getpid()}-00000000"
    live.mkdir()
    r = cli("convert", str(source), str(dst), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert not stale.exists() and not old.exists(), "stale temporaries of a dead run were not removed"
    assert live.is_dir(), "a live process's staging folder was removed"
    assert verify_ok(dst)
    assert leftovers(tmp_path) == sorted([dst.name, live.name])


# ---------------------------------------------------------------------------------------------- verify
def test_verify_rejects_every_output_cut_short(reference_output, tmp_path):
    """Every file of a converted checkpoint cut at several points (and each one missing) is reported."""
    files = sorted(p.name for p in reference_output.iterdir())
    assert {"config.json", "model.safetensors.index.json", "ternary_rs.json"} <= set(files)
    cases = 0
    for name in files:
        data = (reference_output / name).read_bytes()
        size = len(data)
        # Dropping only a final newline loses nothing (the manifest cannot hash itself): cut one more.
        last = size - 2 if data.endswith(b"\n") else size - 1
        cuts = [c for c in dict.fromkeys((0, 1, size // 2, last)) if 0 <= c < size]
        # A missing file too — except the manifest: the contract does not require one (other writers
        # have none), so a checkpoint without it is valid, only unchecksummed.
        for cut in cuts + ([None] if name != "ternary_rs.json" else []):
            bad = tmp_path / f"cut-{name}-{cut}"
            shutil.copytree(reference_output, bad)
            if cut is None:
                (bad / name).unlink()
            else:
                os.truncate(bad / name, cut)
            report = ternary_rs.verify(bad)  # in-process: ~40 cases; the CLI's exit status is checked below
            assert not report.ok, f"verify accepted {name} cut to {cut} bytes:\n{report}"
            if cases == 0:
                r = cli("verify", str(bad))
                assert r.returncode == 1 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
            shutil.rmtree(bad)
            cases += 1
    assert cases >= 4 * len(files)
