"""Shared pytest fixtures (kept small; helpers that only one test file needs live in that file)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

# A suite started in the background of a non-interactive shell (`cmd &`, nohup) inherits SIGINT ignored,
# and so does every process it starts: the tests that interrupt a conversion or a server with SIGINT then
# saw it finish instead (4 failures in one such run). An ignored SIGINT survives exec; a handled one does
# not, so handling it here gives the children the default again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Variables that change how vLLM or the kernels run in every later subprocess of the session.
_ISOLATED_ENV_PREFIXES = ("VLLM_", "TERNARY_RS_", "OMP_")


@pytest.fixture(autouse=True)
def _no_leaked_settings():
    """Undo whatever a test (or the in-process vLLM engine and plugin it started) wrote into the
    environment's vLLM / ternary_rs / OpenMP settings: a leaked ``VLLM_CPU_OMP_THREADS_BIND`` once made
    every later TP=2 run fail, a leaked ``VLLM_CPU_KVCACHE_SPACE`` hid a serve refusal."""
    before = {k: v for k, v in os.environ.items() if k.startswith(_ISOLATED_ENV_PREFIXES)}
    yield
    for k in [k for k in os.environ if k.startswith(_ISOLATED_ENV_PREFIXES)]:
        if k not in before:
            del os.environ[k]
    os.environ.update(before)


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator, so every run builds the same fixtures."""
    return np.random.default_rng(20261130)


@pytest.fixture
def ternary_weights(rng):
    """A factory of ternary-valued float32 matrices ``t · s`` (t in {-1, 0, +1}, one s per row),
    the shape quantizers such as TQ1_0/TQ2_0 reproduce exactly."""

    def make(rows: int, cols: int) -> np.ndarray:
        t = rng.integers(-1, 2, size=(rows, cols)).astype(np.float32)
        s = rng.uniform(0.01, 2.0, size=(rows, 1)).astype(np.float32)
        return t * s

    return make
