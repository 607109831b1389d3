"""Hugging Face <-> GGUF metadata: config.json, tokenizer and generation config.

GGUF -> HF is built in: config.json from the llama.cpp keys transformers' GGUF mapping reads (plus
per-architecture fixups, e.g. Qwen3's ``head_dim``), tokenizer.json rebuilt with ``tokenizers`` for
byte-level BPE and Llama SentencePiece vocabularies, as transformers' GGUF loader builds them (the tests
compare both). Only other tokenizers go through transformers (``AutoTokenizer`` machinery with
``gguf_file=``), on a *metadata-only copy* of the GGUF (same key/value bytes, zero tensors), so
transformers never touches tensor data (it could not decode PQ2_0/PTQ1_0, and would be slow).

HF -> GGUF metadata lives in ``ternary_rs.sinks.gguf_metadata``.
"""

from __future__ import annotations

import json
import logging
import struct
import tempfile
from pathlib import Path
from typing import Any

from .._core import FormatError, UnsupportedTypeError

log = logging.getLogger("ternary_rs.convert")

# GGUF key/value walking (only to copy the metadata section verbatim).
_GGUF_MAGIC = b"GGUF"
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
MAX_METADATA_ARRAY_NESTING = 4

# Files copied from a Hugging Face source directory into the output.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
)
GENERATION_CONFIG = "generation_config.json"
# A metadata-only copy of the GGUF a checkpoint was converted from (see ternary_rs.sinks.gguf_metadata); travels
# with the tokenizer files. Not named *.gguf so that nothing globbing for model files takes it for one.
SOURCE_GGUF_METADATA = "ternary_rs.gguf_metadata"
SIDE_FILES = TOKENIZER_FILES + (GENERATION_CONFIG, SOURCE_GGUF_METADATA)


# ------------------------------------------------------------------------------------------ GGUF -> HF
def _gguf_kv_spans(blob: memoryview, path: str) -> tuple[int, list[tuple[str, int, int]]]:
    """``(version, [(key, start, end)])``: byte span of every key/value pair of a little-endian GGUF."""
    if bytes(blob[:4]) != _GGUF_MAGIC:
        magic = " ".join(f"0x{b:02x}" for b in bytes(blob[:4]))
        raise FormatError(f"{path}: not a GGUF file (magic {magic} at byte 0; expected 0x47 0x47 0x55 0x46)")
    version, _, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version & 0xFFFF == 0:
        raise UnsupportedTypeError(f"{path}: big-endian GGUF metadata copy is not supported")
    pos = 24

    def skip_value(vtype: int, pos: int, depth: int) -> int:
        if vtype in _GGUF_SCALAR_SIZES:
            return pos + _GGUF_SCALAR_SIZES[vtype]
        if vtype == _GGUF_STRING:
            (n,) = struct.unpack_from("<Q", blob, pos)
            return pos + 8 + n
        if vtype == _GGUF_ARRAY:
            if depth >= MAX_METADATA_ARRAY_NESTING:
                raise FormatError(f"{path}: metadata arrays nested deeper than {MAX_METADATA_ARRAY_NESTING} at byte {pos}")
            etype, count = struct.unpack_from("<IQ", blob, pos)
            pos += 12
            if etype in _GGUF_SCALAR_SIZES:
                return pos + count * _GGUF_SCALAR_SIZES[etype]
            for _ in range(count):
                pos = skip_value(etype, pos, depth + 1)
            return pos
        raise FormatError(f"{path}: unknown metadata value type {vtype} at byte {pos}")

    spans = []
    for _ in range(kv_count):
        start = pos
        (klen,) = struct.unpack_from("<Q", blob, pos)
        key = bytes(blob[pos + 8:pos + 8 + klen]).decode("utf-8", "replace")
        pos += 8 + klen
        (vtype,) = struct.unpack_from("<I", blob, pos)
        pos = skip_value(vtype, pos + 4, 0)
        if pos > len(blob):
            raise FormatError(f"{path}: metadata key {key!r} runs past the end of the file ({pos} > {len(blob)})")
        spans.append((key, start, pos))
    return version, spans


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _renamed_kv(blob: memoryview, key: str, start: int, end: int, rename_arch: tuple[str, str]) -> bytes:
    """One key/value pair with architecture ``old`` read as ``new``: ``old.*`` keys become ``new.*`` and
    ``general.architecture`` says ``new``; every other byte is copied."""
    old, new = rename_arch
    if key == "general.architecture":
        return _gguf_string(key) + struct.pack("<I", _GGUF_STRING) + _gguf_string(new)
    if key.startswith(old + "."):
        (key_len,) = struct.unpack_from("<Q", blob, start)
        return _gguf_string(new + key[len(old):]) + bytes(blob[start + 8 + key_len:end])
    return bytes(blob[start:end])


