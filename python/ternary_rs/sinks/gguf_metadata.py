"""Key/value metadata of the GGUFs ternary_rs writes: everything llama.cpp needs besides the tensors.

Two sources, in this order:

1. **The source GGUF's own keys.** A GGUF source is copied key for key (``keys_from_gguf``). A ternary_rs
   checkpoint converted from a GGUF keeps a metadata-only copy of that GGUF (``SOURCE_METADATA_FILE``,
   same key/value bytes, no tensors; written by ``keep_source_metadata``), so converting it back to GGUF
   restores the original tokenizer (scores, token types, merges, pre-tokenizer, BOS/EOS/add_bos …) and the
   ``general.*`` keys exactly (``stored_source_metadata``; used only while it agrees with ``config.json``).
2. **Rebuilt from the Hugging Face files** (``hf_metadata``) exactly the way llama.cpp's
   ``convert_hf_to_gguf.py`` does, with the same gguf-py helpers (``Metadata``, ``SpecialVocab``,
   ``LlamaHfVocab``): ``general.type`` / ``general.name`` / ``general.size_label`` … (``ModelBase.
   prepare_metadata``), the architecture's hyper-parameters, then the vocabulary: ``tokenizer.model``
   (sentencepiece: ``_set_vocab_sentencepiece``), a llama-style byte-fallback ``tokenizer.json``
   (``_set_vocab_llama_hf``) or a byte-level BPE ``tokenizer.json`` (``_set_vocab_gpt2``), tried in the
   order the architecture's llama.cpp class tries them (``arch.gguf_vocab``).

One deliberate difference: upstream picks ``tokenizer.ggml.pre`` by hashing the tokenization of a test
string against a table of published models; we read the pre-tokenizer's split regex from
``tokenizer.json`` (``tokenizer_pre``), which also recognises locally trained tokenizers.

Entries are ``(key, value, type)`` with ``type`` a ``ternary_rs.sinks.writers.GGUFWriter.add_metadata`` type name
(``"u32"``, ``"string"``, ``"array[i32]"`` …). Architectures without a dense-decoder writer (qwen35)
call ``hf_metadata`` / ``stored_source_metadata`` / ``metadata_for_gguf_output`` with their own
hyper-parameter hook.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .._core import UnsupportedTypeError
from ..sources.hf_gguf import SOURCE_GGUF_METADATA, write_metadata_only_gguf
from .checkpoint import GGUF_MARK_KEY

log = logging.getLogger("ternary_rs.convert")

Entry = tuple[str, Any, str]

# The metadata-only copy of the source GGUF kept inside a checkpoint converted from a GGUF.
SOURCE_METADATA_FILE = SOURCE_GGUF_METADATA
# Keys that describe one file rather than the model: never copied from a source.
FILE_KEYS = ("general.alignment", "general.file_type", GGUF_MARK_KEY)

# gguf-py value types -> ternary_rs.sinks.writers type names.
_IO_TYPE_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool",
                  8: "string", 10: "u64", 11: "i64", 12: "f64"}
_GGUF_ARRAY = 9

# config.json keys checked against the stored GGUF keys (``<arch>.<suffix>``) before the stored copy is
# used: a checkpoint whose model no longer matches its stored metadata gets rebuilt metadata instead.
_CONSISTENCY_KEYS = (
    ("num_hidden_layers", "block_count"),
    ("hidden_size", "embedding_length"),
    ("intermediate_size", "feed_forward_length"),
    ("num_attention_heads", "attention.head_count"),
    ("num_key_value_heads", "attention.head_count_kv"),
)


# ------------------------------------------------------------------------------------------ GGUF sources
def keys_from_gguf(metadata: dict[str, Any], types: dict[str, str], file_type: int | None) -> list[Entry]:
    """A source GGUF's keys with their types, minus the per-file ones, plus ``general.file_type``."""
    out = [(k, v, types[k]) for k, v in metadata.items() if k not in FILE_KEYS]
    if file_type is not None:
        out.append(("general.file_type", int(file_type), "u32"))
    return out


