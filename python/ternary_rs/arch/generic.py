"""Decoder-only architectures without a hand-written module, mapped through transformers' own GGUF tables.

transformers loads llama.cpp GGUFs itself (``from_pretrained(..., gguf_file=...)``) from three tables, which
this module reuses instead of repeating them per architecture:

* ``transformers.integrations.ggml.GGUF_CONFIG_MAPPING`` — llama.cpp metadata key -> config.json key, per
  architecture. config.json is the model class's config built from the keys the table maps; what it does not
  map takes the class's defaults, as it does in transformers (the keys left out are logged);
* ``transformers.modeling_gguf_pytorch_utils.get_gguf_hf_weights_map`` — pairs every parameter of the Hugging
  Face model (built from that config on the meta device: no memory, no weights) with its llama.cpp name from
  gguf-py's ``get_tensor_name_map``, the table llama.cpp's converter names tensors from;
* ``TENSOR_PROCESSORS`` — per architecture, what undoes llama.cpp's changes to a tensor's values (Gemma's
  ``norm + 1``, Bloom's fused-QKV row order, Llama's q/k rotary permutation).

Float tensors go through the processor exactly as transformers runs it. A packed ternary tensor cannot (its
values would have to be decoded and re-ternarized), so the processor is first run on a *probe* — a matrix
holding each element's own index — to learn what it does: nothing, a reordering of whole rows (applied to the
packed rows and their scales, which is lossless), or an element-wise ``a·x + b`` (norm offsets, on float
tensors only). Anything else is refused for a ternary tensor, naming it. The same probe gives the inverse
for GGUF output (a checkpoint converted from a GGUF goes back with the source's own metadata keys).

Embeddings and ``lm_head`` are never ternarized from dense values here: whether vLLM builds them with the
quantization config differs per vLLM model class (a packed ternary one in the source stays ternary).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import numpy as np

from .._core import UnsupportedTypeError

log = logging.getLogger("ternary_rs.convert")

# transformers reads these llama.cpp architectures under other table keys (``load_gguf_checkpoint``'s
# ``updated_architecture``) and names their text models differently (``get_gguf_hf_weights_map``): code, not
# tables, in transformers, so repeated here.
_TABLE_KEYS = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
# Table sections that are not architectures.
_NOT_ARCHITECTURES = ("general", "tokenizer")
# A processor that needs the real row width (e.g. Bloom's QKV reshape) is probed at full size up to this many
# elements; beyond it the tensor is refused rather than probed with gigabytes.
MAX_FULL_PROBE = 1 << 24

SAME, ROWS, AFFINE, OTHER = "same", "rows", "affine", "other"


def _require_transformers():
    try:
        import torch  # noqa: F401  (transformers' GGUF tables and the meta-device model need it)
        import transformers  # noqa: F401
    except ImportError as e:
        raise UnsupportedTypeError(
            f"architectures without a hand-written module convert through transformers' GGUF tables, "
            f"which need torch and transformers ({e})") from None


def _config_table() -> dict[str, dict[str, Any]]:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return GGUF_CONFIG_MAPPING


def _causal_lm_class(model_type: str) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def _dense(model_type: str) -> bool:
    """Whether the model class has no routed experts (the generic path splits no stacked expert tensors)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # some default configs warn about their own default token ids
    try:
        cfg = AutoConfig.for_model(model_type)
    finally:
        hf_logging.set_verbosity(verbosity)
    return not any(getattr(cfg, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def _table_key(gguf_arch: str) -> str:
    return _TABLE_KEYS.get(gguf_arch, gguf_arch)


def _model_type(table_key: str) -> str:
    return _TEXT_MODEL_TYPES.get(table_key, table_key)


def _gguf_arch_of_model_type(model_type: str) -> str:
    table_key = {v: k for k, v in _TEXT_MODEL_TYPES.items()}.get(model_type, model_type)
    return {v: k for k, v in _TABLE_KEYS.items()}.get(table_key, table_key)


def describes(gguf_arch: str) -> bool:
    """Whether transformers' tables describe llama.cpp architecture ``gguf_arch`` (gguf-py's name) as a dense
    decoder-only model: a config table, a causal LM class, no experts."""
    import gguf

    key = _table_key(gguf_arch)
    return (key not in _NOT_ARCHITECTURES and key in _config_table()
            and gguf_arch in gguf.MODEL_ARCH_NAMES.values()
            and _causal_lm_class(_model_type(key)) is not None and _dense(_model_type(key)))


@lru_cache(maxsize=1)
def known_gguf_architectures() -> tuple[str, ...]:
    """Every architecture :func:`describes` (for messages: it imports each one's config class, seconds)."""
    _require_transformers()
    names = ({v: k for k, v in _TABLE_KEYS.items()}.get(key, key) for key in _config_table())
    return tuple(sorted(name for name in names if describes(name)))


def known_model_types() -> list[str]:
    """config.json ``model_type`` values of those architectures."""
    return sorted(_model_type(_table_key(a)) for a in known_gguf_architectures())


def for_gguf(architecture: str, metadata: dict[str, Any], tensor_names) -> GenericDecoderArch:
    """The generic arch for a GGUF of ``architecture`` (``general.architecture``), its config from ``metadata``
    through transformers' table; refused naming what is supported when the tables do not know it."""
    _require_transformers()
    from transformers import AutoConfig

    model_type = _model_type(_table_key(architecture))
    tensor_names = set(tensor_names)
    stacked = sorted(n for n in tensor_names if n.endswith(("_exps.weight", "_exps.bias")))
    if stacked:
        raise UnsupportedTypeError(
            f"GGUF architecture {architecture!r}: expert-stacked tensors ({stacked[0]}, …: a mixture of experts) "
            "need a hand-written module; the generic conversion handles dense decoder-only models")
    if not describes(architecture):
        raise UnsupportedTypeError(
            f"GGUF architecture {architecture!r} is not supported for conversion: no hand-written module handles "
            f"it and transformers' GGUF tables do not describe it as a dense decoder-only model (they do: "
            f"{', '.join(known_gguf_architectures())})")
    layout = metadata.get(f"{architecture}.tensor_data_layout")
    if layout is not None:  # e.g. Falcon's fused QKV regrouped ("jploski"): no processor undoes it
        raise UnsupportedTypeError(
            f"GGUF architecture {architecture!r}: llama.cpp rearranged its tensors (tensor_data_layout {layout!r}) "
            "in a way transformers' GGUF tables do not undo; not supported")
    table_config = _config_from_metadata(architecture, metadata)
    # llama.cpp writes output.weight only when it is not the embedding matrix
    table_config["tie_word_embeddings"] = "output.weight" not in tensor_names
    cfg = AutoConfig.for_model(model_type, **table_config)
    key_length = metadata.get(f"{architecture}.attention.key_length")
    if key_length is not None and hasattr(cfg, "head_dim") and getattr(cfg, "head_dim", None) != int(key_length):
        cfg.head_dim = int(key_length)  # llama.cpp states it; some tables do not map it
    return GenericDecoderArch(architecture, cfg, table_config)


def for_config(config: dict[str, Any]) -> GenericDecoderArch:
    """The generic arch for a Hugging Face ``config.json`` whose ``model_type`` transformers' GGUF tables know."""
    _require_transformers()
    from transformers import AutoConfig

    model_type = str(config.get("model_type"))
    gguf_arch = _gguf_arch_of_model_type(model_type)
    if not describes(gguf_arch) or model_type != _model_type(_table_key(gguf_arch)):
        raise UnsupportedTypeError(
            f"config.json model_type {config.get('model_type')!r} / architectures {config.get('architectures')!r} is "
            f"not supported for conversion: no hand-written module handles it and transformers' GGUF tables do not "
            f"describe it as a dense decoder-only model (they do: {', '.join(known_model_types())})")
    clean = {k: v for k, v in config.items() if k not in ("quantization_config", "model_type")}
    cfg = AutoConfig.for_model(model_type, **clean)
    return GenericDecoderArch(gguf_arch, cfg, dict(config))


def _config_from_metadata(architecture: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """config.json keys from llama.cpp metadata by transformers' table (``load_gguf_checkpoint``'s loop)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING

    table = _config_table()
    table_key = _table_key(architecture)
    config: dict[str, Any] = {}
    unmapped = []
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        section = table[table_key] if prefix == architecture else table.get(prefix) if prefix == "tokenizer" else None
        if section is None:
            continue
        target = section.get(rest, -1)
        if target == -1 and prefix == architecture:
            unmapped.append(key)
        if target is None or target == -1:
            continue
        config[target] = value
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(table_key, {}).items():
        config.setdefault(key, value)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config.setdefault(key, None)  # absent from the file: the tokenizer has none (not the class's default)
    tokens = metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and isinstance(tokens, list):
        config["vocab_size"] = len(tokens)
    if unmapped:
        log.info("GGUF keys transformers' %s table does not map (config.json takes the model class's defaults "
                 "instead): %s", table_key, ", ".join(sorted(unmapped)))
    return config


def _probe_effect(process, gguf_name: str, shape: tuple[int, ...]):
    """What ``process(values, name)`` (a transformers tensor processor) does to a tensor of ``shape``:
    ``(SAME, None)``, ``(ROWS, p)`` with ``out = in[p]``, ``(AFFINE, (a, b))`` with ``out = a·in + b``, or
    ``(OTHER, reason)``. The probe holds each element's index + 1 (exact in float64); three columns stand for
    the row width unless the processor needs the real one."""
    n = int(shape[0])
    widths: list[int | None] = [None]
    if len(shape) == 2:
        k = int(shape[1])
        widths = [min(k, 3)] + ([k] if k > 3 and n * k <= MAX_FULL_PROBE else [])
    out = error = None
    for width in widths:
        x = np.arange(1, n * (width or 1) + 1, dtype=np.float64).reshape((n,) if width is None else (n, width))
        try:
            out = process(x.copy(), gguf_name)
            break
        except Exception as e:  # noqa: BLE001 - e.g. a reshape that needs the real width: try that
            error = e
    if out is None:
        return OTHER, f"transformers' processor fails on it ({error})"
    y, name = np.asarray(out[0]), out[1]
    if name != gguf_name:
        return OTHER, "transformers' processor renames or merges it"
    if y.shape != x.shape:
        return OTHER, f"transformers' processor reshapes it ({x.shape} -> {y.shape})"
    if np.array_equal(y, x):
        return SAME, None
    rows = (y.reshape(n, -1)[:, 0] - 1) // x.reshape(n, -1).shape[1]
    if rows.min() >= 0 and rows.max() < n and np.array_equal(y, x[rows.astype(np.int64)]):
        return ROWS, rows.astype(np.int64)
    a = y.flat[1] - y.flat[0] if y.size > 1 else 1.0
    b = y.flat[0] - a * x.flat[0]
    if a != 0 and np.array_equal(y, a * x + b):
        return AFFINE, (float(a), float(b))
    return OTHER, "transformers' processor changes its values"


def _to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> raw little-endian bytes of ``dtype`` (F32 / F16 / BF16, round to nearest even)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "F32":
        return values.view(np.uint8).reshape(-1)
    if dtype == "F16":
        return values.astype(np.float16).view(np.uint8).reshape(-1)
    if dtype == "BF16":
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return rounded.view(np.uint8).reshape(-1)
    raise UnsupportedTypeError(f"float type {dtype} (supported: F32, F16, BF16)")


class GenericDecoderArch:
    """One decoder-only model (its config bound), mapped by transformers' GGUF tables; see the module doc and
    :mod:`ternary_rs.arch` for the contract."""

    generic = True
    default_tokenizer_pre = "gpt-2"
    gguf_vocab = "gpt2"
    write_vllm_checkpoint = None  # the generic dense writer in ternary_rs.convert

    def __init__(self, gguf_arch: str, hf_config, table_config: dict[str, Any]):
        self.gguf_arch = gguf_arch
        self.hf_config = hf_config
        self.hf_model_types = (hf_config.model_type,)
        self.hf_architectures = (_causal_lm_class(hf_config.model_type),)
        # The dict transformers hands its tensor processors (table keys, or config.json's).
        self._processor_config = table_config
        self._model = None
        self._to_hf: dict[str, str] | None = None
        self._effects: dict[str, tuple[str, Any]] = {}

    def __repr__(self) -> str:
        return f"GenericDecoderArch({self.gguf_arch!r}, {self.hf_architectures[0]})"

    # ---------------------------------------------------------------- the model, on the meta device
    def _meta_model(self):
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                self._model = AutoModelForCausalLM.from_config(self.hf_config)
        return self._model

    def _processor(self):
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        return TENSOR_PROCESSORS.get(self.gguf_arch, TensorProcessor)(config=self._processor_config)

    def _name_map(self) -> dict[str, str]:
        """GGUF name -> Hugging Face name, as transformers' GGUF loader pairs them."""
        if self._to_hf is None:
            from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

            try:
                self._to_hf = dict(get_gguf_hf_weights_map(self._meta_model(), self._processor(),
                                                           model_type=self.gguf_arch))
            except NotImplementedError as e:  # gguf-py does not know the architecture
                raise UnsupportedTypeError(f"{self.gguf_arch}: no llama.cpp tensor names ({e})") from None
        return self._to_hf

    # ---------------------------------------------------------------- names
    @staticmethod
    def n_blocks_from_gguf(metadata: dict[str, Any], arch: str) -> int:
        return int(metadata[f"{arch}.block_count"])

    def hf_name(self, gguf_name: str, n_blocks: int) -> str | None:
        hf = self._name_map().get(gguf_name)
        if hf is None:
            raise KeyError(f"GGUF tensor {gguf_name!r} has no {self.hf_architectures[0]} counterpart in transformers' "
                           f"GGUF tables (architecture {self.gguf_arch!r})")
        return hf

    def gguf_name(self, hf_name: str, n_blocks: int) -> str | None:
        reverse = getattr(self, "_to_gguf", None)
        if reverse is None:
            reverse = self._to_gguf = {hf: g for g, hf in self._name_map().items()}
        return reverse.get(hf_name)

    def ternary_candidate(self, hf_name: str, shape: tuple[int, ...]) -> bool:
        """A dense weight may be stored ternary when it is a ``torch.nn.Linear`` of the model (not lm_head)."""
        linears = getattr(self, "_linears", None)
        if linears is None:
            import torch

            model = self._meta_model()
            out_emb = model.get_output_embeddings()
            linears = self._linears = {f"{name}.weight" for name, m in model.named_modules()
                                       if isinstance(m, torch.nn.Linear) and m is not out_emb}
        return len(shape) == 2 and hf_name in linears

    # ---------------------------------------------------------------- what the tensor processor does
    def _effect(self, hf_name: str, shape: tuple[int, ...]) -> tuple[str, Any]:
        gguf_name = self.gguf_name(hf_name, 0)
        if gguf_name is None or not shape:
            return SAME, None
        key = f"{gguf_name}{tuple(shape)}"
        if key not in self._effects:
            processor = self._processor()

            def process(values, name):
                result = processor.process(weights=values, name=name, tensor_key_mapping={},
                                           parsed_parameters={"tensors": {}})
                return result.weights, result.name

            self._effects[key] = _probe_effect(process, gguf_name, tuple(shape))
        return self._effects[key]

    def _row_permutation(self, hf_name: str, n_rows: int) -> np.ndarray | None:
        """``p`` with ``hf_rows = gguf_rows[p]`` for a tensor of ``n_rows`` rows; raises for a processor that does
        more than reorder rows (only called for ternary tensors and identity/row effects)."""
        kind, detail = self._effect(hf_name, self._shape_hint(hf_name, n_rows))
        if kind == SAME:
            return None
        if kind == ROWS:
            return detail
        raise UnsupportedTypeError(
            f"tensor {self.gguf_name(hf_name, 0)} ({hf_name}): transformers' {self.gguf_arch} GGUF loader changes its "
            f"values ({detail if kind == OTHER else f'x -> {detail[0]:g}·x + {detail[1]:g}'}), which a ternary tensor cannot take "
            "without re-ternarizing it")

    def _shape_hint(self, hf_name: str, n_rows: int) -> tuple[int, ...]:
        """The tensor's shape from the model (rows_from_gguf only gets its row count)."""
        shapes = getattr(self, "_param_shapes", None)
        if shapes is None:
            shapes = self._param_shapes = {name: tuple(int(d) for d in p.shape) for name, p in
                                           self._meta_model().named_parameters(remove_duplicate=False)}
        shape = shapes.get(hf_name, (n_rows, 3))
        return (n_rows,) if len(shape) == 1 else (n_rows, shape[1])

    def rows_from_gguf(self, hf_name: str, config: dict[str, Any], n_rows: int) -> np.ndarray | None:
        return self._row_permutation(hf_name, n_rows)

    def rows_to_gguf(self, hf_name: str, config: dict[str, Any], n_rows: int) -> np.ndarray | None:
        p = self._row_permutation(hf_name, n_rows)
        return None if p is None else np.argsort(p)

    def values_from_gguf(self, hf_name: str, raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """A float tensor's bytes after transformers' processor (same dtype and shape), or None: unchanged."""
        from ..core.formats import float_view

        kind, _ = self._effect(hf_name, tuple(shape))
        if kind == SAME:
            return None
        processor = self._processor()
        values = float_view(raw, dtype).reshape(shape)
        out = processor.process(weights=values.copy(), name=self.gguf_name(hf_name, 0), tensor_key_mapping={},
                                parsed_parameters={"tensors": {}}).weights
        if np.shape(out) != tuple(shape):
            raise UnsupportedTypeError(f"tensor {self.gguf_name(hf_name, 0)} ({hf_name}): transformers' processor "
                                       f"reshapes it to {np.shape(out)}; not supported")
        return _to_dtype(out, dtype)

    def values_to_gguf(self, hf_name: str, raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The inverse of :meth:`values_from_gguf` (GGUF output), or None: unchanged. Row reorders and
        ``a·x + b`` invert exactly; any other processor effect is refused."""
        from ..core.formats import float_view

        kind, detail = self._effect(hf_name, tuple(shape))
        if kind == SAME:
            return None
        values = float_view(raw, dtype).reshape(shape)
        if kind == ROWS:
            return _to_dtype(values[np.argsort(detail)], dtype)
        if kind == AFFINE:
            a, b = detail
            return _to_dtype((values.astype(np.float32) - np.float32(b)) / np.float32(a), dtype)
        raise UnsupportedTypeError(f"tensor {hf_name}: transformers' {self.gguf_arch} processor ({detail}) has no "
                                   "inverse here; it cannot be written to GGUF")

    # ---------------------------------------------------------------- config / metadata
    def config_from_gguf_metadata(self, metadata: dict[str, Any], tensor_names) -> dict[str, Any]:
        """config.json: every key of the model class's config, the GGUF's stated through transformers' table."""
        config = self.hf_config.to_dict()
        for private in ("_name_or_path", "transformers_version"):
            config.pop(private, None)
        config["architectures"] = [self.hf_architectures[0]]
        return config

    def config_fixups_from_gguf(self, config: dict[str, Any], metadata: dict[str, Any]) -> None:
        return None  # the table and the config class did it

    def gguf_hparams(self, writer, config: dict[str, Any]) -> None:
        raise UnsupportedTypeError(
            f"GGUF output of {self.hf_architectures[0]} from Hugging Face files: llama.cpp's converter writes "
            f"hyper-parameter keys per architecture that no table lists (only the hand-written architectures "
            f"have them). A checkpoint converted from a {self.gguf_arch!r} GGUF converts back (it keeps the "
            "source's keys); otherwise use llama.cpp's convert_hf_to_gguf.py --outtype tq2_0")

    def gguf_extra_tensors(self, config: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
        return []
