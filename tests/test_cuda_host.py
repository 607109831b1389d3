"""Host-side checks of the CUDA kernels that need no GPU and no CUDA toolkit.

``cuda/tests/test_fragments.cpp`` replays both kernels' per-lane logic (weight-word unpacking, mma.sync and
ldmatrix fragment assembly from their PTX ISA definitions, the swizzled shared-memory tile, group-scale
flushes, split-K reduction) over whole grids and compares with a float64 ``x @ W.T + bias`` built from an
independent implementation of the layout spec. Here it is compiled with the system C++ compiler and run.
(``scripts/check_cuda.sh`` runs it too, next to the nvcc/ptxas checks.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fragment_replays_match_reference(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    assert cxx, "a C++17 compiler (g++/clang++) is needed to build cuda/tests/test_fragments.cpp"
    exe = tmp_path / "test_fragments"
    subprocess.run(
        [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", str(ROOT / "cuda/tests/test_fragments.cpp"), "-o", str(exe)],
        check=True,
        capture_output=True,
        text=True,
    )
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "all fragment replays match the reference" in run.stdout
    # Both kernels, split-K and the GEMV cut-off at 8 and 16 were exercised.
    out = run.stdout
    assert "kernel 0" in out and "kernel 4" in out and "cut-off 16" in out
    assert any(f"{s} split(s)" in out for s in (2, 4, 8, 16))
