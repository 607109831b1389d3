"""The ``ternary-rs`` command line as the CLI tests run it: ``python -m ternary_rs`` in a subprocess, and a
converted demo model for a module of tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ternary_rs.demo import write_demo_gguf

CLI = [sys.executable, "-m", "ternary_rs"]


def run(*args, timeout=240, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)


def converted_demo(root: Path, gguf_name: str, seed: int) -> tuple[Path, Path, Path]:
    """``(root, src, out)``: the built-in PQ2_0 demo GGUF written to ``root/gguf_name`` and converted by the
    CLI to ``root/demo-vllm``."""
    src = root / gguf_name
    write_demo_gguf(src, "PQ2_0", seed=seed)
    out = root / "demo-vllm"
    r = run("convert", src, out)
    assert r.returncode == 0, r.stderr
    return root, src, out
