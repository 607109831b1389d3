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

from ternary_rs.demo import write_demo_gguf
from ternary_rs.sinks.checkpoint import SLEEP_ENV, TMP_MARK

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
    root, a, b, _ = ggufs
    dst = root / "exists"
    assert run("convert", a, dst, "--no-progress", "--no-transformers").returncode == 0
    first = (dst / "ternary_rs.json").read_text()
    r = run("convert", b, dst, "--no-progress", "--no-transformers")
    assert r.returncode == 1 and "--force" in r.stderr
    assert (dst / "ternary_rs.json").read_text() == first
    r = run("convert", b, dst, "--no-progress", "--force", "--no-transformers")
    assert r.returncode == 0, r.stderr
    assert json.loads((dst / "ternary_rs.json").read_text())["sources"][0]["path"].endswith("b.gguf")


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_force_never_deletes_a_source(ggufs, tmp_path):
    """``convert --force selfdir/model.gguf selfdir`` once deleted model.gguf: the destination is, contains or
    lies inside a source -> refused, nothing touched."""
    _, a, _, _ = ggufs
    selfdir = tmp_path / "selfdir"
    selfdir.mkdir()
    src = selfdir / "model.gguf"
    src.write_bytes(a.read_bytes())
    before = _tree(tmp_path)
    # contains the source, contains it further up, is the source (as a directory or a GGUF output)
    for dst, to in ((selfdir, "vllm"), (tmp_path, "vllm"), (src, "vllm"), (src, "gguf")):
        r = run("convert", "--force", src, dst, "--to", to, "--no-progress", "--no-transformers")
        assert r.returncode == 1, (dst, to, r.stdout)
        assert "source" in r.stderr and "wrote" not in r.stdout, r.stderr
        assert _tree(tmp_path) == before
    # the destination inside a source directory (an HF folder): refused as well
    hf = tmp_path / "hf"
    assert run("convert", src, hf, "--no-progress", "--no-transformers").returncode == 0
    before = _tree(tmp_path)
    r = run("convert", "--force", hf, hf / "inner", "--no-progress")
    assert r.returncode == 1 and "inside this source" in r.stderr, r.stderr
    assert _tree(tmp_path) == before


def test_force_never_replaces_foreign_files(ggufs, tmp_path):
    """``--force`` into a folder of unrelated files (or a ternary_rs output a user added files to, or a GGUF
    ternary_rs did not write) is refused; the files stay byte for byte."""
    _, a, b, _ = ggufs
    foreign = tmp_path / "foreign"
    (foreign / "sub").mkdir(parents=True)
    (foreign / "notes.txt").write_text("precious")
    (foreign / "sub" / "data.csv").write_text("1,2,3")
    out = tmp_path / "out"
    assert run("convert", a, out, "--no-progress", "--no-transformers").returncode == 0
    (out / "my_notes.txt").write_text("mine now")
    user_gguf = tmp_path / "user.gguf"
    user_gguf.write_bytes(b.read_bytes())  # not written by ternary_rs: no mark
    before = _tree(tmp_path)
    for dst, to in ((foreign, "vllm"), (out, "vllm"), (user_gguf, "gguf")):
        r = run("convert", a, dst, "--force", "--to", to, "--no-progress", "--no-transformers")
        assert r.returncode == 1 and "not written by ternary_rs" in r.stderr, (dst, r.stderr)
        assert _tree(tmp_path) == before
    # a GGUF ternary_rs wrote may be replaced, and an empty folder may be filled
    ours = tmp_path / "ours.gguf"
    assert run("convert", a, ours, "--to", "gguf", "--no-progress").returncode == 0
    r = run("convert", b, ours, "--to", "gguf", "--force", "--no-progress")
    assert r.returncode == 0, r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("convert", a, empty, "--force", "--no-progress", "--no-transformers").returncode == 0


