"""Hugging Face <-> GGUF metadata: config.json, tokenizer and generation config.

GGUF -> HF prefers transformers' own GGUF integration (``AutoConfig`` / ``AutoTokenizer`` with
``gguf_file=``), run on a *metadata-only copy* of the GGUF (same key/value bytes, zero tensors), so
transformers never touches tensor data (it could not decode PQ2_0/PTQ1_0, and would be slow). What its
mapping misses is filled per architecture (``config_fixups_from_gguf``: e.g. Qwen3's ``head_dim``).
Without transformers/torch a built-in mapping is used (config keys below, gpt2-BPE tokenizers only).

HF -> GGUF builds the keys with gguf-py's ``GGUFWriter`` methods and ``SpecialVocab`` (the code
``convert_hf_to_gguf.py`` uses), following ``get_vocab_base`` / ``_set_vocab_gpt2`` for the vocabulary.
"""

from __future__ import annotations

import json
import logging
import struct
import tempfile
from pathlib import Path
from typing import Any

from ._core import FormatError, UnsupportedTypeError

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


# ------------------------------------------------------------------------------------------ GGUF -> HF
def _gguf_kv_spans(blob: memoryview, path: str) -> tuple[int, list[tuple[str, int, int]]]:
    """``(version, [(key, start, end)])``: byte span of every key/value pair of a little-endian GGUF."""
    if bytes(blob[:4]) != _GGUF_MAGIC:
        raise FormatError(f"{path}: not a GGUF file (magic {bytes(blob[:4])!r} at byte 0)")
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


# The big tokenizer arrays: transformers' config reader parses them slowly and the config needs none.
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                    "tokenizer.ggml.scores")


def _transformers_available() -> bool:
    try:
        import torch  # noqa: F401  (transformers' GGUF loader requires it)
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def builtin_config_from_gguf(metadata: dict[str, Any], arch) -> dict[str, Any]:
    """Config keys straight from llama.cpp metadata (no transformers): the dense-decoder subset."""
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
        "max_position_embeddings": int(g("context_length", 2048)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "vocab_size": int(g("vocab_size", len(tokens) if isinstance(tokens, list) else 0)),
        "hidden_act": "silu",
    }
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
    """``(config dict, path of the metadata-only GGUF copy or None)``."""
    meta_copy = None
    alias = getattr(arch, "transformers_gguf_alias", None)
    if use_transformers and _transformers_available() and alias is not None:
        # transformers cannot read this architecture: its tokenizer from the metadata presented as ``alias``'s
        # (tokenizer keys do not depend on the architecture), its config from the built-in mapping.
        meta_copy = workdir / "metadata-only.gguf"
        write_metadata_only_gguf(gguf_path, meta_copy, rename_arch=(arch.gguf_arch, alias))
        config = builtin_config_from_gguf(metadata, arch)
    elif use_transformers and _transformers_available():
        from transformers import AutoConfig

        meta_copy = workdir / "metadata-only.gguf"
        write_metadata_only_gguf(gguf_path, meta_copy)
        config_copy = workdir / "config-only.gguf"
        write_metadata_only_gguf(gguf_path, config_copy, drop_keys=TOKENIZER_ARRAYS)
        hf_config = AutoConfig.from_pretrained(str(workdir), gguf_file=config_copy.name)
        config = hf_config.to_dict()
        config.pop("_name_or_path", None)
        config.pop("transformers_version", None)
        a = arch.gguf_arch
        tokens = metadata.get("tokenizer.ggml.tokens")
        if f"{a}.vocab_size" in metadata:
            config["vocab_size"] = int(metadata[f"{a}.vocab_size"])
        elif isinstance(tokens, list):  # what transformers does when the arch has no vocab_size key
            config["vocab_size"] = len(tokens)
    else:
        config = builtin_config_from_gguf(metadata, arch)
    arch.config_fixups_from_gguf(config, metadata)
    _shortest_f32_floats(config)
    config["architectures"] = [arch.hf_architectures[0]]
    # transformers decides tying from the tensor list, which the metadata-only copy does not have.
    config["tie_word_embeddings"] = "output.weight" not in set(tensor_names)
    config["dtype"] = dtype
    return config, meta_copy


