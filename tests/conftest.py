"""Shared pytest fixtures (kept small; helpers that only one test file needs live in that file)."""

from __future__ import annotations

import numpy as np
import pytest


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