def test_force_refuses_an_output_with_an_edited_file(ggufs, tmp_path):
    """``convert --force`` once discarded a user's edit inside an earlier output (a changed chat template):
    a file whose SHA-256 no longer matches the manifest is user data, refused by name unless
    ``--discard-edits`` says so too."""
    _, a, b, _ = ggufs
    out = tmp_path / "out"
    assert run("convert", a, out, "--no-progress", "--no-transformers").returncode == 0
    config = out / "tokenizer_config.json"
    edited = json.loads(config.read_text())
    edited["chat_template"] = "{{ my own template }}"
    config.write_text(json.dumps(edited))
    before = _tree(tmp_path)
    r = run("convert", b, out, "--force", "--no-progress", "--no-transformers")
    assert r.returncode == 1, r.stdout
    assert "tokenizer_config.json changed since ternary_rs wrote it" in r.stderr and "--discard-edits" in r.stderr
    assert _tree(tmp_path) == before
    # the same size but other bytes is an edit too (not only a size change)
    config.write_text(config.read_text().replace("my own", "my OWN"))
    before = _tree(tmp_path)
    assert run("convert", b, out, "--force", "--no-progress", "--no-transformers").returncode == 1
    assert _tree(tmp_path) == before
    r = run("convert", b, out, "--force", "--discard-edits", "--no-progress", "--no-transformers")
    assert r.returncode == 0, r.stderr
    assert "my OWN" not in config.read_text() and run("verify", out).returncode == 0
    # an unedited output is still replaced by --force alone
    assert run("convert", a, out, "--force", "--no-progress", "--no-transformers").returncode == 0