def write_metadata_only_gguf(src: str | Path, dst: str | Path, drop_keys: tuple[str, ...] = (),
                             rename_arch: tuple[str, str] | None = None) -> None:
    """Copy ``src``'s header and key/value pairs byte for byte (minus ``drop_keys``), with zero tensors;
    ``rename_arch = (old, new)`` presents architecture ``old``'s keys as ``new``'s."""
    import mmap

    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        blob = memoryview(mm)
        try:
            version, spans = _gguf_kv_spans(blob, str(src))
            kept = [bytes(blob[a:b]) if rename_arch is None else _renamed_kv(blob, key, a, b, rename_arch)
                    for key, a, b in spans if key not in drop_keys]
        except struct.error as e:
            raise FormatError(f"{src}: truncated GGUF metadata ({e})") from None
        finally:
            blob.release()
    body = b"".join(kept)
    with open(dst, "wb") as out:
        out.write(_GGUF_MAGIC + struct.pack("<IQQ", version, 0, len(kept)) + body)
        out.write(b"\0" * (-(24 + len(body)) % 32))


def _transformers_available() -> bool:
    try:
        import torch  # noqa: F401  (transformers' GGUF loader requires it)
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def builtin_config_from_gguf(metadata: dict[str, Any], arch) -> dict[str, Any]:
    """Config keys straight from llama.cpp metadata: the keys transformers' GGUF config mapping reads for
    the dense decoders (llama, qwen3), without importing it. A key the file does not state is left out,
    so the config class's default applies, as with transformers."""
    a = arch.gguf_arch
    g = lambda key, default=None: metadata.get(f"{a}.{key}", default)  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    tokens = metadata.get("tokenizer.ggml.tokens")
    config = {
        "architectures": [arch.hf_architectures[0]],
        "model_type": arch.hf_model_types[0],
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", g("rope.dimension_count", hidden // heads))),
        "vocab_size": int(g("vocab_size", len(tokens) if isinstance(tokens, list) else 0)),
        "hidden_act": "silu",
    }
    for key, name, kind in (("context_length", "max_position_embeddings", int),
                            ("attention.layer_norm_rms_epsilon", "rms_norm_eps", float),
                            ("rope.freq_base", "rope_theta", float)):
        if g(key) is not None:
            config[name] = kind(g(key))
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in metadata:
            config[name] = int(metadata[f"tokenizer.ggml.{key}"])
    return config


def _shortest_f32_floats(config: dict[str, Any]) -> None:
    """GGUF stores floats as f32: write 1e-06, not 9.999999974752427e-07 (same f32 value)."""
    import numpy as np

    for key, value in list(config.items()):
        if isinstance(value, float) and np.isfinite(value) and float(np.float32(value)) == value:
            config[key] = float(str(np.float32(value)))
        elif isinstance(value, dict):
            _shortest_f32_floats(value)


