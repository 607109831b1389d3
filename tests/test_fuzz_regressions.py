"""Inputs the fuzzers found (scripts/fuzz.sh), kept as regression cases, plus a short fuzz run of each
Python target so CI exercises the harness.

Rust targets replay their regressions in ``cargo test`` (``ternary_core::fuzzing``, files under
``rust/ternary-core/fuzz/regressions/<target>/``); the Python target ``prism_hadamard`` (the rotation
parsers, ``ternary_rs.core.hadamard.HadamardSpec``) replays its findings here. Each once raised something
other than ``ValidationError`` (ValueError, TypeError, IndexError, OverflowError, UnicodeDecodeError)
or was silently accepted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")  # ternary_rs.core.hadamard registers a torch op

from ternary_rs._core import ValidationError  # noqa: E402
from ternary_rs.core import hadamard as H  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SIGNS8 = [1, -1, 1, 1, -1, -1, 1, -1]
SIGNS16 = SIGNS8 + SIGNS8[::-1]


def prism_kv(**override):
    kv = {"version": 1, "transform": H.PRISM_TRANSFORM, "axis": H.PRISM_AXIS, "sign_mode": H.PRISM_SIGN_MODES[0],
          "block_size": 4, "sign_widths": [8, 16], "sign_values": SIGNS8 + SIGNS16,
          "weight_names": ["blk.0.attn_q.weight", "blk.1.ssm_out.weight"]}
    return {**kv, **override}


def resolve(name):
    return {"blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj", 8),
            "blk.1.ssm_out.weight": ("model.layers.1.linear_attn.out_proj", 16)}.get(name)


def checkpoint_cfg(**override):
    cfg = H.HadamardSpec.from_prism(prism_kv(), resolve).to_config()
    cfg["layers"]["model.layers.1.linear_attn.out_proj"]["gdn_permute"] = {
        "from": "grouped", "to": "tiled", "num_v_heads": 2, "num_k_heads": 1, "head_dim": 8}
    return {**cfg, **override}


def with_permute(**fields):
    cfg = checkpoint_cfg()
    cfg["layers"]["model.layers.1.linear_attn.out_proj"]["gdn_permute"].update(fields)
    return cfg


def test_valid_inputs_parse():
    spec = H.HadamardSpec.from_config(checkpoint_cfg())
    assert spec.layers["model.layers.1.linear_attn.out_proj"][1] == H.GdnPermute("grouped", "tiled", 2, 1, 8)
    assert H.HadamardSpec.from_prism(prism_kv(), resolve).block_size == 4


@pytest.mark.parametrize("sign_values, was", [
    (SIGNS8[:5] + [SIGNS16] + SIGNS8[5:] + SIGNS16[1:], "ValueError: inhomogeneous shape"),
    (SIGNS8[:-1] + [b"\xec"] + SIGNS16, "UnicodeDecodeError"),
    (SIGNS8[:-1] + ["1"] + SIGNS16, "string accepted by NumPy"),
    (SIGNS8[:-1] + [1.0] + SIGNS16, "float accepted as a sign"),
    (SIGNS8[:-1] + [True] + SIGNS16, "bool accepted as a sign"),
    (SIGNS8[:-1] + [2**70] + SIGNS16, "OverflowError"),
])
@pytest.mark.parametrize("reader", ["from_prism", "from_config"])
def test_sign_values_must_be_plus_minus_one_integers(sign_values, was, reader):
    with pytest.raises(ValidationError, match=r"sign_values(\[\d+\])?"):
        if reader == "from_prism":
            H.HadamardSpec.from_prism(prism_kv(sign_values=sign_values), resolve)
        else:
            H.HadamardSpec.from_config(checkpoint_cfg(sign_values=sign_values))


@pytest.mark.parametrize("cfg, was", [
    (lambda: with_permute(num_k_heads=float("inf")), "OverflowError"),
    (lambda: with_permute(num_k_heads=1.5), "1.5 truncated to 1 silently"),
    (lambda: with_permute(head_dim="8"), "string head_dim accepted"),
    (lambda: with_permute(**{"from": []}), "TypeError: unhashable type"),
    (lambda: with_permute(num_v_heads=-2, head_dim=-8), "negative head counts accepted"),
    (lambda: with_permute(extra=1), "unknown gdn_permute key accepted"),
])
def test_malformed_gdn_permute_is_refused(cfg, was):
    with pytest.raises(ValidationError, match="gdn_permute|num_|head_dim|GDN"):
        H.HadamardSpec.from_config(cfg())


def test_gdn_permute_not_an_object_is_refused():
    cfg = checkpoint_cfg()
    cfg["layers"]["model.layers.1.linear_attn.out_proj"]["gdn_permute"] = 3  # was IndexError
    with pytest.raises(ValidationError, match="malformed gdn_permute"):
        H.HadamardSpec.from_config(cfg)


def test_short_fuzz_run_finds_nothing(tmp_path):
    """A few thousand executions of scripts/fuzz_hadamard.py (the full run is scripts/fuzz.sh)."""
    sys.path.insert(0, str(SCRIPTS))
    import fuzz_hadamard

    assert fuzz_hadamard.run(seconds=0, min_execs=3000, artifacts=tmp_path, seed=1) == 0
    assert not list(tmp_path.iterdir())


def test_fuzz_seed_corpus_builds(tmp_path):
    """scripts/fuzz_seeds.py builds a corpus for every Rust target (names kept in step with
    ternary_core::fuzzing::TARGETS, which scripts/fuzz.sh also lists)."""
    import subprocess

    r = subprocess.run([sys.executable, str(SCRIPTS / "fuzz_seeds.py"), str(tmp_path)], capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    rust = (Path(__file__).resolve().parent.parent / "rust/ternary-core/src/fuzzing.rs").read_text()
    targets = rust.split("pub const TARGETS")[1].split("];")[0]
    names = [line.split('"')[1] for line in targets.splitlines() if '("' in line]
    assert len(names) == 14
    fuzz_sh = (SCRIPTS / "fuzz.sh").read_text()
    for name in names:
        assert any((tmp_path / name).iterdir()), f"no seeds for {name}"
        assert name in fuzz_sh, f"scripts/fuzz.sh does not run {name}"
    assert np.all([(tmp_path / n).is_dir() for n in names])
