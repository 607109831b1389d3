"""Hostile checkpoints at vLLM load: each must fail with a clear error naming the file and tensor (or the
config.json field), before anything is served — never a crash, never silent garbage.

Checkpoints are written by the independent contract writer (tests/support/contract_writer.py, plain NumPy from
docs/checkpoint.md#checkpoint-contract) from a tiny ternarized Qwen3 (tests/support/models.py) and then damaged with ``safetensors.numpy``
and plain JSON edits. vLLM (CPU) loads them in a subprocess (tests/support/vllm_runner.py --load-probe: one process for
all cases, engine in-process); the undamaged checkpoint is loaded last as the control. One case also
runs the OpenAI server, which must exit without ever answering /health.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
from support.contract_writer import write_contract  # noqa: E402
from support.models import build_tiny_model  # noqa: E402
from ternary_rs.serving.health import free_port, is_healthy  # noqa: E402

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).parent
PROBE_TIMEOUT_S = 1500
INDEX = "model.safetensors.index.json"


# ------------------------------------------------------------------------------------------ damage
def _shard_of(ckpt: Path, tensor: str) -> Path:
    return ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][tensor]


def _edit_shard(ckpt: Path, tensor: str, edit) -> Path:
    """Rewrite the shard holding ``tensor`` with ``edit(tensors)`` applied (safetensors.numpy)."""
    from safetensors.numpy import load_file, save_file

    shard = _shard_of(ckpt, tensor)
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors or v != shard.name}
    for name in tensors:
        index["weight_map"][name] = shard.name
    (ckpt / INDEX).write_text(json.dumps(index, indent=2))
    return shard


def _set(tensor: str, fn):
    def edit(t):
        t[tensor] = fn(t[tensor].copy())
    return edit


def _code3(q):
    q[3, 5] = 0xFF  # four codes 3
    return q


def _scale_at(value):
    def fn(s):
        s[2, 0] = value
        return s
    return fn


def _quant_config(ckpt: Path, **changes) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))


DOWN1 = "model.layers.1.mlp.down_proj"
K0 = "model.layers.0.self_attn.k_proj"
UP0 = "model.layers.0.mlp.up_proj"
EMBED = "model.embed_tokens"

# name -> (damage(ckpt) -> file the error must name (or None: config.json), patterns the error must hold)
CASES = {
    "code3": (lambda c: _edit_shard(c, DOWN1 + ".qweight", _set(DOWN1 + ".qweight", _code3)),
              [DOWN1 + ".qweight", "code 3", "first at [3, 5]"]),
    "nan_scale_fused": (lambda c: _edit_shard(c, K0 + ".scales", _set(K0 + ".scales", _scale_at(np.nan))),
                        [K0 + ".scales", "NaN/Inf", "first at [2, 0]"]),
    "inf_scale_embedding": (lambda c: _edit_shard(c, EMBED + ".scales", _set(EMBED + ".scales", _scale_at(np.inf))),
                            [EMBED + ".scales", "NaN/Inf", "first at [2, 0]"]),
    "scales_wrong_shape": (lambda c: _edit_shard(c, UP0 + ".scales",
                                                 _set(UP0 + ".scales", lambda s: np.repeat(s, 2, axis=1))),
                           [UP0 + ".scales", "has shape", "expected"]),
    "scales_wrong_dtype": (lambda c: _edit_shard(c, UP0 + ".scales", _set(UP0 + ".scales", lambda s: s.astype(np.float32))),
                           [UP0 + ".scales", "is F32", "F16"]),
    "qweight_wrong_dtype": (lambda c: _edit_shard(c, UP0 + ".qweight", _set(UP0 + ".qweight", lambda q: q.astype(np.int16))),
                            [UP0 + ".qweight", "I16", "U8"]),
    "missing_scales": (lambda c: (_edit_shard(c, K0 + ".scales", lambda t: t.pop(K0 + ".scales")),
                                  _shard_of(c, K0 + ".qweight"))[-1],
                       [K0 + ".qweight", "missing scales"]),
    "missing_qweight": (lambda c: (_edit_shard(c, DOWN1 + ".qweight", lambda t: t.pop(DOWN1 + ".qweight")),
                                   _shard_of(c, DOWN1 + ".scales"))[-1],
                        [DOWN1 + ".scales", "missing qweight"]),
    "missing_layer": (lambda c: (_edit_shard(c, DOWN1 + ".qweight", lambda t: t.pop(DOWN1 + ".qweight")),
                                 _edit_shard(c, DOWN1 + ".scales", lambda t: t.pop(DOWN1 + ".scales")), None)[-1],
                      [DOWN1, "has no tensors"]),
    "truncated_shard": (lambda c: (lambda p: (os.truncate(p, p.stat().st_size * 2 // 3), p)[1])(
                            _shard_of(c, DOWN1 + ".qweight")),
                        ["run past the end of the file"]),
    "format_version_2": (lambda c: _quant_config(c, format_version=2), ["config.json", "format_version 2"]),
    "group_size_48": (lambda c: _quant_config(c, group_size=48), ["config.json", "group_size 48"]),
    "group_size_mismatch": (lambda c: _quant_config(c, group_size=64), [".scales", "has shape", "group_size = 64"]),
    "unknown_rotation_version": (lambda c: _quant_config(c, hadamard={"version": 7}), ["config.json", "hadamard", "version 7"]),
    "unknown_rotation_key": (lambda c: _quant_config(c, hadamard={"version": 1, "transform": "x", "rotate_twice": True}),
                             ["config.json", "hadamard", "rotate_twice"]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, Path | None]]:
    """The undamaged contract checkpoint ("control") and one damaged copy per case: name -> (dir, file
    the error must name, or None when it is config.json or a layer without a file)."""
    root = tmp_path_factory.mktemp("hostile")
    hf = root / "hf"
    build_tiny_model(hf, group_size=128, seed=5)
    base = write_contract(hf, root / "control", group_size=128, num_shards=2)
    out = {"control": (base, None)}
    for name, (damage, _) in CASES.items():
        ckpt = root / name
        shutil.copytree(base, ckpt)
        file = damage(ckpt)
        out[name] = (ckpt, Path(file) if isinstance(file, Path) else None)
    return out


@pytest.fixture(scope="module")
def probe(checkpoints, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("probe") / "result.json"
    order = [n for n in CASES] + ["control"]
    cmd = [sys.executable, str(TESTS / "support" / "vllm_runner.py"), "--load-probe", "--out", str(out),
           "--model"] + [str(checkpoints[n][0]) for n in order]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    if not out.exists():
        pytest.fail(f"probe wrote nothing ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    results = {Path(r["model"]).name: r for r in json.loads(out.read_text())}
    if len(results) != len(order):
        pytest.fail(f"probe stopped after {len(results)} of {len(order)} cases ({proc.returncode}):\n"
                    f"{proc.stderr[-6000:]}")
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_checkpoint_refused_with_file_and_tensor(case, checkpoints, probe):
    r = probe[case]
    assert not r["ok"], f"{case}: vLLM loaded a damaged checkpoint and generated {r['text']!r}"
    err = r["error"]
    _, file = checkpoints[case]
    named = str(file) if file is not None else (str(checkpoints[case][0]) if case == "missing_layer" else None)
    if named is not None:
        assert named in err, f"{case}: the error does not name {named}:\n{err}"
    for pattern in CASES[case][1]:
        assert pattern in err, f"{case}: {pattern!r} missing from:\n{err}"
    for crash in ("Segmentation", "core dumped", "AssertionError", "KeyError", "IndexError"):
        assert crash not in err, f"{case}: not a clean error:\n{err}"


def test_undamaged_checkpoint_still_loads(probe):
    """The control: the checks refuse nothing valid (loaded after every damaged case in the same process)."""
    r = probe["control"]
    assert r["ok"], r["error"]


def test_server_refuses_before_serving(checkpoints, tmp_path):
    """The OpenAI server on a checkpoint with code 3: it exits non-zero with the file and tensor in its
    log, and /health never answers."""
    ckpt, file = checkpoints["code3"]
    port = free_port()
    sys.path.insert(0, str(TESTS))
    from support.vllm_runner import cpu_env

    saved = dict(os.environ)
    cpu_env(1)
    env = dict(os.environ)
    os.environ.clear()
    os.environ.update(saved)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = tmp_path / "server.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--port", str(port),
             "--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "128", "--dtype", "float32"],
            stdout=fh, stderr=subprocess.STDOUT, env=env)
        served = False
        try:
            deadline = time.time() + PROBE_TIMEOUT_S
            while proc.poll() is None and time.time() < deadline:
                served = served or is_healthy(f"http://127.0.0.1:{port}", timeout=2)
                time.sleep(1)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert not served, "the server answered /health for a checkpoint holding code 3"
    assert proc.returncode not in (0, None), text[-3000:]
    assert str(file) in text and DOWN1 + ".qweight" in text, text[-6000:]