def keep_source_metadata(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Store a metadata-only copy of ``gguf_path`` in the checkpoint folder ``out_dir``."""
    dst = Path(out_dir) / SOURCE_METADATA_FILE
    write_metadata_only_gguf(gguf_path, dst, drop_keys=(GGUF_MARK_KEY,))
    return dst


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config


def stored_source_metadata(ckpt_dir: str | Path, config: dict[str, Any], gguf_arch: str,
                           file_type: int | None) -> list[Entry] | None:
    """The keys of the GGUF a checkpoint was converted from (``None``: no stored copy, or one that no
    longer matches ``config.json``; a mismatch is logged)."""
    from ..sources.reader import open as open_checkpoint

    path = Path(ckpt_dir) / SOURCE_METADATA_FILE
    if not path.is_file():
        return None
    with open_checkpoint(path) as f:
        metadata, types = dict(f.metadata), dict(f.metadata_types)
    cfg = _text_config(config)
    problems = []
    if metadata.get("general.architecture") != gguf_arch:
        problems.append(f"general.architecture {metadata.get('general.architecture')!r} != {gguf_arch!r}")
    for cfg_key, suffix in _CONSISTENCY_KEYS:
        key = f"{gguf_arch}.{suffix}"
        stored, want = metadata.get(key), cfg.get(cfg_key)
        if isinstance(stored, int) and isinstance(want, int) and stored != want:  # per-layer lists: skipped
            problems.append(f"{key} = {stored} but config.json {cfg_key} = {want}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if cfg.get("vocab_size") is not None and isinstance(tokens, list) and len(tokens) != int(cfg["vocab_size"]):
        problems.append(f"{len(tokens)} tokens but config.json vocab_size = {cfg['vocab_size']}")
    if problems:
        log.warning("%s does not match %s/config.json (%s); GGUF metadata is rebuilt from the Hugging Face "
                    "files instead", path, ckpt_dir, "; ".join(problems))
        return None
    return keys_from_gguf(metadata, types, file_type)


# ------------------------------------------------------------------------------------------ HF sources
def _io_type(vtype: int, value: Any, sub_type: int | None) -> str:
    """The io type name of a gguf-py ``GGUFValue`` (array element types inferred as gguf-py infers them)."""
    import gguf

    if int(vtype) != _GGUF_ARRAY:
        return _IO_TYPE_NAMES[int(vtype)]
    if sub_type is None:
        sub_type = gguf.GGUFValueType.get_type(value[0]) if len(value) else gguf.GGUFValueType.UINT8
    if int(sub_type) == _GGUF_ARRAY:
        raise UnsupportedTypeError("nested metadata arrays are not written by the Hugging Face path")
    return f"array[{_IO_TYPE_NAMES[int(sub_type)]}]"


def _plain(value: Any) -> Any:
    """gguf-py accepts bytes tokens and IntEnum types; the io writer wants str / int."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    return value


def writer_entries(writer) -> list[Entry]:
    """The keys added to a ``gguf.GGUFWriter(None, arch)`` as ``Entry`` tuples, in order."""
    return [(k, _plain(v.value), _io_type(v.type, v.value, v.sub_type)) for k, v in writer.kv_data[0].items()]


def add_general_metadata(writer, hf_dir: Path, total_params: int) -> None:
    """``general.type``, ``general.name``, ``general.size_label``, sampling defaults, licence …: what
    ``ModelBase.prepare_metadata`` writes (model card, config.json, generation_config.json and the folder
    name, through gguf-py's ``Metadata``). ``total_params``: elements of every tensor the GGUF holds."""
    import gguf

    meta = gguf.Metadata.load(None, hf_dir, None, total_params)
    if meta.name is None:
        meta.name = hf_dir.name
    if meta.size_label is None and total_params > 0:
        meta.size_label = gguf.size_label(total_params, total_params, 0, 0)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)