def test_demo_keep_never_replaces_a_users_files(tmp_path):
    """``demo --keep DIR`` once overwrote ``DIR/demo-qwen3-PQ2_0.gguf`` and replaced ``DIR/demo-qwen3-vllm``:
    existing files need ``--force``, and even then only files an earlier demo wrote are replaced."""
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "demo-qwen3-PQ2_0.gguf").write_bytes(b"my own model")
    before = _tree(tmp_path)
    for extra in ([], ["--force"]):
        r = run("demo", "--keep", keep, *extra)
        assert r.returncode == 1 and "demo-qwen3-PQ2_0.gguf" in r.stderr, (extra, r.stdout, r.stderr)
        assert _tree(tmp_path) == before
    (keep / "demo-qwen3-PQ2_0.gguf").unlink()
    (keep / "demo-qwen3-vllm").mkdir()
    (keep / "demo-qwen3-vllm" / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    for extra in ([], ["--force"]):
        r = run("demo", "--keep", keep, *extra)
        assert r.returncode == 1 and "demo-qwen3-vllm" in r.stderr, (extra, r.stdout, r.stderr)
        assert _tree(tmp_path) == before  # refused before anything was written: no GGUF either
    # a fresh folder works; a second run needs --force and then replaces the earlier demo's own files
    fresh = tmp_path / "fresh"
    assert run("demo", "--keep", fresh).returncode == 0
    r = run("demo", "--keep", fresh)
    assert r.returncode == 1 and "--force" in r.stderr
    r = run("demo", "--keep", fresh, "--force")
    assert r.returncode == 0 and "verify: OK" in r.stdout, r.stdout + r.stderr


def test_bulk_refuses_colliding_output_names(ggufs, tmp_path):
    _, a, b, _ = ggufs
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    m1, m2 = tmp_path / "d1" / "m.gguf", tmp_path / "d2" / "m.gguf"
    m1.write_bytes(a.read_bytes())
    m2.write_bytes(b.read_bytes())
    coll = tmp_path / "coll"
    for extra in ([], ["--force"]):
        r = run("convert", m1, m2, coll, "--no-progress", "--no-transformers", *extra)
        assert r.returncode == 1, r.stdout
        assert "more than one input" in r.stderr and str(m1) in r.stderr and str(m2) in r.stderr
        assert "wrote" not in r.stdout and not coll.exists()


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


def _qwen3_gguf_with_sparse_tail(path: Path, tail_bytes: int) -> None:
    """A small ternary (TQ2_0) qwen3 GGUF written with gguf-py, whose last tensor is a ``tail_bytes``
    ``rope_freqs.weight`` (derived by llama.cpp, skipped by the conversion) left as a sparse hole: the
    file is as big as a real model for the source SHA-256, without using the disk."""
    import gguf
    import numpy as np

    from ternary_rs import TernaryTensor, encode, pack_codes
    from ternary_rs.demo import DEMO_SHAPE, demo_tokenizer, qwen3_metadata

    s = DEMO_SHAPE
    tokens, types, merges = demo_tokenizer()
    w = gguf.GGUFWriter(str(path), "qwen3", use_temp_file=False)
    value_types = {"u32": gguf.GGUFValueType.UINT32, "f32": gguf.GGUFValueType.FLOAT32,
                   "string": gguf.GGUFValueType.STRING}
    for key, value, vtype in qwen3_metadata("sparse tail", s, s["layers"], s["context"], tokens, types, merges):
        if key == "general.architecture":
            continue
        if vtype.startswith("array"):
            sub = gguf.GGUFValueType.STRING if vtype == "array[string]" else gguf.GGUFValueType.INT32
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
        else:
            w.add_key_value(key, value, value_types[vtype])
    rng = np.random.default_rng(0)
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    shapes = {"token_embd.weight": (len(tokens), s["hidden"]), "output.weight": (len(tokens), s["hidden"])}
    for b in range(s["layers"]):
        shapes.update({f"blk.{b}.attn_q.weight": (q, s["hidden"]), f"blk.{b}.attn_k.weight": (kv, s["hidden"]),
                       f"blk.{b}.attn_v.weight": (kv, s["hidden"]), f"blk.{b}.attn_output.weight": (s["hidden"], q),
                       f"blk.{b}.ffn_gate.weight": (s["intermediate"], s["hidden"]),
                       f"blk.{b}.ffn_up.weight": (s["intermediate"], s["hidden"]),
                       f"blk.{b}.ffn_down.weight": (s["hidden"], s["intermediate"])})
    blobs = {}
    for name, (n, k) in shapes.items():
        trits = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
        t = TernaryTensor(pack_codes(trits), rng.uniform(0.01, 0.05, (n, k // 256)).astype(np.float16), 256)
        blobs[name] = np.asarray(encode(t, "TQ2_0"), dtype=np.uint8)
        w.add_tensor_info(name, (n, k // 256 * 66), np.dtype(np.uint8), blobs[name].nbytes,
                          raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
    blobs["output_norm.weight"] = np.ones(s["hidden"], dtype=np.float32)
    w.add_tensor_info("output_norm.weight", (s["hidden"],), np.dtype(np.float32), 4 * s["hidden"])
    w.add_tensor_info("rope_freqs.weight", (tail_bytes // 4,), np.dtype(np.float32), tail_bytes)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for blob in blobs.values():
        w.write_tensor_data(blob)
    fout = w.fout[0]
    start = fout.tell() + (-fout.tell() % 32)
    fout.close()
    with open(path, "r+b") as f:
        f.truncate(start + tail_bytes)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_within_a_second_while_a_big_source_is_hashed(tmp_path, sig):
    """The source SHA-256 runs on a worker thread; an interrupt once waited for it to finish the file
    (seconds on a multi-GB model) before the process could exit. Now it stops within one chunk."""
    src = tmp_path / "big.gguf"
    _qwen3_gguf_with_sparse_tail(src, 6 << 30)
    dst = tmp_path / "out"
    proc = subprocess.Popen(CLI + ["convert", str(src), str(dst), "--no-progress"], env={**os.environ, SLEEP_ENV: "0.2"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_temporary(tmp_path, "out", proc)
    t0 = time.perf_counter()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    stopped = time.perf_counter() - t0
    assert proc.returncode == 130 and "interrupted" in err, err
    assert stopped < 3.0, f"took {stopped:.1f} s to stop"  # generous: about 0.2 s when the machine is idle
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.gguf"]  # no staging or scratch left


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
