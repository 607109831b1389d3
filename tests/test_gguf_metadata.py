"""GGUF output metadata without llama.cpp (``test_llama_cpp.py`` checks the same files in llama.cpp itself):
the vocabulary and general keys we write for Hugging Face sources, checked against sentencepiece, tokenizers
and gguf-py; and the round trip GGUF → ternary_rs checkpoint → GGUF keeping every key, read back with
gguf-py's ``GGUFReader``."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import pytest

from support.gguf_models import build_model
from support.llama_cpp import gguf_contents

CLI = [sys.executable, "-m", "ternary_rs"]


def run(*args):
    r = subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ))
    assert r.returncode == 0, f"ternary-rs {' '.join(map(str, args))}:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_meta_llama")
    hf = build_model(root / "tiny-llama", "llama")
    ours = root / "tiny-llama-TQ2_0.gguf"
    run("convert", hf, ours, "--to", "gguf", "--gguf-type", "TQ2_0", "--no-progress")
    return root, hf, ours


@pytest.fixture(scope="module")
def qwen3_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_meta_qwen3")
    hf = build_model(root / "tiny-qwen3", "qwen3")
    ours = root / "tiny-qwen3-TQ1_0.gguf"
    run("convert", hf, ours, "--to", "gguf", "--gguf-type", "TQ1_0", "--no-progress")
    return root, hf, ours


def _value(meta, key):
    return meta[key][1]


def test_sentencepiece_vocabulary_matches_sentencepiece(llama_files):
    import gguf
    import sentencepiece as spm

    _, hf, ours = llama_files
    meta, tensors = gguf_contents(ours)
    sp = spm.SentencePieceProcessor(model_file=str(hf / "tokenizer.model"))
    n = sp.vocab_size()
    assert _value(meta, "tokenizer.ggml.model") == "llama"
    assert _value(meta, "tokenizer.ggml.pre") == "default"
    assert _value(meta, "tokenizer.ggml.tokens") == [sp.IdToPiece(i) for i in range(n)]
    assert _value(meta, "tokenizer.ggml.scores") == pytest.approx([sp.GetScore(i) for i in range(n)])
    expected_types = [2 if sp.IsUnknown(i) else 3 if sp.IsControl(i) else 6 if sp.IsByte(i) else 1 for i in range(n)]
    assert _value(meta, "tokenizer.ggml.token_type") == expected_types
    assert meta["tokenizer.ggml.token_type"][0] == ("ARRAY", "INT32")  # what llama.cpp's loader reads
    assert meta["tokenizer.ggml.scores"][0] == ("ARRAY", "FLOAT32")
    assert _value(meta, "tokenizer.ggml.bos_token_id") == sp.bos_id()
    assert _value(meta, "tokenizer.ggml.eos_token_id") == sp.eos_id()
    assert _value(meta, "tokenizer.ggml.add_bos_token") is True
    assert _value(meta, "tokenizer.ggml.add_eos_token") is False
    assert "tokenizer.chat_template" in meta
    # general.* as convert_hf_to_gguf.py writes them
    assert _value(meta, "general.type") == "model"
    params = sum(math.prod(t[1]) for t in tensors.values())
    assert _value(meta, "general.size_label") == gguf.size_label(params, params, 0, 0)
    assert _value(meta, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_TQ2_0)
    assert _value(meta, "general.quantization_version") == gguf.GGML_QUANT_VERSION
    assert _value(meta, "llama.vocab_size") == n


def test_qwen2_bpe_vocabulary_matches_tokenizers(qwen3_files):
    from tokenizers import Tokenizer

    _, hf, ours = qwen3_files
    meta, _ = gguf_contents(ours)
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    n = tok.get_vocab_size()
    assert _value(meta, "tokenizer.ggml.model") == "gpt2"
    assert _value(meta, "tokenizer.ggml.pre") == "qwen2"  # the Qwen2 split regex
    assert _value(meta, "tokenizer.ggml.tokens") == [tok.id_to_token(i) for i in range(n)]
    merges = json.loads((hf / "tokenizer.json").read_text())["model"]["merges"]
    assert _value(meta, "tokenizer.ggml.merges") == [m if isinstance(m, str) else " ".join(m) for m in merges]
    specials = {tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert [i for i, t in enumerate(_value(meta, "tokenizer.ggml.token_type")) if t == 3] == sorted(specials)
    assert _value(meta, "tokenizer.ggml.eos_token_id") == tok.token_to_id("<|im_end|>")
    assert _value(meta, "tokenizer.ggml.padding_token_id") == tok.token_to_id("<|endoftext|>")
    assert _value(meta, "tokenizer.chat_template").startswith("{% for m in messages %}")
    assert _value(meta, "general.type") == "model"
    assert "general.size_label" in meta and "general.name" in meta


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_gguf_checkpoint_gguf_keeps_every_key_and_byte(which, llama_files, qwen3_files):
    from ternary_rs.sinks.gguf_metadata import SOURCE_METADATA_FILE

    root, _, src = llama_files if which == "llama" else qwen3_files
    gtype = "TQ2_0" if which == "llama" else "TQ1_0"
    ck, back = root / "ck", root / "back.gguf"
    run("convert", src, ck, "--no-progress")
    assert (ck / SOURCE_METADATA_FILE).is_file()
    manifest = json.loads((ck / "ternary_rs.json").read_text())
    assert SOURCE_METADATA_FILE in manifest["files"]  # checksummed like every written file
    assert run("verify", ck).returncode == 0
    run("convert", ck, back, "--to", "gguf", "--gguf-type", gtype, "--no-progress")
    meta_s, tens_s = gguf_contents(src)
    meta_b, tens_b = gguf_contents(back)
    assert meta_b == meta_s  # including our own ternary_rs.version mark, exactly once
    assert tens_b == tens_s
    if which == "llama":  # a checkpoint converted again carries the stored keys along
        ck2, back2 = root / "ck2", root / "back2.gguf"
        run("convert", ck, ck2, "--no-progress")
        assert (ck2 / SOURCE_METADATA_FILE).read_bytes() == (ck / SOURCE_METADATA_FILE).read_bytes()
        run("convert", ck2, back2, "--to", "gguf", "--gguf-type", gtype, "--no-progress")
        assert gguf_contents(back2) == (meta_s, tens_s)


def test_stored_metadata_is_dropped_when_the_checkpoint_no_longer_matches(llama_files, caplog):
    from ternary_rs.sinks.gguf_metadata import stored_source_metadata

    root, _, src = llama_files
    ck = root / "ck"  # written by the round-trip test when it ran first
    if not ck.is_dir():
        run("convert", src, ck, "--no-progress")
    config = json.loads((ck / "config.json").read_text())
    entries = stored_source_metadata(ck, config, "llama", 37)
    keys = {k: (v, t) for k, v, t in entries}
    assert keys["tokenizer.ggml.scores"][1] == "array[f32]" and keys["general.file_type"] == (37, "u32")
    assert "ternary_rs.version" not in keys  # the output adds its own
    with caplog.at_level(logging.WARNING, logger="ternary_rs.convert"):
        assert stored_source_metadata(ck, {**config, "num_hidden_layers": 3}, "llama", 37) is None
        assert stored_source_metadata(ck, {**config, "vocab_size": 999}, "llama", 37) is None
        assert stored_source_metadata(ck, config, "qwen3", 37) is None
    assert "llama.block_count = 2 but config.json num_hidden_layers = 3" in caplog.text
    assert "tokens but config.json vocab_size = 999" in caplog.text


def test_hf_source_without_tokenizer_is_refused_clearly(tmp_path, llama_files):
    import shutil

    _, hf, _ = llama_files
    bare = tmp_path / "bare"
    shutil.copytree(hf, bare)
    for name in ("tokenizer.model", "tokenizer.json"):
        (bare / name).unlink(missing_ok=True)
    r = subprocess.run(CLI + ["convert", str(bare), str(tmp_path / "x.gguf"), "--to", "gguf", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "no tokenizer.json or tokenizer.model" in r.stderr
    assert not (tmp_path / "x.gguf").exists()


# ------------------------------------------------------------------------------------------ rope scaling
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}


@pytest.fixture(scope="module")
def llama3_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_meta_llama3")
    hf = build_model(root / "tiny-llama3", "llama", config_extra={"rope_parameters": dict(LLAMA3_ROPE)})
    ours = root / "tiny-llama3-TQ2_0.gguf"
    run("convert", hf, ours, "--to", "gguf", "--gguf-type", "TQ2_0", "--no-progress")
    return root, hf, ours


def test_llama3_rope_freqs_match_transformers(llama3_files):
    """``rope_freqs.weight`` divides llama.cpp's rotary frequencies: default / llama3 inverse frequencies
    of transformers' own rope code (``ROPE_INIT_FUNCTIONS``)."""
    import numpy as np
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, hf, ours = llama3_files
    _, tensors = gguf_contents(ours)
    dtype, shape, data = tensors["rope_freqs.weight"]
    assert (dtype, shape) == ("F32", (32,))  # head_dim 64 / 2
    factors = np.frombuffer(data, dtype=np.float32)
    config = AutoConfig.from_pretrained(str(hf))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    default = 1.0 / (LLAMA3_ROPE["rope_theta"] ** (np.arange(0, 64, 2, dtype=np.float64) / 64))  # unscaled
    np.testing.assert_allclose(default / scaled.double().numpy(), factors, rtol=2e-6)
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()