def config_from_gguf(gguf_path: Path, metadata: dict[str, Any], tensor_names, arch, dtype: str,
                     workdir: Path, use_transformers: bool = True) -> tuple[dict[str, Any], Path | None]:
    """``(config dict, metadata-only GGUF copy for transformers' tokenizer rebuild, or None)``.

    The config comes from :func:`builtin_config_from_gguf` (the same keys transformers maps, for the
    hand-written architectures) or from the arch's own ``config_from_gguf_metadata`` (the generic one).
    The tokenizer is rebuilt without transformers whenever :func:`builtin_tokenizer_supported`; only other
    tokenizers need transformers (a few seconds of imports), and then only with ``use_transformers``.
    """
    meta_copy = None
    if ("tokenizer.ggml.tokens" in metadata and not builtin_tokenizer_supported(metadata)
            and use_transformers and _transformers_available()):
        meta_copy = workdir / "metadata-only.gguf"
        # An architecture transformers cannot read (e.g. bitnet) presents its keys as ``alias``'s: tokenizer
        # keys do not depend on the architecture.
        alias = getattr(arch, "transformers_gguf_alias", None)
        write_metadata_only_gguf(gguf_path, meta_copy,
                                 rename_arch=None if alias is None else (arch.gguf_arch, alias))
    # An architecture mapped through transformers' tables brings its whole config (ternary_rs.arch.generic).
    own = getattr(arch, "config_from_gguf_metadata", None)
    config = own(metadata, tensor_names) if own is not None else builtin_config_from_gguf(metadata, arch)
    arch.config_fixups_from_gguf(config, metadata)
    _shortest_f32_floats(config)
    config["architectures"] = [arch.hf_architectures[0]]
    # llama.cpp writes output.weight only when it is not the embedding matrix.
    config["tie_word_embeddings"] = "output.weight" not in set(tensor_names)
    config["dtype"] = dtype
    return config, meta_copy


# ``tokenizer.ggml.pre`` -> the regex that splits text before byte-level BPE (llama.cpp's pre-tokenizer
# names; the same table transformers' GGUF loader uses, so both rebuild the same tokenizer).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# Pre-tokenizers the built-in gpt2 path reproduces: the table above, and GPT-2's own regex.
_GPT2_DEFAULT_PRE = ("gpt-2", "gpt2", "default")
# llama.cpp token types (gguf.TokenType).
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4
# Architectures whose SentencePiece ("llama") tokenizer is the plain Llama one (transformers has
# per-architecture variants, e.g. Gemma's and Phi-3's, that the built-in path does not rebuild).
_PLAIN_SENTENCEPIECE_ARCHES = ("llama",)


