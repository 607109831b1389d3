"""Our GGUF output in **real upstream llama.cpp** (``scripts/build_llama_cpp.sh``; skipped unless
``LLAMA_CPP_BIN`` is set — CI does not build llama.cpp, it takes ~15–25 min on 2 cores).

Models: a tiny llama with a sentencepiece ``tokenizer.model`` and a tiny qwen3 with a Qwen2-style byte-level
BPE ``tokenizer.json`` (``gguf_models``), converted to TQ2_0 / TQ1_0 by llama.cpp's own
``convert_hf_to_gguf.py`` (the reference). Checked against that reference:

* round trip ``ternary-rs convert ref.gguf ck/`` → ``ternary-rs convert ck/ back.gguf --to gguf``: every key and
  every tensor byte equal, and ``llama-completion``'s greedy output on ``back.gguf`` equals its output on
  ``ref.gguf`` (before the fix the tokenizer scores were lost and llama.cpp printed
  ``Onceuponatime…[UNK_BYTE_0xe29681▁s]…``);
* the same round trip with the checkpoint's stored source metadata removed (tokenizer rebuilt from
  ``tokenizer.json`` only): tokenizer keys equal to the reference converter's ``--vocab-only`` output on
  the same files, same llama.cpp output;
* Hugging Face directory → ``ternary-rs convert --to gguf``: keys and tensors equal to the reference
  converter's file, same llama.cpp output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.gguf_models import build_model
from support.llama_cpp import complete, gguf_contents, reference_convert, require_binary, require_converter

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "ternary_rs"]
PROMPT = "Once upon a time, minus one"
# The converter cannot hash-identify a pre-tokenizer trained on a few sentences; this is the family built.
REFERENCE_PRE = {"llama": "", "qwen3": "qwen2"}
GGUF_TYPES = ("TQ2_0", "TQ1_0")
ARCHES = ("llama", "qwen3")
# Keys that legitimately differ: our provenance mark.
OWN_KEYS = ("ternary_rs.version",)


def run(*args, timeout=600):
    r = subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ))
    assert r.returncode == 0, f"ternary-rs {' '.join(map(str, args))}:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    require_binary()
    require_converter()
    root = tmp_path_factory.mktemp("llama_cpp")
    out = {}
    for arch in ARCHES:
        hf = build_model(root / arch, arch)
        for gtype in GGUF_TYPES:
            ref = reference_convert(hf, root / f"ref-{arch}-{gtype}.gguf", gtype.lower(), REFERENCE_PRE[arch])
            out[arch, gtype] = (hf, ref)
    return root, out


def _without_own_keys(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in OWN_KEYS}


def _assert_same_file(ours: Path, ref: Path) -> None:
    meta_o, tens_o = gguf_contents(ours)
    meta_r, tens_r = gguf_contents(ref)
    assert meta_o.get("ternary_rs.version") is not None
    diff = {k for k in set(meta_o) | set(meta_r) if k not in OWN_KEYS and meta_o.get(k) != meta_r.get(k)}
    assert not diff, {k: (str(meta_r.get(k))[:200], str(meta_o.get(k))[:200]) for k in sorted(diff)}
    assert tens_o.keys() == tens_r.keys()
    for name in tens_r:
        assert tens_o[name][:2] == tens_r[name][:2], name
        assert tens_o[name][2] == tens_r[name][2], f"{name}: bytes differ"


@pytest.mark.parametrize("gtype", GGUF_TYPES)
@pytest.mark.parametrize("arch", ARCHES)
def test_round_trip_runs_like_the_original(models, arch, gtype):
    root, files = models
    _, ref = files[arch, gtype]
    ck, back = root / f"ck-{arch}-{gtype}", root / f"back-{arch}-{gtype}.gguf"
    run("convert", ref, ck, "--no-progress")
    run("convert", ck, back, "--to", "gguf", "--gguf-type", gtype, "--no-progress")
    _assert_same_file(back, ref)
    expected = complete(ref, PROMPT)
    assert PROMPT.encode() in expected  # llama.cpp tokenized and detokenized the prompt faithfully
    assert complete(back, PROMPT) == expected


@pytest.mark.parametrize("arch", ARCHES)
def test_round_trip_without_stored_metadata_rebuilds_the_tokenizer(models, arch):
    """A checkpoint without the source GGUF's keys: the tokenizer comes from its tokenizer.json, rebuilt
    as llama.cpp's converter rebuilds it (compared with the converter's --vocab-only output)."""
    from ternary_rs.sinks.gguf_metadata import SOURCE_METADATA_FILE

    root, files = models
    _, ref = files[arch, "TQ2_0"]
    ck, back = root / f"ck-nometa-{arch}", root / f"back-nometa-{arch}.gguf"
    run("convert", ref, ck, "--no-progress")
    (ck / SOURCE_METADATA_FILE).unlink()
    run("convert", ck, back, "--to", "gguf", "--gguf-type", "TQ2_0", "--no-progress")
    # The reference converter on the same config + tokenizer files (it cannot read ternary weights).
    vocab_dir = root / f"vocab-{arch}"
    vocab_dir.mkdir()
    for f in ck.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copyfile(f, vocab_dir / f.name)
    config = json.loads((ck / "config.json").read_text())
    config.pop("quantization_config")
    (vocab_dir / "config.json").write_text(json.dumps(config))
    vocab_ref = reference_convert(vocab_dir, root / f"vocab-{arch}.gguf", "tq2_0", REFERENCE_PRE[arch],
                                  extra=("--vocab-only",))
    meta_o, _ = gguf_contents(back)
    meta_r, _ = gguf_contents(vocab_ref)
    tok_keys = {k for k in set(meta_o) | set(meta_r) if k.startswith("tokenizer.")}
    assert "tokenizer.ggml.tokens" in tok_keys
    assert {k: meta_o.get(k) for k in tok_keys} == {k: meta_r.get(k) for k in tok_keys}
    assert meta_o["general.type"] == meta_r["general.type"]
    assert "general.size_label" in meta_o
    assert complete(back, PROMPT) == complete(ref, PROMPT)


@pytest.mark.parametrize("gtype", GGUF_TYPES)
@pytest.mark.parametrize("arch", ARCHES)
def test_hf_directory_to_gguf_matches_llama_cpp_converter(models, arch, gtype):
    root, files = models
    hf, ref = files[arch, gtype]
    ours = root / f"ours-{arch}-{gtype}.gguf"
    run("convert", hf, ours, "--to", "gguf", "--gguf-type", gtype, "--no-progress")
    _assert_same_file(ours, ref)
    assert complete(ours, PROMPT) == complete(ref, PROMPT)