def test_llama3_rope_factors_without_torch_agree():
    """The numpy path (no torch installed) gives upstream's torch values to within a few float32 ulps."""
    import numpy as np

    from ternary_rs.arch.rope import llama3_rope_factors

    for theta, dim, orig in ((500000.0, 64, 64), (500000.0, 128, 8192), (10000.0, 128, 1024)):
        config = {"hidden_size": 4 * dim, "num_attention_heads": 4, "head_dim": dim,
                  "rope_parameters": {**LLAMA3_ROPE, "rope_theta": theta, "original_max_position_embeddings": orig}}
        a = llama3_rope_factors(config, use_torch=True)
        b = llama3_rope_factors(config, use_torch=False)
        np.testing.assert_array_max_ulp(a, b, maxulp=4)
    assert llama3_rope_factors({"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 1e4}) is None


def _hparam_keys(arch_name: str, config: dict) -> dict:
    import gguf

    from ternary_rs.arch import ARCHES
    from ternary_rs.sinks.gguf_metadata import writer_entries

    w = gguf.GGUFWriter(None, arch_name)
    ARCHES[arch_name].gguf_hparams(w, config)
    return {k: v for k, v, _ in writer_entries(w)}


@pytest.mark.parametrize("arch_name", ["llama", "qwen3"])
def test_rope_scaling_keys_from_config(arch_name):
    """llama.cpp's ``rope.scaling.*`` keys for linear and YaRN, from transformers 5's ``rope_parameters``
    and from the older ``rope_scaling`` + top-level ``rope_theta`` layout (``type`` spelling)."""
    base = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 400, "rms_norm_eps": 1e-6}
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32.0, "beta_slow": 1.0}
    a = f"{arch_name}."
    new = _hparam_keys(arch_name, {**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **yarn}})
    old = _hparam_keys(arch_name, {**base, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", **yarn}})
    assert new == old
    assert new[a + "rope.scaling.type"] == "yarn" and new[a + "rope.scaling.factor"] == 4.0
    assert new[a + "rope.scaling.original_context_length"] == 32768 and new[a + "rope.freq_base"] == 1e6
    assert new[a + "rope.scaling.yarn_beta_fast"] == 32.0 and new[a + "rope.scaling.yarn_beta_slow"] == 1.0
    linear = _hparam_keys(arch_name, {**base, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (linear[a + "rope.scaling.type"], linear[a + "rope.scaling.factor"]) == ("linear", 2.0)
    plain = _hparam_keys(arch_name, {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    llama3 = _hparam_keys(arch_name, {**base, "rope_parameters": dict(LLAMA3_ROPE)})
    for keys in (plain, llama3):  # llama3 is a tensor (rope_freqs), not a key
        assert not [k for k in keys if ".rope.scaling." in k]


def test_gguf_to_gguf_keeps_llama_rows_and_rope_freqs(llama3_files):
    """A GGUF re-encoded into another GGUF holds the same values in the same rows: llama's q/k rows stay
    in llama.cpp's permuted order (they came out in Hugging Face order), and ``rope_freqs`` stays."""
    import gguf
    import numpy as np

    root, _, src = llama3_files
    meta_s, tens_s = gguf_contents(src)
    same = root / "same-TQ2_0.gguf"
    run("convert", src, same, "--to", "gguf", "--gguf-type", "TQ2_0", "--no-progress")
    assert gguf_contents(same) == (meta_s, tens_s)
    retyped = root / "retyped-TQ1_0.gguf"
    run("convert", src, retyped, "--to", "gguf", "--gguf-type", "TQ1_0", "--no-progress")
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(retyped))
    tb = {t.name: t for t in b.tensors}
    assert set(tb) == {t.name for t in a.tensors}
    for t in a.tensors:
        np.testing.assert_array_equal(gguf.quants.dequantize(tb[t.name].data, tb[t.name].tensor_type),
                                      gguf.quants.dequantize(t.data, t.tensor_type), err_msg=t.name)
    assert tb["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.TQ1_0