def _builtin_tokenizer_from_gguf(metadata: dict[str, Any], out_dir: Path) -> None:
    """A gpt2 byte-level BPE ``tokenizer.json`` from ``tokenizer.ggml.*`` using only ``tokenizers``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise UnsupportedTypeError(
            f"rebuilding a {metadata.get('tokenizer.ggml.model')!r} tokenizer needs transformers; "
            "only gpt2 byte-level BPE is built in")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
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
        _builtin_tokenizer_from_gguf(metadata, out_dir)


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


# ------------------------------------------------------------------------------------------ HF -> GGUF
def _looks_special(token: str) -> bool:
    # convert_hf_to_gguf.py's TextModel.does_token_look_special
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _tokenizer_pre(hf_dir: Path, arch) -> str:
    """``tokenizer.ggml.pre`` for the pre-tokenizer in ``tokenizer.json``."""
    try:
        pre = json.loads((hf_dir / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return arch.default_tokenizer_pre
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # GPT-2's regex inside ByteLevel
    if pre.get("type") == "Sequence":
        splits = [p for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
        if splits:
            regex = (splits[0].get("pattern") or {}).get("Regex")
            try:
                from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
            except ImportError:
                GGUF_PRE_TOKENIZER_SPLITS = {}
            for name in ("qwen2", "llama-bpe", "qwen35", "gpt-4o", "tekken"):
                if GGUF_PRE_TOKENIZER_SPLITS.get(name) == regex:
                    return name
    log.warning("unrecognised pre-tokenizer in %s/tokenizer.json; writing tokenizer.ggml.pre=%r",
                hf_dir, arch.default_tokenizer_pre)
    return arch.default_tokenizer_pre


def vocab_from_hf(hf_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens and token types as ``convert_hf_to_gguf.py``'s ``get_vocab_base`` lists them."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    reverse_vocab = {i: t for t, i in tokenizer.get_vocab().items()}
    added_vocab = tokenizer.get_added_vocab()
    added_decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse_vocab:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        token = reverse_vocab[i]
        if token in added_vocab:
            if not added_decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if added_decoder[i].special or _looks_special(token):
                types.append(int(gguf.TokenType.CONTROL))
            else:
                token = token.replace("\u2581", " ")
                types.append(int(gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
        tokens.append(token)
    return tokens, types


def gguf_metadata_from_hf(hf_dir: Path, config: dict[str, Any], arch, file_type: int | None,
                          name: str | None = None) -> list[tuple[str, Any, Any, Any]]:
    """``[(key, value, GGUFValueType, array element type or None)]`` for a GGUF of this HF model."""
    import gguf

    tok_json = hf_dir / "tokenizer.json"
    if not tok_json.exists():
        raise UnsupportedTypeError(f"{hf_dir}: no tokenizer.json; GGUF output needs a fast (BPE) tokenizer")
    model = json.loads(tok_json.read_text()).get("model", {})
    if model.get("type") != "BPE":
        raise UnsupportedTypeError(
            f"{tok_json}: tokenizer model {model.get('type')!r}; GGUF output supports byte-level BPE (gpt2) only")
    w = gguf.GGUFWriter(None, arch.gguf_arch)
    if name:
        w.add_name(name)
    arch.gguf_hparams(w, config)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types = vocab_from_hf(hf_dir, int(config["vocab_size"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_tokenizer_pre(hf_dir, arch))
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(str(hf_dir), load_merges=True, n_vocab=len(tokens))
    special.add_to_gguf(w, quiet=True)
    return [(k, v.value, v.type, v.sub_type) for k, v in w.kv_data[0].items()]


def copy_hf_side_files(src_dir: Path, out_dir: Path) -> list[str]:
    """Copy tokenizer files and generation_config.json from a Hugging Face directory."""
    import shutil

    copied = []
    for fname in TOKENIZER_FILES + (GENERATION_CONFIG,):
        p = src_dir / fname
        if p.is_file():
            shutil.copyfile(p, out_dir / fname)
            copied.append(fname)
    return copied


def scratch_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="ternary_rs-meta-")