def _looks_special(token: str) -> bool:
    # convert_hf_to_gguf.py's TextModel.does_token_look_special
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def tokenizer_pre(hf_dir: Path, default: str) -> str:
    """``tokenizer.ggml.pre`` for the pre-tokenizer in ``tokenizer.json`` (its split regex)."""
    try:
        pre = json.loads((hf_dir / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return default
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
    log.warning("unrecognised pre-tokenizer in %s/tokenizer.json; writing tokenizer.ggml.pre=%r", hf_dir, default)
    return default


def vocab_base(hf_dir: Path, config: dict[str, Any]) -> tuple[list[str], list[int]]:
    """Tokens and token types as ``convert_hf_to_gguf.py``'s ``get_vocab_base`` lists them."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    vocab = tokenizer.get_vocab()
    vocab_size = int(_text_config(config).get("vocab_size") or len(vocab))
    if max(vocab.values()) >= vocab_size:
        raise UnsupportedTypeError(f"{hf_dir}: tokenizer has token id {max(vocab.values())} but config.json "
                                   f"vocab_size is {vocab_size}")
    reverse_vocab = {i: t for t, i in vocab.items()}
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
            # llama.cpp assumes CONTROL / USER_DEFINED tokens are pre-normalized
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


def set_vocab_gpt2(writer, hf_dir: Path, config: dict[str, Any], default_pre: str) -> None:
    """Byte-level BPE from ``tokenizer.json`` (``TextModel._set_vocab_gpt2``)."""
    import gguf

    tokens, types = vocab_base(hf_dir, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre(hf_dir, default_pre))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(str(hf_dir), load_merges=True).add_to_gguf(writer, quiet=True)


def sentencepiece_vocab(hf_dir: Path, config: dict[str, Any]) -> tuple[list[bytes], list[float], list[int]]:
    """Tokens, scores and types from ``tokenizer.model`` (+ ``added_tokens.json`` and
    ``tokenizer_config.json``'s ``added_tokens_decoder``): ``TextModel._create_vocab_sentencepiece``."""
    from sentencepiece import SentencePieceProcessor

    # SentencePieceTokenTypes in convert_hf_to_gguf.py (== gguf.TokenType)
    normal, unknown, control, user_defined, unused, byte = 1, 2, 3, 4, 5, 6
    path = hf_dir / "tokenizer.model"
    if not path.is_file():
        raise FileNotFoundError(f"File not found: {path}")
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(path))
    cfg = _text_config(config)
    vocab_size = cfg.get("vocab_size_per_layer_input") or cfg.get("vocab_size") or sp.vocab_size()
    tokens: list[bytes] = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores: list[float] = [-10000.0] * vocab_size
    types: list[int] = [unused] * vocab_size
    for i in range(sp.vocab_size()):
        if i >= vocab_size:
            log.warning("%s: ignoring tokens from id %d on (config.json vocab_size %d)", path, i, vocab_size)
            break
        kind = normal
        if sp.IsUnknown(i):
            kind = unknown
        elif sp.IsControl(i):
            kind = control
        elif sp.IsUnused(i):
            kind = unused
        elif sp.IsByte(i):
            kind = byte
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), kind
    added = hf_dir / "added_tokens.json"
    if added.is_file():
        for key, i in json.loads(added.read_text(encoding="utf-8")).items():
            if i < vocab_size:
                tokens[i], scores[i], types[i] = key.encode("utf-8"), -1000.0, user_defined
    tok_cfg = hf_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        decoder = json.loads(tok_cfg.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
        for key, data in decoder.items():
            i, token = int(key), data["content"]
            if i >= vocab_size:
                continue
            if data.get("special") or _looks_special(token):
                types[i] = control
            else:
                token = token.replace("\u2581", " ")
                types[i] = user_defined
            scores[i], tokens[i] = -1000.0, token.encode("utf-8")
    return tokens, scores, types


def _add_llama_vocab(writer, hf_dir: Path, tokens: list, scores: list, types: list) -> None:
    """The keys both llama-style vocabularies write (``tokenizer.ggml.model`` llama, pre ``default``) and
    the special tokens from ``hf_dir``."""
    import gguf

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(str(hf_dir), n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def set_vocab_sentencepiece(writer, hf_dir: Path, config: dict[str, Any]) -> None:
    """``TextModel._set_vocab_sentencepiece`` (raises FileNotFoundError without ``tokenizer.model``)."""
    tokens, scores, types = sentencepiece_vocab(hf_dir, config)
    _add_llama_vocab(writer, hf_dir, tokens, scores, types)


def set_vocab_llama_hf(writer, hf_dir: Path, config: dict[str, Any]) -> None:
    """A llama-style byte-fallback BPE ``tokenizer.json`` (``TextModel._set_vocab_llama_hf``; raises
    FileNotFoundError / TypeError for other tokenizers, as gguf-py's ``LlamaHfVocab`` does)."""
    import gguf

    vocab = gguf.LlamaHfVocab(hf_dir)
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(int(kind))
    _add_llama_vocab(writer, hf_dir, tokens, scores, types)


def set_vocab_llama(writer, hf_dir: Path, config: dict[str, Any], default_pre: str) -> None:
    """``LlamaModel.set_vocab``: ``add_prefix_space``, then sentencepiece → llama-hf → gpt2."""
    import gguf

    tok_cfg = hf_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        add_prefix_space = json.loads(tok_cfg.read_text(encoding="utf-8")).get("add_prefix_space")
        if add_prefix_space is not None:
            writer.add_add_space_prefix(add_prefix_space)
    try:
        set_vocab_sentencepiece(writer, hf_dir, config)
    except FileNotFoundError:
        try:
            set_vocab_llama_hf(writer, hf_dir, config)
        except (FileNotFoundError, TypeError):
            set_vocab_gpt2(writer, hf_dir, config, default_pre)  # Llama 3
    vocab_size = int(_text_config(config).get("vocab_size", 32000))
    if vocab_size == 32016:  # CodeLlama's infill tokens
        special = gguf.SpecialVocab(str(hf_dir), load_merges=False,
                                    special_token_types=["prefix", "suffix", "middle", "eot"])
        for kind, token_id in (("prefix", 32007), ("suffix", 32008), ("middle", 32009), ("eot", 32010)):
            special._set_special_token(kind, token_id)
        special.add_to_gguf(writer, quiet=True)
    if vocab_size == 49152:  # granite small models
        writer.add_add_bos_token(False)


def set_vocab_qwen2(writer, hf_dir: Path, config: dict[str, Any], default_pre: str) -> None:
    """``Qwen2Model.set_vocab`` (also Qwen3): sentencepiece when there is a ``tokenizer.model``, else gpt2."""
    try:
        set_vocab_sentencepiece(writer, hf_dir, config)
    except FileNotFoundError:
        set_vocab_gpt2(writer, hf_dir, config, default_pre)


# Vocabulary writers by name (an architecture's ``gguf_vocab`` attribute).
VOCAB_WRITERS: dict[str, Callable[..., None]] = {
    "llama": set_vocab_llama,
    "qwen2": set_vocab_qwen2,
    "gpt2": set_vocab_gpt2,
}


def total_parameters(shapes: Iterable[Sequence[int]]) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        total += n
    return total


def hf_metadata(hf_dir: str | Path, config: dict[str, Any], gguf_arch: str, file_type: int | None,
                tensor_shapes: Iterable[Sequence[int]], hparams: Callable[[Any, dict[str, Any]], None],
                vocab: str = "gpt2", default_pre: str = "gpt-2") -> list[Entry]:
    """All keys ``convert_hf_to_gguf.py`` writes for this Hugging Face model, in its order: architecture,
    ``general.*``, hyper-parameters (``hparams(writer, config)``: the architecture's
    ``set_gguf_parameters``), ``general.file_type``, quantization version, vocabulary (``vocab``: a key of
    ``VOCAB_WRITERS``). ``tensor_shapes``: every tensor the GGUF will hold (for ``general.size_label``)."""
    import gguf

    hf_dir = Path(hf_dir)
    if not (hf_dir / "tokenizer.json").is_file() and not (hf_dir / "tokenizer.model").is_file():
        raise UnsupportedTypeError(f"{hf_dir}: no tokenizer.json or tokenizer.model; a GGUF needs the vocabulary")
    w = gguf.GGUFWriter(None, gguf_arch)
    add_general_metadata(w, hf_dir, total_parameters(tensor_shapes))
    hparams(w, config)
    if file_type is not None:
        w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    try:
        writer_fn = VOCAB_WRITERS[vocab]
    except KeyError:
        raise ValueError(f"unknown vocabulary writer {vocab!r}; known: {sorted(VOCAB_WRITERS)}") from None
    writer_fn(w, hf_dir, config, default_pre)
    return writer_entries(w)


def metadata_for_gguf_output(src_dir: str | Path, config: dict[str, Any], arch, file_type: int | None,
                             tensor_shapes: Iterable[Sequence[int]]) -> list[Entry]:
    """The keys for a GGUF written from a Hugging Face / ternary_rs directory: the stored source GGUF's
    keys when the checkpoint came from a GGUF and still matches them, else rebuilt (``hf_metadata``)."""
    stored = stored_source_metadata(src_dir, config, arch.gguf_arch, file_type)
    if stored is not None:
        return stored
    return hf_metadata(src_dir, config, arch.gguf_arch, file_type, tensor_shapes, arch.gguf_hparams,
                       vocab=arch.gguf_vocab, default_pre=arch.default_tokenizer_pre)

