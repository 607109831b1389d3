"""config.json and tokenizer rebuilt from GGUF metadata without transformers, compared with what
transformers' own GGUF loader builds from the same file (``AutoConfig`` / ``AutoTokenizer`` with
``gguf_file=``): byte-level BPE with several pre-tokenizers, user-defined and mislabelled control
tokens, and a Llama SentencePiece vocabulary (byte fallback, merges derived from the scores)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import ternary_rs
from ternary_rs.arch import ARCHES
from ternary_rs.demo import demo_tokenizer, qwen3_metadata
from ternary_rs.sinks.writers import GGUFWriter
from ternary_rs.sources.hf_gguf import builtin_tokenizer_from_gguf, builtin_tokenizer_supported, config_from_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

TEXTS = [
    "Hello world! This is a tiny model.", " the an is", "  two  spaces\tand\nnew lines\r\n",
    "digits 1234567 and 3.14159", "wörld ünïcödé 汉字 🙂", "<|im_start|>user\nhi<|im_end|>", "<think>x</think>",
    "they're we'll I'D", "",
]
SHAPE = dict(hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=32)


def _spm_vocab():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["▁", "t", "h", "e", "a", "n", "o", "r", "i", "s", "l", "d", "▁t", "he", "▁the", "▁a", "an", "▁an", "in",
              "er", "on", "▁o", "▁on", "re", "▁i", "is", "▁is", "▁s", "ll", "▁h", "▁he", "el", "lo", "▁hel", "▁hello",
              "or", "ld", "▁w", "w", "▁wor", "▁world", "<think>"]
    tokens += pieces
    types += [4 if p == "<think>" else 1 for p in pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def _write(path: Path, arch: str, tokenizer: list[tuple]) -> Path:
    tokens, types, merges = demo_tokenizer()
    meta = [(k.replace("qwen3.", f"{arch}."), v.replace("qwen3", arch) if k == "general.architecture" else v, t)
            for k, v, t in qwen3_metadata("t", SHAPE, 2, 256, tokens, types, merges) if not k.startswith("tokenizer.")]
    w = GGUFWriter(path)
    for key, value, vtype in meta + tokenizer:
        w.add_metadata(key, value, vtype)
    w.close()
    return path


def _gpt2(pre: str | None, extra_tokens=(), extra_types=()):
    tokens, types, merges = demo_tokenizer()
    tokens, types = tokens + list(extra_tokens), types + list(extra_types)
    out = [("tokenizer.ggml.model", "gpt2", "string"), ("tokenizer.ggml.tokens", tokens, "array[string]"),
           ("tokenizer.ggml.token_type", types, "array[i32]"), ("tokenizer.ggml.merges", merges, "array[string]"),
           ("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"), "u32"),
           ("tokenizer.ggml.padding_token_id", tokens.index("<|endoftext|>"), "u32")]
    return out + ([("tokenizer.ggml.pre", pre, "string")] if pre else [])


def _spm(add_space_prefix=None):
    tokens, types, scores = _spm_vocab()
    out = [("tokenizer.ggml.model", "llama", "string"), ("tokenizer.ggml.tokens", tokens, "array[string]"),
           ("tokenizer.ggml.scores", scores, "array[f32]"), ("tokenizer.ggml.token_type", types, "array[i32]"),
           ("tokenizer.ggml.bos_token_id", 1, "u32"), ("tokenizer.ggml.eos_token_id", 2, "u32"),
           ("tokenizer.ggml.unknown_token_id", 0, "u32")]
    return out + ([("tokenizer.ggml.add_space_prefix", add_space_prefix, "bool")] if add_space_prefix is not None else [])


CASES = {
    "qwen3-qwen2-pre": ("qwen3", _gpt2("qwen2")),
    "llama-llama-bpe": ("llama", _gpt2("llama-bpe")),
    "llama-gpt2-default": ("llama", _gpt2(None)),
    # <think> user-defined (added, not special); "▁ctl" is control but outside the byte alphabet (skipped)
    "qwen3-added-tokens": ("qwen3", _gpt2("qwen2", ["<think>", "</think>", "\u2581ctl"], [4, 4, 3])),
    "llama-sentencepiece": ("llama", _spm()),
    "llama-sentencepiece-prefix": ("llama", _spm(True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_builtin_tokenizer_equals_transformers_gguf_tokenizer(case, tmp_path):
    arch, tok_meta = CASES[case]
    path = _write(tmp_path / f"{case}.gguf", arch, tok_meta)
    md = dict(ternary_rs.open(path).metadata)
    assert builtin_tokenizer_supported(md)
    ours_dir = tmp_path / "ours"
    ours_dir.mkdir()
    builtin_tokenizer_from_gguf(md, ours_dir)
    ours = transformers.AutoTokenizer.from_pretrained(ours_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert ours.get_vocab() == theirs.get_vocab()
    assert sorted(ours.all_special_tokens) == sorted(theirs.all_special_tokens)
    for text in TEXTS:
        want = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == want, text
        assert ours.decode(want) == theirs.decode(want), text
    for key in ("eos_token", "pad_token", "bos_token", "unk_token"):
        assert getattr(ours, key) == getattr(theirs, key), key


def test_sentencepiece_add_space_prefix_false_is_honoured(tmp_path):
    """llama.cpp adds the leading "▁" only when tokenizer.ggml.add_space_prefix is true (transformers'
    GGUF loader ignores the key and always adds it; we follow the file, as llama.cpp does)."""
    from tokenizers import Tokenizer

    for flag, first in ((True, "▁he"), (False, "he")):
        path = _write(tmp_path / f"spm-{flag}.gguf", "llama", _spm(flag))
        out = tmp_path / f"out-{flag}"
        out.mkdir()
        builtin_tokenizer_from_gguf(dict(ternary_rs.open(path).metadata), out)
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        enc = tok.encode("hello world")
        assert enc.tokens[0] == first and tok.decode(enc.ids) == "hello world"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_builtin_config_equals_transformers_gguf_config(arch, tmp_path):
    path = _write(tmp_path / f"{arch}.gguf", arch, _gpt2("qwen2"))
    md = dict(ternary_rs.open(path).metadata)
    config, meta_copy = config_from_gguf(path, md, ["output.weight"], ARCHES[arch], "float16", tmp_path)
    assert meta_copy is None  # no transformers needed
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(config))
    ours = transformers.AutoConfig.from_pretrained(tmp_path / "ours")
    theirs = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "hidden_act",
                "eos_token_id", "pad_token_id", "bos_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    for key in ("rms_norm_eps", "rope_theta"):  # GGUF holds f32; we write the shortest decimal of that f32
        a = ours.rope_parameters[key] if key == "rope_theta" else getattr(ours, key)
        b = theirs.rope_parameters[key] if key == "rope_theta" else getattr(theirs, key)
        assert np.float32(a) == np.float32(b), key
    # transformers' qwen3 mapping ignores attention.key_length; the file states it, and we keep it
    assert ours.head_dim == md[f"{arch}.attention.key_length"] == SHAPE["head_dim"]


def test_other_tokenizers_are_not_claimed(tmp_path):
    assert not builtin_tokenizer_supported({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "some-new-pre"})
    assert not builtin_tokenizer_supported({"tokenizer.ggml.model": "llama", "general.architecture": "gemma3"})
    assert not builtin_tokenizer_supported({"tokenizer.ggml.model": "t5"})
    with pytest.raises(ternary_rs.UnsupportedTypeError, match="--no-transformers"):
        builtin_tokenizer_from_gguf({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]}, tmp_path)
