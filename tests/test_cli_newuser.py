"""What a new user tripped over (issue 24, items 8-22), each checked through the real command (a subprocess
running ``python -m ternary_rs``) or the public API on real files made here.

Independent references: gguf-py's quantizers (Q8_0 / Q4_0 files), the ``safetensors`` package (edits of a
checkpoint), the README's own Python snippet.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import ternary_rs
from support.cli import CLI, converted_demo, run
from ternary_rs.sinks.checkpoint import MANIFEST_NAME
from ternary_rs.sinks.writers import GGUFWriter

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return converted_demo(tmp_path_factory.mktemp("newuser"), "demo.gguf", seed=3)


def _rewrite(src: Path, dst: Path, weight) -> Path:
    """Copy a GGUF, replacing each ternary tensor by ``weight(name, dense) -> (type id, bytes)`` (or keeping
    it when that returns None)."""
    with ternary_rs.open(src) as f:
        w = GGUFWriter(dst)
        for key, value in f.metadata.items():
            if key != "general.alignment":
                w.add_metadata(key, value, f.metadata_types[key])
        data = {}
        for t in f.tensors.values():
            new = None
            if t.type == "PQ2_0":
                new = weight(t.name, ternary_rs.decode(f, t.name).dequantize("float32"))
            data[t.name] = (t.shape, *(new or (t.type_id, np.asarray(f.raw(t.name)))))
        for name, (shape, tid, b) in data.items():
            w.add_tensor_info(name, shape, tid, np.asarray(b).nbytes)
        for name, (_, _, b) in data.items():
            w.write_tensor_data(name, b)
        w.close()
    return dst


def _quantized(qtype: str, only=None):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qt = getattr(GGMLQuantizationType, qtype)

    def weight(name, dense):
        if only is not None and name not in only:
            return None
        return int(qt), np.ascontiguousarray(quantize(dense, qt)).view(np.uint8).reshape(-1)

    return weight


def _random_f16(name, dense):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    return 1, (rng.standard_normal(dense.shape) * 0.02).astype(np.float16).view(np.uint8).reshape(-1)


# ------------------------------------------------------------------------------------------ items 8 and 9
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "one Q8_0 linear"])
def test_non_ternary_gguf_types_are_not_ternary_anywhere(demo, tmp_path, kind):
    _, src, _ = demo
    only = {"blk.0.ffn_up.weight"} if kind.startswith("one") else None
    qtype = "Q8_0" if "Q8_0" in kind else "Q4_0"
    path = _rewrite(src, tmp_path / "m.gguf", _quantized(qtype, only))
    for args in (["inspect", path], ["inspect", path, "--scan"]):
        r = run(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "really ternary: NO" in r.stdout
        assert f"non-ternary GGUF type ({qtype}: " in r.stdout, r.stdout
        assert ("1 tensor of" in r.stdout and "blk.0.ffn_up.weight" in r.stdout) if only else \
            ("16 tensors of" in r.stdout and "token_embd.weight" in r.stdout and "and 13 more" in r.stdout)
    r = run("verify", path)
    assert r.returncode == 1 and "FAILED" in r.stdout and f"({qtype}: " in r.stdout, r.stdout
    r = run("plan", path)
    assert r.returncode == 1 and "fits: yes" not in r.stdout and f"({qtype}: " in r.stderr, (r.stdout, r.stderr)
    assert "nothing to plan" in r.stderr
    for dst in (tmp_path / "out", tmp_path / "out.gguf"):
        r = run("convert", path, dst)
        assert r.returncode == 1 and f"({qtype}: " in r.stderr and "nothing was written" in r.stderr, r.stderr
        assert not dst.exists()
    r = run("inspect", path, "--json")
    rep = json.loads(r.stdout)
    assert rep["is_ternary"] is False and rep["not_ternary"]


def test_convert_and_verify_agree_on_a_dense_float_model(demo, tmp_path):
    """One rule: a model whose linear weights are all dense float with non-ternary values is refused by
    convert (up front, nothing written) and fails verify, whatever its name claims."""
    _, src, _ = demo
    path = _rewrite(src, tmp_path / "f16.gguf", _random_f16)
    r = run("verify", path)
    assert r.returncode == 1 and "not a ternary checkpoint" in r.stdout, r.stdout
    for dst in (tmp_path / "out", tmp_path / "out.gguf"):
        r = run("convert", path, dst)
        assert r.returncode == 1 and "not a ternary checkpoint" in r.stderr and "nothing was written" in r.stderr
        assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    r = run("plan", path)
    assert r.returncode == 1 and "not a ternary checkpoint" in r.stderr
    # Exactly ternary float weights stay convertible, and both commands still agree.
    exact = _rewrite(src, tmp_path / "exact-f16.gguf",
                     lambda name, dense: (1, dense.astype(np.float16).view(np.uint8).reshape(-1)))
    assert run("verify", exact).returncode == 0
    r = run("convert", exact, tmp_path / "exact")
    assert r.returncode == 0, r.stderr
    assert run("verify", tmp_path / "exact").returncode == 0


# ------------------------------------------------------------------------------------------ item 10
def test_unknown_format_version_is_refused_by_every_reader(demo, tmp_path):
    _, _, out = demo
    d = tmp_path / "v2"
    d.mkdir()
    for p in out.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    want = re.compile(r"config\.json: quantization_config\.format_version is 2, .*reads format_version 1 only")
    for args in (["inspect", d], ["inspect", d, "--scan"], ["plan", d], ["convert", d, tmp_path / "x.gguf"],
                 ["convert", d, tmp_path / "again"], ["inspect", d / "model-00001-of-00001.safetensors"]):
        r = run(*args)
        assert r.returncode == 1 and want.search(r.stderr), (args, r.stderr)
        assert str(d / "config.json") in r.stderr
    r = run("verify", d)
    assert r.returncode == 1 and want.search(r.stdout), r.stdout
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "again").exists()
    with pytest.raises(ternary_rs.FormatError, match="format_version is 2"):
        ternary_rs.decode(ternary_rs.open(d), "model.layers.0.mlp.up_proj")


# ------------------------------------------------------------------------------------------ item 11
def test_inspect_scan_of_a_corrupted_checkpoint(demo, tmp_path):
    _, _, out = demo
    d = tmp_path / "bad"
    d.mkdir()
    for p in out.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    shard = d / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    q = tensors["model.layers.0.mlp.up_proj.qweight"].copy()
    q[0, :4] = 0xFF
    tensors["model.layers.0.mlp.up_proj.qweight"] = q
    save_file(tensors, str(shard), metadata={"format": "pt"})
    r = run("inspect", d, "--scan")
    assert r.returncode == 1, r.stdout  # a problem found is an exit status, as for verify (docs/cli.md)
    assert "really ternary: yes" not in r.stdout and "really ternary: NO (1 problem below)" in r.stdout
    assert "16 codes equal 3" in r.stdout
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("scales:"))
    numbers = re.findall(r"\d+\.\d+", line)
    assert numbers and all(len(n.replace(".", "").lstrip("0")) <= 6 for n in numbers), line
    # The clean checkpoint still describes itself with exit 0.
    r = run("inspect", out, "--scan")
    assert r.returncode == 0 and "really ternary: yes" in r.stdout


# ------------------------------------------------------------------------------------------ item 16
def test_every_api_error_is_a_ternary_error(demo, tmp_path):
    _, src, _ = demo
    T = ternary_rs.TernaryError
    with pytest.raises(T) as e:
        ternary_rs.open(tmp_path / "missing.gguf")
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ternary_rs.TernaryFileNotFoundError)
    f = ternary_rs.open(src)
    with pytest.raises(T) as e:
        f.raw("no.such.tensor")
    assert isinstance(e.value, KeyError) and isinstance(e.value, ternary_rs.TensorNotFoundError)
    with pytest.raises(ternary_rs.TensorNotFoundError):
        ternary_rs.decode(f, "no.such.tensor")
    t = ternary_rs.decode(f, "blk.0.ffn_up.weight")
    with pytest.raises(T) as e:
        t.dequantize("int8")
    assert isinstance(e.value, ValueError)
    with pytest.raises(T) as e:
        ternary_rs.TernaryTensor(np.zeros((4, 8), np.int32), np.zeros((4, 1), np.float16), 32)
    assert isinstance(e.value, TypeError)  # the built-in class it was before still catches it
    with pytest.raises(T):
        ternary_rs.TernaryTensor(np.zeros((4, 3), np.uint8), np.zeros((4, 1), np.float16), 32)  # K = 12
    with pytest.raises(T):
        ternary_rs.repack(t, 48)
    f.close()
    with pytest.raises(T) as e:
        f.raw("blk.0.ffn_up.weight")
    assert isinstance(e.value, ValueError) and "closed" in str(e.value)
    for bad in (-1, 10**6, "x"):
        with pytest.raises(ternary_rs.InvalidArgumentError):
            ternary_rs.set_num_threads(bad)
    with pytest.raises(T) as e:
        GGUFWriter(tmp_path / "no" / "such" / "x.gguf")
    assert isinstance(e.value, FileNotFoundError)
    for fn in (ternary_rs.inspect, ternary_rs.verify, ternary_rs.plan):
        with pytest.raises(ternary_rs.TernaryFileNotFoundError):
            fn(tmp_path / "missing")
    with pytest.raises(T):
        ternary_rs.plan(src, kv_dtype="fp4")
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "mine.txt").write_text("x")
    with pytest.raises(ternary_rs.TernaryFileExistsError) as e:
        ternary_rs.convert(src, tmp_path / "exists", progress=False)
    assert isinstance(e.value, FileExistsError)
    ternary_rs.set_num_threads(0)


# ------------------------------------------------------------------------------------------ item 19
def test_leftovers_are_removed(demo, tmp_path):
    _, src, _ = demo
    # A killed run's staging folder for another name (its pid is gone) is removed by a run in that folder.
    stale = tmp_path / ".other.ternary_rs-tmp-999999999-0123abcd"
    (stale / "inner").mkdir(parents=True)
    stale_old = tmp_path / ".gone.ternary_rs-old-999999999-89abcdef"
    stale_old.mkdir()
    r = run("convert", src, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert not stale.exists() and not stale_old.exists()
    # --force over a read-only old output leaves no hidden copy behind.
    for p in sorted((tmp_path / "out").rglob("*"), reverse=True):
        p.chmod(0o444 if p.is_file() else 0o555)
    (tmp_path / "out").chmod(0o555)
    r = run("convert", src, tmp_path / "out", "--force")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], list(tmp_path.iterdir())
    # A failed --parents run removes the folders it made (and only those).
    dense = _rewrite(src, tmp_path / "f16.gguf", _random_f16)
    r = run("convert", dense, tmp_path / "new" / "deeper" / "out", "--parents")
    assert r.returncode == 1 and not (tmp_path / "new").exists()
    r = run("convert", dense, src, tmp_path / "bulk" / "outs", "--parents")  # bulk: one fails, one is written
    assert r.returncode == 1 and (tmp_path / "bulk" / "outs" / "demo").is_dir()
    dense2 = tmp_path / "f16b.gguf"
    dense2.write_bytes(dense.read_bytes())
    r = run("convert", dense, dense2, tmp_path / "bulk2" / "o", "--parents")  # bulk: every input fails
    assert r.returncode == 1 and not (tmp_path / "bulk2").exists(), r.stderr


def _without_root_override() -> list[str]:
    """A command prefix under which permissions apply even to root (root's CAP_DAC_OVERRIDE dropped), so a
    read-only folder really is read-only; [] when not root."""
    import shutil

    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root without setpriv: permissions would not apply (test_leftovers_are_removed runs the path)")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"]


def test_read_only_old_output_is_removed_where_permissions_apply(demo, tmp_path):
    _, src, _ = demo
    prefix = _without_root_override()

    def cli(*args):
        return subprocess.run(prefix + CLI + [str(a) for a in args], capture_output=True, text=True, timeout=240)

    probe = tmp_path / "probe"
    (probe / "f").parent.mkdir()
    (probe / "f").write_text("x")
    probe.chmod(0o555)
    denied = subprocess.run(prefix + [sys.executable, "-c", f"import os; os.unlink({str(probe / 'f')!r})"],
                            capture_output=True, text=True)
    probe.chmod(0o755)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr  # the set-up really is read-only
    shutil_rm = __import__("shutil").rmtree
    shutil_rm(probe)
    r = cli("convert", src, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    subprocess.run(["chmod", "-R", "a-w", str(tmp_path / "out")], check=True)
    r = cli("convert", src, tmp_path / "out", "--force")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], list(tmp_path.iterdir())
    # One wording for a permission error, whether Python or the Rust core met it (item 17).
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    for dst in ("ro/x.gguf", "ro/x"):
        r = subprocess.run(prefix + CLI + ["convert", str(src), dst], capture_output=True, text=True, timeout=240,
                           cwd=tmp_path)
        assert r.returncode == 1 and ": Permission denied" in r.stderr, r.stderr
        assert "[Errno" not in r.stderr and "os error" not in r.stderr and "Error:" not in r.stderr
    ro.chmod(0o755)


# ------------------------------------------------------------------------------------------ item 22
def test_destination_inside_an_existing_output_and_literal_tilde(demo, tmp_path):
    _, src, _ = demo
    r = run("convert", src, "~", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "literal '~'" in r.stderr and "not your home folder" in r.stderr
    r = run("convert", src, "~/out", cwd=tmp_path)
    assert r.returncode == 1 and "lies inside ~, an existing ternary_rs output" in r.stderr, r.stderr
    assert not (tmp_path / "~" / "out").exists()
    assert run("verify", tmp_path / "~").returncode == 0
    r = run("convert", src, tmp_path / "~" / "sub" / "x.gguf", "--parents")
    assert r.returncode == 1 and "an existing ternary_rs output" in r.stderr
    assert not (tmp_path / "~" / "sub").exists()


# ------------------------------------------------------------------------------------------ item 18
def test_file_as_parent_empty_source_folder_and_symlinked_output(demo, tmp_path):
    _, src, _ = demo
    (tmp_path / "afile").write_text("x")
    for extra in ([], ["--parents"]):
        r = run("convert", src, "afile/out", *extra, cwd=tmp_path)
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "afile is a file, not a folder" in lines[0], r.stderr
        assert "FileExistsError" not in r.stderr and "no such" not in r.stderr
    (tmp_path / "empty").mkdir()
    for cmd in (["convert", "empty", "o"], ["inspect", "empty"], ["plan", "empty"]):
        r = run(*cmd, cwd=tmp_path)
        assert r.returncode == 1 and "empty: the folder is empty" in r.stderr, r.stderr
    r = run("convert", src, tmp_path / "real")
    assert r.returncode == 0
    (tmp_path / "link").symlink_to("real")
    for extra in ([], ["--force"]):
        r = run("convert", src, "link", *extra, cwd=tmp_path)
        assert r.returncode == 1 and "is a symbolic link (to real)" in r.stderr, r.stderr
        assert "not written by ternary_rs" not in r.stderr
    assert (tmp_path / "link").is_symlink()


# ------------------------------------------------------------------------------------------ item 12
def test_gguf_output_options_and_names(demo, tmp_path):
    _, src, _ = demo
    r = run("convert", src, tmp_path / "o.gguf", "--group-size", "64")
    assert r.returncode == 2 and "usage: ternary-rs convert" in r.stderr, r.stderr
    assert "--group-size 64 applies to vLLM output only" in r.stderr and not (tmp_path / "o.gguf").exists()
    with pytest.raises(ternary_rs.InvalidArgumentError, match="applies to vLLM output only"):
        ternary_rs.convert(src, tmp_path / "o.gguf", group_size=64)
    r = run("convert", src, "out.gguf/", cwd=tmp_path)
    assert r.returncode == 2 and "a trailing '/' names a folder" in r.stderr, r.stderr
    assert not (tmp_path / "out.gguf").exists()
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "mine.txt").write_text("user file")
    r = run("convert", src, "folder", "--to", "gguf", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "wrote folder/demo-TERNARY.gguf", r.stdout
    r = run("convert", src, "folder", "--to", "gguf", "--gguf-type", "PTQ1_0", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "wrote folder/demo-PTQ1_0.gguf", r.stdout
    assert sorted(p.name for p in (tmp_path / "folder").iterdir()) == [
        "demo-PTQ1_0.gguf", "demo-TERNARY.gguf", "mine.txt"]
    docs = (ROOT / "docs" / "cli.md").read_text()
    assert "<source name>-<GGUF type>.gguf" in docs and "<source name>-TERNARY.gguf" in docs


# ------------------------------------------------------------------------------------------ item 13
def test_plan_says_when_nothing_fits(demo):
    _, _, out = demo
    r = run("plan", out, "--gpu-memory", "100K")
    assert r.returncode == 1 and "the weights alone" in r.stdout and "exceed the usable" in r.stdout, r.stdout
    r = run("plan", out, "--gpu-memory", "512M")
    assert r.returncode == 1 and "nothing fits" in r.stdout and "before any KV cache" in r.stdout, r.stdout
    assert "largest: 0 tokens" not in r.stdout and "context 0" not in r.stdout
    r = run("plan", out, "--gpu-memory", "24")
    assert r.returncode == 0 and "largest: " in r.stdout and "nothing fits" not in r.stdout


# ------------------------------------------------------------------------------------------ item 14
def test_verify_a_shard_next_to_its_manifest(demo, tmp_path):
    _, _, out = demo
    shard = out / "model-00001-of-00001.safetensors"
    r = run("verify", shard)
    assert r.returncode == 0 and f"OK (its SHA-256 matches {MANIFEST_NAME})" in r.stdout, r.stdout
    d = tmp_path / "copy"
    d.mkdir()
    for p in out.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    data = bytearray((d / shard.name).read_bytes())
    data[-1] ^= 0x01  # a code byte of the last tensor: still a valid file, but not the one written
    (d / shard.name).write_bytes(bytes(data))
    r = run("verify", d / shard.name)
    assert r.returncode == 1 and "does not match ternary_rs.json" in r.stdout, r.stdout
    (d / "extra.safetensors").write_bytes(shard.read_bytes())
    r = run("verify", d / "extra.safetensors")
    assert f"{MANIFEST_NAME} next to it does not list extra.safetensors" in r.stdout, r.stdout


# ------------------------------------------------------------------------------------------ item 15
def test_readme_python_example_runs_on_the_demo(demo, tmp_path):
    _, src, out = demo
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Python"):]
    code = section[section.index("```python") + len("```python"):section.index("```", section.index("```python") + 9)]
    code = code.replace('"model.gguf"', repr(str(src))).replace('"out_dir"', repr(str(out)))
    assert "encode(" in code
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the documented example itself
    assert len(namespace["gguf_bytes"]) and len(namespace["tq2_bytes"])
    ternary_rs.set_num_threads(0)


# ------------------------------------------------------------------------------------------ item 17
def test_messages_are_plain_and_name_paths_as_given(demo, tmp_path):
    _, src, _ = demo
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("x")
    r = run("convert", src, "out", cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.startswith("ternary-rs: out already exists"), r.stderr
    assert "Error:" not in r.stderr and "[Errno" not in r.stderr and str(tmp_path) not in r.stderr
    with open("/dev/full", "w") as full:
        r = subprocess.run(CLI + ["inspect", str(src)], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == "ternary-rs: standard output: No space left on device"
    from ternary_rs.sinks.checkpoint import describe_error

    python_form = describe_error(PermissionError(13, "Permission denied", "a/b"))
    rust_form = describe_error(ternary_rs.TernaryPermissionError(13, "a/b: Permission denied (os error 13)"))
    assert python_form == rust_form == "a/b: Permission denied"


# ------------------------------------------------------------------------------------------ item 20
def test_interrupted_bulk_job_names_what_it_wrote(demo, tmp_path):
    _, src, _ = demo
    sources = []
    for name in ("a", "b", "c"):
        sources.append(tmp_path / f"{name}.gguf")
        sources[-1].write_bytes(src.read_bytes())
    env = {**os.environ, "TERNARY_RS_TEST_SLEEP_PER_TENSOR": "0.08"}
    proc = subprocess.Popen(CLI + ["convert", *map(str, sources), str(tmp_path / "outs")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while not (tmp_path / "outs" / "b").is_dir() and time.time() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "outs" / "b").is_dir()
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "no output was left behind" not in err
    assert "2 outputs written before it were kept" in err and str(tmp_path / "outs" / "a") in err, err
    assert f"wrote {tmp_path / 'outs' / 'a'}" in out and f"wrote {tmp_path / 'outs' / 'b'}" in out
    assert sorted(p.name for p in (tmp_path / "outs").iterdir()) == ["a", "b"]
    assert run("verify", tmp_path / "outs" / "a", tmp_path / "outs" / "b").returncode == 0


# ------------------------------------------------------------------------------------------ item 21
def test_verbose_after_the_command_usage_of_the_command_and_several_paths(demo, tmp_path):
    _, src, out = demo
    r = run("inspect", src, "-v")
    assert r.returncode == 0, r.stderr
    r = run("convert", src, tmp_path / "o", "-v")
    assert r.returncode == 0 and "ternary-rs: " in r.stderr and "classified" in r.stderr, r.stderr
    r = run("convert", src, tmp_path / "x", "--gguf-type", "TQ2_0")
    assert r.returncode == 2 and r.stderr.startswith("usage: ternary-rs convert "), r.stderr
    r = run("inspect", src, out)
    assert r.returncode == 0 and f"{src}: gguf" in r.stdout and f"{out}: safetensors" in r.stdout
    r = run("inspect", src, out, "--json")
    assert [x["path"] for x in json.loads(r.stdout)] == [str(src), str(out)]
    r = run("verify", src, out, tmp_path / "missing")
    assert r.returncode == 1 and f"{out}: OK" in r.stdout and f"{src}: OK" in r.stdout
    assert f"{tmp_path / 'missing'}: no such file or directory" in r.stderr


def test_messages_name_the_right_tensor_and_file_once(demo, tmp_path):
    import shutil

    _, src, out = demo
    # A NaN scale is blamed on the .scales tensor holding it, by verify and by convert.
    d = tmp_path / "nan"
    shutil.copytree(out, d)
    shard = d / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    s = tensors["model.layers.0.mlp.up_proj.scales"].copy()
    s[0, 1] = np.float16("nan")
    tensors["model.layers.0.mlp.up_proj.scales"] = s
    save_file(tensors, str(shard), metadata={"format": "pt"})
    r = run("verify", d)
    assert "problem: model.layers.0.mlp.up_proj.scales: 1 NaN" in r.stdout, r.stdout
    r = run("convert", d, tmp_path / "x.gguf")
    assert r.returncode == 1 and "tensor model.layers.0.mlp.up_proj.scales: non-finite" in r.stderr, r.stderr
    assert ".qweight" not in r.stderr
    # A missing shard: one problem line naming it, no "(at byte offset 0)" anywhere.
    m = tmp_path / "missing-shard"
    shutil.copytree(out, m)
    (m / "model-00001-of-00001.safetensors").unlink()
    r = run("verify", m)
    problems = [x for x in r.stdout.splitlines() if "problem:" in x]
    assert r.returncode == 1 and len(problems) == 1 and "model-00001-of-00001.safetensors" in problems[0], r.stdout
    r = run("inspect", m)
    assert r.returncode == 1 and "does not exist" in r.stderr and "byte offset" not in r.stderr, r.stderr
    # An unknown ggml type id: short, named (TL1), listing only what ternary_rs reads.
    tl1 = tmp_path / "tl1.gguf"
    w = GGUFWriter(tl1)
    w.add_metadata("general.architecture", "bitnet-b1.58")
    w.add_tensor_info("blk.0.ffn_up.weight", (256, 256), 38, 256 * 256 // 4)
    w.write_tensor_data("blk.0.ffn_up.weight", np.zeros(256 * 256 // 4, np.uint8))
    w.close()
    for cmd in ("inspect", "convert"):
        r = run(cmd, "tl1.gguf", *(["tl1-out"] if cmd == "convert" else []), cwd=tmp_path)
        line = r.stderr.strip()
        assert r.returncode == 1 and "ggml type id 38 (TL1" in line and len(line.splitlines()) == 1, line
        assert "Q8_0" not in line and "IQ2_XXS" not in line and len(line) < 300, line
    # A GGUF without a tokenizer: the warning names the file.
    bare = tmp_path / "no-tokenizer.gguf"
    with ternary_rs.open(src) as f:
        w = GGUFWriter(bare)
        for key, value in f.metadata.items():
            if key != "general.alignment" and not key.startswith("tokenizer."):
                w.add_metadata(key, value, f.metadata_types[key])
        for t in f.tensors.values():
            w.add_tensor_info(t.name, t.shape, t.type_id, t.nbytes)
        for t in f.tensors.values():
            w.write_tensor_data(t.name, f.raw(t.name))
        w.close()
    r = run("convert", bare, tmp_path / "bare-out", "--no-transformers")
    assert f"{bare}: the GGUF has no tokenizer" in r.stderr and "no tokenizer files are written" in r.stderr, \
        r.stderr
