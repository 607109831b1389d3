"""The ``ternary-rs`` command in subprocesses: demo, bulk job with a corrupt input, interrupted
conversion (SIGKILL and SIGINT mid-way), refusal to overwrite, verify exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ternary_rs.checkpoint import SLEEP_ENV, TMP_MARK
from ternary_rs.demo import write_demo_gguf

CLI = [sys.executable, "-m", "ternary_rs"]


def run(*args, env=None, timeout=240):
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    a, b = root / "a.gguf", root / "b.gguf"
    write_demo_gguf(a, "PQ2_0", seed=1)
    write_demo_gguf(b, "PTQ1_0", seed=2)
    bad = root / "bad.gguf"
    bad.write_bytes(a.read_bytes()[: a.stat().st_size * 2 // 3])  # truncated download
    return root, a, b, bad


def test_demo_runs_quickly():
    t0 = time.perf_counter()
    r = run("demo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify: OK" in r.stdout and "really ternary: True" in r.stdout
    assert time.perf_counter() - t0 < 60


def test_bulk_job_reports_corrupt_input_and_converts_the_others(ggufs):
    root, a, b, bad = ggufs
    out = root / "bulk"
    r = run("convert", a, bad, b, out, "--no-progress")
    assert r.returncode == 1
    assert "bad.gguf" in r.stderr and "1 of 3 conversions failed" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["a", "b"]
    for name in ("a", "b"):
        assert run("verify", out / name).returncode == 0
    assert json.loads((out / "a" / "config.json").read_text())["quantization_config"]["group_size"] == 128


def test_existing_destination_needs_force(ggufs):
    root, a, _, _ = ggufs
    dst = root / "exists"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    r = run("convert", a, dst, "--no-progress", "--no-transformers")
    assert r.returncode == 1 and "--force" in r.stderr
    assert (dst / "keep.txt").read_text() == "precious"
    r = run("convert", a, dst, "--no-progress", "--force", "--no-transformers")
    assert r.returncode == 0, r.stderr
    assert not (dst / "keep.txt").exists() and (dst / "ternary_rs.json").is_file()


def _wait_for_temporary(root: Path, name: str, proc, timeout=120.0) -> Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        tmps = [p for p in root.iterdir() if p.name.startswith(f".{name}{TMP_MARK}") and any(p.glob("*.safetensors"))]
        if tmps:
            return tmps[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("conversion never started writing")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_conversion_leaves_no_valid_destination(ggufs, sig):
    root, a, _, _ = ggufs
    name = f"interrupted-{sig.name}"
    dst = root / name
    env = {**os.environ, SLEEP_ENV: "0.2"}
    proc = subprocess.Popen(CLI + ["convert", str(a), str(dst), "--no-progress", "--no-transformers"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tmp = _wait_for_temporary(root, name, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert not dst.exists()
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "interrupted" in err
        assert not tmp.exists()  # cleaned up on the way out
    r = run("convert", a, dst, "--no-progress", "--no-transformers")
    assert r.returncode == 0, r.stderr
    assert not tmp.exists()  # a dead run's temporary is removed by the next one
    assert [p.name for p in root.iterdir() if p.name.startswith(f".{name}")] == []  # scratch folders too
    assert run("verify", dst).returncode == 0


def test_inspect_json_and_verify_exit_status(ggufs):
    root, a, _, _ = ggufs
    r = run("inspect", a, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["architecture"] == "qwen3" and rep["is_ternary"] and rep["by_type"]["PQ2_0"]["tensors"] == 16
    dst = root / "to-flip"
    assert run("convert", a, dst, "--no-progress", "--no-transformers").returncode == 0
    shard = sorted(dst.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x40
    shard.write_bytes(bytes(data))
    r = run("verify", dst)
    assert r.returncode == 1 and shard.name in r.stdout and "FAILED" in r.stdout
    r = run("plan", dst, "--context", "1024", "--concurrency", "2", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["kv_cache_per_token"] == 2 * 2 * 2 * 64 * 2
