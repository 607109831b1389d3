"""The ``ternary-rs`` command behaves like the tools people know (issue 16, items 6-11), each checked by
running the real command in a subprocess: help, version and exit status; output kind from the file name;
refusals (mistyped folder, --gguf-type with --to vllm, lossy regroup without --requantize); plan units and
exit status; verify's wording and checks; inspect header-only vs --scan, its table and units; closed
pipes; progress frames only on a terminal; small conversions without transformers; one message per
error, naming the user's paths in one wording.

Independent references: gguf-py's ``GGUFReader`` (GGUF outputs), the ``safetensors`` package (edits),
``ternary_rs.decode``'s ``ValidationError`` (the first bad index verify must repeat), ``tokenizers``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import ternary_rs
from support.cli import CLI, converted_demo, run
from ternary_rs.sinks.checkpoint import TMP_MARK
from ternary_rs.sinks.writers import GGUFWriter

GiB = 2**30


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return converted_demo(tmp_path_factory.mktemp("ux"), "demo-PQ2_0.gguf", seed=5)


def _rewrite_gguf(src: Path, dst: Path, drop=lambda key: False, extra=(), rename=None, skip_tensors=()) -> Path:
    """Copy a GGUF key by key and tensor by tensor (bytes unchanged), dropping/adding/renaming keys."""
    with ternary_rs.open(src) as f:
        types = f.metadata_types
        w = GGUFWriter(dst)
        for key, value in f.metadata.items():
            if key == "general.alignment" or drop(key):
                continue
            w.add_metadata(rename(key) if rename else key, value, types[key])
        for key, value, vtype in extra:
            w.add_metadata(key, value, vtype)
        tensors = [t for t in f.tensors.values() if t.name not in skip_tensors]
        for t in tensors:
            w.add_tensor_info(t.name, t.shape, t.type_id, t.nbytes)
        for t in tensors:
            w.write_tensor_data(t.name, f.raw(t.name))
        w.close()
    return dst


# ------------------------------------------------------------------------------------------ item 9: help
def test_version_help_and_usage_errors():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ternary-rs {ternary_rs.__version__}"
    for cmd in ([], ["convert"], ["inspect"], ["verify"], ["plan"], ["demo"]):
        r = run(*cmd, "--help")
        assert r.returncode == 0, cmd
        assert "examples:" in r.stdout and "exit status:" in r.stdout, cmd
        for code in ("0 ", "1 ", "2 ", "130", "141"):
            assert f"\n  {code}" in r.stdout, (cmd, code)
    conv = run("convert", "--help").stdout
    assert "(default: 5GB)" in conv and "gguf when DST ends in .gguf" in conv and "--requantize" in conv
    assert "--parents" in conv
    plan = run("plan", "--help").stdout
    assert "(default: 8192)" in plan and "(default: 24)" in plan and "24GiB all mean 24 GiB" in " ".join(plan.split())
    for bad in (["convert", "--threads", "-3", "a.gguf", "out"], ["convert", "--threads", "x", "a", "b"],
                ["plan", "x", "--gpu-memory", "24X"], ["plan", "x", "--context", "0"], ["convert", "a.gguf"], []):
        r = run(*bad)
        assert r.returncode == 2, bad
        assert "Traceback" not in r.stderr and "usage:" in r.stderr, (bad, r.stderr)
    assert "--threads: must be at least 1, got -3" in run("convert", "--threads", "-3", "a.gguf", "o").stderr


# ------------------------------------------------------------------------------------------ item 7: convert
def test_gguf_destination_name_means_gguf_output(demo, tmp_path):
    _, src, _ = demo
    out = tmp_path / "out.gguf"
    r = run("convert", src, out)
    assert r.returncode == 0, r.stderr
    assert out.is_file() and out.read_bytes()[:4] == b"GGUF"  # not a directory named out.gguf
    with ternary_rs.open(out) as f:
        assert {t.type for t in f.tensors.values() if len(t.shape) == 2} == {"PQ2_0"}  # as the source
    r = run("convert", src, tmp_path / "dir.gguf", "--to", "vllm")
    assert r.returncode == 2 and "--to vllm writes a directory" in r.stderr
    assert not (tmp_path / "dir.gguf").exists()
    r = run("convert", src, tmp_path / "as-dir", "--to", "gguf")  # explicit --to still wins
    assert r.returncode == 0 and (tmp_path / "as-dir").is_file()


def test_missing_parent_folder_needs_parents(demo, tmp_path):
    _, src, _ = demo
    dst = tmp_path / "typo" / "deeper" / "out"
    r = run("convert", src, dst)
    assert r.returncode == 1
    assert f"{dst.parent}: no such file or directory" in r.stderr and "--parents" in r.stderr
    assert not (tmp_path / "typo").exists()
    r = run("convert", src, dst, "--parents")
    assert r.returncode == 0, r.stderr
    assert run("verify", dst).returncode == 0


def test_gguf_type_with_vllm_output_is_refused(demo, tmp_path):
    _, src, _ = demo
    for extra in (["--to", "vllm"], []):
        r = run("convert", src, tmp_path / "v", "--gguf-type", "TQ1_0", *extra)
        assert r.returncode == 2 and "--gguf-type TQ1_0 applies to GGUF output only" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_lossy_regroup_needs_requantize_and_messages_name_flags(demo, tmp_path):
    import gguf

    _, src, _ = demo
    out = tmp_path / "tq2.gguf"
    r = run("convert", src, out, "--gguf-type", "TQ2_0")  # g128 scales differ inside the 256-blocks
    assert r.returncode == 1
    assert "--requantize" in r.stderr and "requantize=True" not in r.stderr and "ternarize()" not in r.stderr
    assert r.stderr.count("token_embd.weight") == 1, r.stderr  # the tensor named once
    assert not out.exists()
    r = run("convert", src, out, "--gguf-type", "TQ2_0", "--requantize")
    assert r.returncode == 0, r.stderr
    assert "re-ternarized" in r.stderr  # said out loud: the weights changed
    reader = gguf.GGUFReader(out)
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {"TQ2_0"}
    assert run("verify", out).returncode == 0


# ------------------------------------------------------------------------------------------ item 8: plan
def test_plan_gpu_memory_units_context_warning_and_exit_status(demo, tmp_path):
    _, _, out = demo
    for text in ("24", "24G", "24GB", "24GiB", "24gib", "24576MiB"):
        r = run("plan", out, "--gpu-memory", text, "--context", "1024", "--json")
        assert r.returncode == 0, (text, r.stderr)
        assert json.loads(r.stdout)["gpu_memory"] == 24 * GiB, text
    r = run("plan", out, "--gpu-memory", "0.5", "--context", "1024")
    assert r.returncode == 1 and "fits: NO" in r.stdout  # does not fit: non-zero exit
    r = run("plan", out, "--context", "100000")
    assert r.returncode == 0 and "warning: context 100000 exceeds the model's maximum of 2048" in r.stdout
    r = run("plan", out / "config.json")
    assert r.returncode == 1 and "not a model file" in r.stderr and "header size" not in r.stderr


# ------------------------------------------------------------------------------------------ item 6: verify
def test_verify_says_what_it_checked(demo, tmp_path):
    import shutil

    root, src, out = demo
    r = run("verify", out)
    assert r.returncode == 0 and "files match the SHA-256 sums of ternary_rs.json" in r.stdout
    r = run("verify", src)
    assert r.returncode == 0 and "SHA-256 not checked" in r.stdout
    bare = tmp_path / "no-manifest"
    shutil.copytree(out, bare)
    (bare / "ternary_rs.json").unlink()
    r = run("verify", bare)
    assert r.returncode == 0 and "SHA-256 not checked (no ternary_rs.json manifest)" in r.stdout
    assert "OK\n" not in r.stdout
    (bare / "tokenizer.json").unlink()
    r = run("verify", bare)
    assert r.returncode == 0 and "warning: no tokenizer" in r.stdout and "--tokenizer" in r.stdout


def _edit_tensor(d: Path, name: str, edit) -> Path:
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = d / wm[name]
    tensors = load_file(shard)
    edit(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (d / "ternary_rs.json").unlink()  # the values are the point here, not the checksums
    return shard


@pytest.mark.parametrize("what", ["nan", "code3", "zero", "implausible"])
def test_verify_flags_bad_scales_and_codes_with_the_api_first_index(demo, tmp_path, what):
    import shutil

    _, _, out = demo
    d = tmp_path / what
    shutil.copytree(out, d)
    prefix = "model.layers.1.mlp.down_proj"
    if what == "nan":
        _edit_tensor(d, f"{prefix}.scales", lambda s: s.__setitem__((3, 2), np.float16("nan")))
    elif what == "code3":
        _edit_tensor(d, f"{prefix}.qweight", lambda q: q.__setitem__((5, 7), 0x30))  # lane 2 of byte 7 = 3
    elif what == "zero":
        _edit_tensor(d, f"{prefix}.scales", lambda s: s.fill(0))
    else:
        _edit_tensor(d, f"{prefix}.scales", lambda s: s.__setitem__((0, 1), np.float16(30000)))
    r = run("verify", d)
    assert r.returncode == 1 and "FAILED" in r.stdout, r.stdout
    lines = [ln for ln in r.stdout.splitlines() if "problem:" in ln and prefix in ln]
    assert len(lines) == 1, r.stdout
    if what in ("nan", "code3"):
        with pytest.raises(ternary_rs.ValidationError) as api:  # what a user of the API is told
            ternary_rs.decode(d, prefix)
        first = api.value.first_index
        k = 512  # down_proj: K = intermediate size; 4 groups of 128 per row
        assert first == (3 * (k // 128) + 2 if what == "nan" else 5 * k + 7 * 4 + 2)  # from the edit itself
        assert f"first at {'scale ' if what == 'nan' else ''}index {first}" in lines[0], lines[0]
    elif what == "zero":
        assert "all " in lines[0] and "scales are 0" in lines[0]
    else:
        assert "|s| > 1000" in lines[0] and "first at scale index 1" in lines[0]


# ------------------------------------------------------------------------------------------ item 10: inspect
def test_inspect_reads_headers_only_unless_scan(demo, tmp_path):
    import shutil

    _, _, out = demo
    d = tmp_path / "nan"
    shutil.copytree(out, d)
    _edit_tensor(d, "model.layers.0.self_attn.q_proj.scales", lambda s: s.__setitem__((0, 0), np.float16("inf")))
    head = run("inspect", d)
    assert head.returncode == 0 and "headers only" in head.stdout and "problem" not in head.stdout
    assert "scales:" not in head.stdout and "1.32 M parameters" in head.stdout
    scan = run("inspect", d, "--scan")
    assert "scales:" in scan.stdout and "Inf 1" in scan.stdout
    assert "problem: model.layers.0.self_attn.q_proj.scales: 0 NaN and 1 Inf scales (first at scale index 0)" \
        in scan.stdout
    table = run("inspect", out, "--tensors")
    with ternary_rs.open(out) as f:
        names = {n[: -len(".qweight")] + ".weight" if n.endswith(".qweight") else n
                 for n in f.tensors if not n.endswith(".scales")}
    rows = [ln.split()[0] for ln in table.stdout.splitlines() if ln.startswith("  model.") or ln.startswith("  lm_")]
    assert sorted(rows) == sorted(names)
    assert "bits/w" in table.stdout and "kind" in table.stdout
    js = json.loads(run("inspect", out, "--json", "--tensors").stdout)
    assert len(js["tensor_table"]) == len(names) and js["level"] == "header"


def test_inspect_vocab_from_embedding_and_hadamard(demo, tmp_path):
    _, src, _ = demo
    plain = _rewrite_gguf(src, tmp_path / "no-vocab.gguf", drop=lambda k: k.startswith("tokenizer."))
    r = run("inspect", plain)
    assert r.returncode == 0 and "vocab 268 (rows of token_embd.weight)" in r.stdout, r.stdout
    names = ["blk.0.attn_q.weight", "blk.0.ffn_down.weight"]
    rotated = _rewrite_gguf(src, tmp_path / "rotated.gguf", extra=[
        ("prism.hadamard.version", 1, "u32"), ("prism.hadamard.transform", "normalized-sylvester-walsh-hadamard",
                                               "string"),
        ("prism.hadamard.block_size", 128, "u32"), ("prism.hadamard.weight_names", names, "array[string]"),
        ("prism.hadamard.inverse_weight_names", ["token_embd.weight"], "array[string]")])
    r = run("inspect", rotated)
    assert "Hadamard rotation (prism.hadamard.*): block 128, 2 rotated weights, 1 inverse-rotated" in r.stdout
    assert "Hadamard" not in run("inspect", src).stdout


# ------------------------------------------------------------------------------------------ item 9: pipes, progress
def test_closed_pipe_exits_quietly(demo):
    _, _, out = demo
    proc = subprocess.Popen(CLI + ["inspect", str(out), "--tensors"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before anything is written (like `| head -0`)
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert proc.returncode == 141 and err == "", err


def test_progress_frames_only_on_a_terminal(demo, tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    _, src, _ = demo
    r = run("convert", src, tmp_path / "piped")
    assert r.returncode == 0 and "\r" not in r.stderr and "%|" not in r.stderr and r.stderr == "", r.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a width
    try:
        proc = subprocess.Popen(CLI + ["convert", str(src), str(tmp_path / "tty")], stdout=subprocess.PIPE,
                                stderr=slave, env={**os.environ, "TERNARY_RS_TEST_SLEEP_PER_TENSOR": "0.02"})
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        proc.wait(timeout=120)
    finally:
        os.close(master)
    assert proc.returncode == 0
    assert b"convert demo-PQ2_0.gguf" in seen and b"\r" in seen  # a live bar, redrawn, on the terminal


# ------------------------------------------------------------------------------------------ item 10: speed
def _spm_llama_gguf(src: Path, dst: Path) -> Path:
    """The demo model as a llama GGUF with a SentencePiece ("llama") vocabulary of 268 tokens."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "t", "h", "e", "▁t", "he", "▁the", "o", "▁o"]
    tokens += pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return _rewrite_gguf(
        src, dst, drop=lambda k: k.startswith("tokenizer.") or k == "general.architecture",
        rename=lambda k: k.replace("qwen3.", "llama."),
        extra=[("general.architecture", "llama", "string"), ("tokenizer.ggml.model", "llama", "string"),
               ("tokenizer.ggml.tokens", tokens, "array[string]"), ("tokenizer.ggml.scores", scores, "array[f32]"),
               ("tokenizer.ggml.token_type", types, "array[i32]"), ("tokenizer.ggml.bos_token_id", 1, "u32"),
               ("tokenizer.ggml.eos_token_id", 2, "u32")],
        skip_tensors=[f"blk.{b}.attn_{q}_norm.weight" for b in range(2) for q in "qk"])