def builtin_tokenizer_supported(metadata: dict[str, Any]) -> bool:
    """Whether :func:`builtin_tokenizer_from_gguf` rebuilds this GGUF's tokenizer exactly as transformers'
    GGUF loader would: byte-level BPE (``gpt2``) with a known pre-tokenizer, or a Llama SentencePiece."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2":
        pre = metadata.get("tokenizer.ggml.pre")
        return pre is None or pre in PRE_TOKENIZER_SPLITS or pre in _GPT2_DEFAULT_PRE
    return model == "llama" and metadata.get("general.architecture") in _PLAIN_SENTENCEPIECE_ARCHES


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte value (``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """BPE merges a vocabulary implies (SentencePiece GGUFs list none): every split of a token into two
    tokens, best score first (transformers' ``generate_merges``, so both give the same order)."""
    reverse = scores is not None
    ranked = scores if reverse else vocab
    merges = []
    for merge, piece_score in ranked.items():
        local = [(merge[:i], merge[i:], piece_score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=reverse)
    return [(a, b) for a, b, _ in merges]


def builtin_tokenizer_from_gguf(metadata: dict[str, Any], out_dir: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` from ``tokenizer.ggml.*`` with only ``tokenizers``.

    Rebuilds what transformers' GGUF loader builds (``GPT2Tokenizer`` / ``LlamaTokenizer`` backends,
    the pre-tokenizer split of ``tokenizer.ggml.pre``, control tokens as special tokens, user-defined
    ones as added tokens) in a few milliseconds instead of seconds of imports; the tests compare the two.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if not builtin_tokenizer_supported(metadata):
        raise UnsupportedTypeError(
            f"the built-in tokenizer rebuild handles byte-level BPE (gpt2) with a known pre-tokenizer and "
            f"Llama SentencePiece, not tokenizer.ggml.model={metadata.get('tokenizer.ggml.model')!r} "
            f"pre={metadata.get('tokenizer.ggml.pre')!r} (architecture {metadata.get('general.architecture')!r}); "
            "install transformers and drop --no-transformers")
    model = metadata["tokenizer.ggml.model"]
    tokens = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    file_merges = metadata.get("tokenizer.ggml.merges")
    if model == "gpt2":
        spelling = byte_alphabet()
        alphabet = set(spelling.values())
        spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        merges = ([tuple(m.split(" ")) for m in file_merges] if file_merges is not None
                  else _merges_from_vocab(vocab, dict(zip(spelled, metadata.get("tokenizer.ggml.scores") or []))
                                          or None))
        tok = Tokenizer(models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
        split = PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        # a control token outside the byte alphabet is a llama.cpp mislabel: adding it would grow the vocab
        control = [t for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL and set(t) <= alphabet]
    else:  # Llama SentencePiece, as a byte-fallback BPE
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = ([tuple(m.split(" ")) for m in file_merges] if file_merges is not None
                  else _merges_from_vocab(vocab, dict(zip(tokens, metadata.get("tokenizer.ggml.scores") or []))))
        tok = Tokenizer(models.BPE(vocab, merges, dropout=None, fuse_unk=True, byte_fallback=True))
        prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                     split=False)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
        named = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("unknown", "bos", "eos")]
        control = [tokens[i] for i in named if i is not None and 0 <= i < len(tokens)]
        control += [t for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL and t not in control]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED and t in vocab])
    tok.save(str(out_dir / "tokenizer.json"))
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, name in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"),
                      ("padding_token_id", "pad_token"), ("unknown_token_id", "unk_token")):
        idx = metadata.get(f"tokenizer.ggml.{key}")
        cfg[name] = tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None
    if metadata.get("tokenizer.chat_template"):
        cfg["chat_template"] = metadata["tokenizer.chat_template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def tokenizer_from_gguf(meta_copy: Path | None, metadata: dict[str, Any], out_dir: Path) -> None:
    """Write tokenizer files rebuilt from GGUF metadata into ``out_dir``."""
    if "tokenizer.ggml.tokens" not in metadata:
        log.warning("GGUF has no tokenizer.ggml.tokens: no tokenizer written")
        return
    if meta_copy is not None:
        tok = _transformers_gguf_tokenizer(meta_copy, metadata)
        tok.save_pretrained(str(out_dir))
    else:
        builtin_tokenizer_from_gguf(metadata, out_dir)


def _transformers_gguf_tokenizer(meta_copy: Path, metadata: dict[str, Any]):
    """The tokenizer ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` builds, without its config
    step (which re-parses the whole vocabulary with gguf-py's slow reader: ~20 s for 152k tokens).

    Same class choice as ``AutoTokenizer`` for a directory with no tokenizer_config.json: the model
    type's registered tokenizer class, else ``TokenizersBackend``; the class then builds the tokenizer
    from the file with transformers' GGUF converters (``get_gguf_tokenizer`` / ``convert_gguf_tokenizer``).
    """
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    architecture = metadata.get("general.architecture")
    model_type = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(architecture, architecture)
    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    cls = tokenizer_class_from_name(name) if isinstance(name, str) else None
    if cls is None:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as cls
    return cls.from_pretrained(str(meta_copy.parent), gguf_file=meta_copy.name)


def generation_config_from_gguf(metadata: dict[str, Any]) -> dict[str, Any]:
    gen: dict[str, Any] = {}
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in metadata:
            gen[name] = int(metadata[f"tokenizer.ggml.{key}"])
    return gen


# ------------------------------------------------------------------------------------------ HF side files
def copy_hf_side_files(src_dir: Path, out_dir: Path) -> list[str]:
    """Copy tokenizer files, generation_config.json and a stored source GGUF metadata copy from a Hugging
    Face directory."""
    import shutil

    copied = []
    for fname in SIDE_FILES:
        p = src_dir / fname
        if p.is_file():
            shutil.copyfile(p, out_dir / fname)
            copied.append(fname)
    return copied


def scratch_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="ternary_rs-meta-")
