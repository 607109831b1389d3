"""Ternary embeddings and a padded vocabulary in **real upstream llama.cpp** (skipped unless ``LLAMA_CPP_BIN``
is set; see ``tests/support/llama_cpp.py``).

The model has the structure of Ternary-Bonsai-1.7B (and of ``benches/bench_vllm.py``'s synthetic one) at
a tiny scale: Qwen3, **ternary embeddings**, **tied** (no ``lm_head``; llama.cpp then multiplies by
``token_embd`` for the output) or untied, and config.json's ``vocab_size`` (4096) far above the
tokenizer's ~320 tokens, so the GGUF vocabulary is padded with ``[PAD{i}]`` tokens of type UNUSED.

``ternary-rs convert`` writes the embeddings TQ2_0 (lossless for ternary rows; llama.cpp's CPU backend
looks rows up with ``get_rows`` on TQ2_0 and multiplies by it). llama.cpp's own converter writes
token_embd / output as F16 in a TQ file (``ModelBase.prepare_tensors``), so the references are:

* **byte for byte**: ``convert_hf_to_gguf.py --outtype tq2_0`` on the same (dequantized) Hugging Face model,
  told to quantize token_embd / output like the other weights (its ``tensor_force_quant`` hook): every
  key (vocabulary, padding, token types, hyper-parameters) and every tensor byte equal, and llama.cpp's
  greedy tokens equal;
* **llama.cpp's default file** (F16 embeddings): greedy tokens equal up to the first step where that
  file's top two candidates are within ``NEAR_TIE`` log-probability. An F16 and a TQ2_0 output matrix
  are multiplied differently (F16 activations vs Q8_K-quantized activations), which moves the logits by
  ~0.01, so a near-tie may resolve the other way; exact token equality against it is not achievable.
  (The transformers model would be no better a reference: llama.cpp quantizes activations everywhere.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.gguf_models import build_model
from support.llama_cpp import gguf_contents, greedy_tokens, reference_convert, require_binary, require_converter

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "ternary_rs"]
PROMPT = "Once upon a time"
VOCAB_SIZE = 4096          # config.json; the tokenizer has ~320 tokens
N_PREDICT = 24
# Log-probability lead below which two candidates count as tied across F16 / Q8_K numerics.
NEAR_TIE = 0.05
# The comparison with llama.cpp's default (F16-embedding) file must cover at least this many tokens.
MIN_COMPARED = 8
OWN_KEYS = ("ternary_rs.version",)


def run(*args, timeout=600):
    r = subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ))
    assert r.returncode == 0, f"ternary-rs {' '.join(map(str, args))}:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model(request, tmp_path_factory):
    require_binary("llama-server")
    require_converter()
    tied = request.param
    root = tmp_path_factory.mktemp("tied" if tied else "untied")
    # the bench's tokenizer (models.train_tokenizer: byte-level BPE, GPT-2's regex)
    hf = build_model(root / "hf", "qwen3", tied=tied, vocab_size=VOCAB_SIZE, tokenizer="gpt2",
                     ternary_embeddings=True)
    ref_tq = reference_convert(hf, root / "ref-tq.gguf", "tq2_0", "gpt-2", quantize_embeddings=True)
    ref_f16 = reference_convert(hf, root / "ref-f16.gguf", "tq2_0", "gpt-2")
    return tied, root, hf, ref_tq, ref_f16


def _assert_same_file(ours: Path, ref: Path) -> None:
    meta_o, tens_o = gguf_contents(ours)
    meta_r, tens_r = gguf_contents(ref)
    diff = {k for k in set(meta_o) | set(meta_r) if k not in OWN_KEYS and meta_o.get(k) != meta_r.get(k)}
    assert not diff, {k: (str(meta_r.get(k))[:200], str(meta_o.get(k))[:200]) for k in sorted(diff)}
    assert tens_o.keys() == tens_r.keys()
    for name in tens_r:
        assert tens_o[name][:2] == tens_r[name][:2], name
        assert tens_o[name][2] == tens_r[name][2], f"{name}: bytes differ"


def _ours(model, source: str) -> Path:
    """Our GGUF from the Hugging Face directory, or (as the bench does) from a ternary_rs checkpoint."""
    tied, root, hf, _, _ = model
    out = root / f"ours-{source}.gguf"
    if not out.exists():
        src = hf
        if source == "checkpoint":
            src = root / "checkpoint" / hf.name  # same folder name: general.name comes from it
            run("convert", hf, src, "--no-progress", "--parents")
            ck_config = json.loads((src / "config.json").read_text())
            assert ck_config["tie_word_embeddings"] is tied
            assert "model.embed_tokens" not in ck_config["quantization_config"]["modules_not_converted"]
        run("convert", src, out, "--to", "gguf", "--gguf-type", "TQ2_0", "--no-progress")
    return out


@pytest.mark.parametrize("source", ["hf", "checkpoint"])
def test_padded_vocab_and_ternary_embeddings_match_llama_cpp_converter(model, source):
    tied, _, _, ref_tq, _ = model
    ours = _ours(model, source)
    _assert_same_file(ours, ref_tq)
    meta, tensors = gguf_contents(ours)
    tokens = meta["tokenizer.ggml.tokens"][1]
    types = meta["tokenizer.ggml.token_type"][1]
    assert len(tokens) == VOCAB_SIZE
    assert tokens[-1] == f"[PAD{VOCAB_SIZE - 1}]" and types[-1] == 5  # gguf.TokenType.UNUSED
    assert tensors["token_embd.weight"][:2] == ("TQ2_0", (256, VOCAB_SIZE))
    assert ("output.weight" in tensors) is not tied
    if not tied:
        assert tensors["output.weight"][0] == "TQ2_0"


def test_llama_cpp_runs_ternary_embeddings_like_its_own_files(model):
    from transformers import AutoTokenizer

    _, _, hf, ref_tq, ref_f16 = model
    ours = _ours(model, "checkpoint")
    got = greedy_tokens(ours, PROMPT, N_PREDICT)
    # llama.cpp tokenized the prompt as the Hugging Face tokenizer does (padding did not disturb it)
    assert got.prompt == AutoTokenizer.from_pretrained(str(hf)).encode(PROMPT, add_special_tokens=True)
    assert len(got.tokens) == N_PREDICT
    # the same file as the converter's (but for our mark): the same tokens
    assert greedy_tokens(ref_tq, PROMPT, N_PREDICT).tokens == got.tokens
    # llama.cpp's default file, F16 embeddings: the same tokens until a near-tie
    f16 = greedy_tokens(ref_f16, PROMPT, N_PREDICT)
    assert f16.prompt == got.prompt
    compared = N_PREDICT
    for i, (a, b) in enumerate(zip(got.tokens, f16.tokens)):
        if a != b:
            assert f16.margins[i] < NEAR_TIE, (
                f"step {i}: llama.cpp chose {a} on ours, {b} on its F16-embedding file, which led by "
                f"{f16.margins[i]:.4f} (not a near-tie)\nours {got.tokens}\nf16  {f16.tokens}")
            compared = i
            break
    assert compared >= MIN_COMPARED, (compared, got.tokens, f16.tokens, f16.margins)