@pytest.mark.parametrize("kind", ["qwen3-bpe", "llama-sentencepiece"])
def test_small_gguf_converts_fast_without_transformers(demo, tmp_path, kind):
    """Config and tokenizer are rebuilt without importing transformers or torch (seconds of imports
    before: the cause of a ~350 KB GGUF taking 8 s). Speed itself is not asserted here (a timed unit test
    flakes on a loaded machine); measured ~0.5 s in-process, see the closing notes."""
    from tokenizers import Tokenizer

    _, src, _ = demo
    if kind == "llama-sentencepiece":
        src = _spm_llama_gguf(src, tmp_path / "llama-spm.gguf")
    out = tmp_path / "out"
    code = ("import sys, time, ternary_rs; t = time.perf_counter(); "
            f"ternary_rs.convert({str(src)!r}, {str(out)!r}, progress=False); "
            "print(time.perf_counter() - t, 'transformers' in sys.modules, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    _seconds, transformers_loaded, torch_loaded = r.stdout.split()
    assert transformers_loaded == "False" and torch_loaded == "False"
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.decode(tok.encode("the tooth").ids) == "the tooth"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == ("llama" if "llama" in kind else "qwen3") and cfg["vocab_size"] == 268
    if kind == "llama-sentencepiece":  # and the command-line switch that forbids transformers works too
        r = run("convert", src, tmp_path / "cli-out", "--no-transformers")
        assert r.returncode == 0, r.stderr
        assert run("verify", tmp_path / "cli-out").returncode == 0


# ------------------------------------------------------------------------------------------ item 11: messages
def test_missing_files_have_one_wording(demo, tmp_path):
    _, src, _ = demo
    missing = tmp_path / "nope.gguf"
    for cmd in (["convert", missing, tmp_path / "o"], ["inspect", missing], ["verify", missing], ["plan", missing]):
        r = run(*cmd)
        assert r.returncode == 1 and r.stderr == f"ternary-rs: {missing}: no such file or directory\n", (cmd, r.stderr)
    pattern = str(tmp_path / "nope*.gguf")
    r = run("convert", pattern, tmp_path / "o")
    assert r.returncode == 1 and r.stderr == f"ternary-rs: {pattern}: no such file or directory\n"
    assert not (tmp_path / "o").exists()


def test_bulk_errors_are_printed_once_with_their_path_once(demo, tmp_path):
    root, src, _ = demo
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(src.read_bytes()[:100_000])
    missing = tmp_path / "missing.gguf"
    r = run("convert", src, bad, missing, tmp_path / "bulk")
    assert r.returncode == 1 and r.stdout == f"wrote {tmp_path / 'bulk' / 'demo-PQ2_0'}\n"
    assert "2 of 3 conversions failed" in r.stderr
    for p in (bad, missing):
        assert r.stderr.count(str(p)) == 1, r.stderr
    assert f"  {missing}: no such file or directory" in r.stderr
    assert r.stderr.count("run past the end of the file") == 1, r.stderr


def test_errors_name_the_destination_not_the_staging_folder(demo, tmp_path):
    import resource

    _, src, _ = demo
    dst = tmp_path / "out"

    def small_files():  # writes past 64 KiB fail with EFBIG (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    r = subprocess.run(CLI + ["convert", str(src), str(dst)], capture_output=True, text=True, timeout=240,
                       preexec_fn=small_files)
    assert r.returncode == 1, r.stderr
    assert TMP_MARK not in r.stderr and "-meta-" not in r.stderr, r.stderr
    assert str(dst) in r.stderr and "File too large" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # and nothing half-written left


def test_byte_values_are_hex(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    r = run("inspect", bad)
    assert r.returncode == 1 and "bad magic 0x47 0x47 0x4d 0x4c" in r.stderr and "0x47 0x47 0x55 0x46" in r.stderr


def test_every_command_finishes_quickly_on_small_files(demo):
    """Sanity bound for the commands above (shared machine: generous)."""
    _, src, out = demo
    for cmd in (["inspect", src], ["verify", out], ["plan", out, "--context", "1024"]):
        t0 = time.perf_counter()
        assert run(*cmd).returncode == 0, cmd
        assert time.perf_counter() - t0 < 30, cmd
