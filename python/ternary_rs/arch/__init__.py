"""Architecture registry used by ``ternary_rs.convert``.

``ARCHES`` maps a GGUF ``general.architecture`` name to a hand-written *arch object*. ``convert`` picks one with
:func:`arch_for_gguf` (GGUF sources) or :func:`arch_for_config` (``config.json`` ``model_type`` /
``architectures``). Dense llama-shaped decoders subclass :class:`ternary_rs.arch.base.DenseDecoderArch`
and only set names; see ``llama.py`` and ``qwen3.py``. Any other dense decoder-only architecture that
transformers' GGUF tables describe gets a :class:`ternary_rs.arch.generic.GenericDecoderArch` bound to the
source's config (built per source, not registered). A hand-written module is for what those tables do not
give (GGUF output from Hugging Face files, conversion without transformers, Bonsai 2's rotation, BitNet's
sub-norms …; docs/formats.md, "Architectures").

An arch object provides (attributes / methods):

``gguf_arch: str``
    the GGUF ``general.architecture`` value (also the registry key).
``hf_model_types: tuple[str, ...]``, ``hf_architectures: tuple[str, ...]``
    ``config.json`` ``model_type`` values and ``architectures`` class names it handles.
``hf_name(gguf_name, n_blocks) -> str | None`` / ``gguf_name(hf_name, n_blocks) -> str | None``
    tensor name maps (``None``: a tensor with no counterpart, e.g. llama.cpp's derived ``rope_freqs``;
    ``hf_name`` raises ``KeyError`` for a name it does not know).
``ternary_candidate(hf_name, shape) -> bool``
    whether a float tensor may be stored ternary when its values are exactly ternary per group.
``rows_from_gguf(hf_name, config, n_rows)`` / ``rows_to_gguf(...)`` -> ``np.ndarray | None``
    row gathers undoing / applying llama.cpp layout permutations (llama's q/k rotary permutation).
``n_blocks_from_gguf(metadata, arch) -> int``
``config_fixups_from_gguf(config: dict, metadata: dict) -> None``
    fill what transformers' GGUF config mapping misses (e.g. ``head_dim`` from ``key_length``).
``gguf_hparams(writer: gguf.GGUFWriter, config: dict) -> None``
    add llama.cpp's hyper-parameter keys (GGUF output), rope scaling included (``arch.rope``).
``gguf_extra_tensors(config: dict) -> list[tuple[str, np.ndarray]]``
    tensors llama.cpp's converter derives from the config (llama's ``rope_freqs`` for a llama3 rope).
``default_tokenizer_pre: str``
    ``tokenizer.ggml.pre`` used when the Hugging Face pre-tokenizer is not recognised.
``gguf_vocab: str``
    GGUF vocabulary writer, a key of ``ternary_rs.sinks.gguf_metadata.VOCAB_WRITERS`` (``"llama"``, ``"qwen2"``,
    ``"gpt2"``): which of tokenizer.model / tokenizer.json llama.cpp's converter reads, in which order.
``write_vllm_checkpoint`` (optional; ``None`` = use the generic dense writer)
    ``write_vllm_checkpoint(src: TernaryFile, out_dir: Path, options: ConvertOptions) -> None``.
    A whole-checkpoint hook for architectures the generic writer cannot express (hybrid attention,
    fused GGUF tensors, Hadamard rotations). It writes ``config.json`` (with ``quantization_config``),
    the safetensors shards + ``model.safetensors.index.json`` (helpers in ``ternary_rs.sinks.checkpoint``:
    ``ShardPlan``, ``write_shards``, ``quantization_config``), tokenizer files and
    ``generation_config.json`` into ``out_dir``, which is a fresh *temporary* directory. ``convert``
    then writes the ``ternary_rs.json`` manifest and renames ``out_dir`` into place; on any exception the
    temporary directory is deleted. ``options`` carries ``group_size`` (``None`` = source's), ``shard_size``
    (bytes), ``threads``, ``progress`` (bool) and ``source_paths``.
``write_gguf`` (optional; absent = the generic GGUF writer)
    ``write_gguf(src: TernaryFile, out_path: Path, options: ConvertOptions) -> None``: the same kind of
    hook for ``--to gguf`` from a non-GGUF source; writes the whole file at ``out_path`` (a temporary name
    ``convert`` renames into place).

``check_source_config(config, path, options)`` (optional)
    refuse a Hugging Face source whose settings the checkpoint contract cannot carry, before converting.
``ternarize_dense(raw, dtype, shape, group_size, name)`` (optional)
    the architecture's own ternarization of a dense float linear weight (``convert(ternarize=True)``):
    a ``TernaryTensor`` at ``group_size``. Architectures without it refuse ``--ternarize``.
``expert_hf_names(hf_name, n_expert) -> list[str]`` (optional; Mixture-of-Experts architectures)
    the per-expert Hugging Face names of a stacked 3-D GGUF expert tensor (llama.cpp's ``ffn_*_exps``,
    ``[n_expert, N, K]``); ``convert`` splits such a tensor into that many 2-D weights. Architectures
    without it refuse 3-D tensors.
``config_from_gguf_metadata(metadata, tensor_names) -> dict`` (optional)
    the whole config.json for a GGUF source (the generic arch: transformers' table and config class), in place
    of the built-in llama-style mapping.
``values_from_gguf(hf_name, raw, dtype, shape)`` / ``values_to_gguf(...)`` -> ``np.ndarray | None`` (optional)
    a float tensor's bytes (same dtype and shape) with llama.cpp's value changes undone / applied (Gemma's
    norm offset); ``None``: unchanged. Used instead of ``rows_*_gguf`` for float tensors when present.
``transformers_gguf_alias: str | None`` (optional)
    a GGUF architecture whose metadata transformers' GGUF loader can read in place of this one (its
    config then comes from the built-in mapping, its tokenizer from transformers).

To add an architecture: write ``arch/<name>.py`` (``<name>`` = its GGUF ``general.architecture``) exposing
``ARCH`` and add one line to ``_MODULES``. Modules are imported on first use (``ARCHES[name]``). A module may
also expose ``ALIASES`` (arch objects for other ``general.architecture`` names of the same model family,
listed in ``_ALIASES``).
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = (
    "llama",
    "qwen3",
    "qwen35",
    "bitnet",
    "qwen3moe",
    "qwen2moe",
)
# Other GGUF ``general.architecture`` names -> the module whose ``ALIASES`` define them.
_ALIASES = {"bitnet-b1.58": "bitnet", "bitnet-25": "bitnet"}


class _Registry(dict):
    """``gguf_arch -> arch object``; an architecture's module is imported on first lookup, so that
    ``import ternary_rs`` stays light (some arches pull in torch). ``ARCHES[name]`` loads;
    ``load_all()`` loads every module in ``_MODULES`` (needed before iterating)."""

    def __missing__(self, key: str) -> Any:
        module_name = _ALIASES.get(key, key)
        if module_name in _MODULES:
            module = importlib.import_module(f"{__name__}.{module_name}")
            register(module.ARCH)
            for alias in getattr(module, "ALIASES", ()):
                register(alias)
            if dict.__contains__(self, key):
                return dict.__getitem__(self, key)
        raise KeyError(key)

    def load_all(self) -> _Registry:
        for name in _MODULES:
            if name not in self:
                self[name]  # noqa: B018 - loads it
        return self


ARCHES: dict[str, Any] = _Registry()


def register(arch: Any) -> Any:
    """Add an arch object to the registry (keyed by ``arch.gguf_arch``); returns it."""
    dict.__setitem__(ARCHES, arch.gguf_arch, arch)
    return arch


def arch_for_gguf(architecture: str, metadata: dict[str, Any] | None = None, tensor_names=()) -> Any:
    """The arch object for a GGUF ``general.architecture`` value: a hand-written one, else (given the file's
    ``metadata`` and tensor names) the generic one transformers' GGUF tables describe."""
    try:
        return ARCHES[architecture]
    except KeyError:
        pass
    ARCHES.load_all()
    from .._core import UnsupportedTypeError

    if metadata is not None:
        from .generic import for_gguf

        try:
            return for_gguf(architecture, metadata, tensor_names)
        except UnsupportedTypeError as e:
            raise UnsupportedTypeError(f"{e}; hand-written: {sorted(ARCHES)}") from None

    raise UnsupportedTypeError(
        f"GGUF architecture {architecture!r} is not supported for conversion; supported: {sorted(ARCHES)} (and, "
        "from a GGUF file, the decoder-only architectures of transformers' GGUF tables)")


def arch_for_config(config: dict[str, Any]) -> Any:
    """The arch object for a Hugging Face ``config.json`` dict (``model_type`` first, then ``architectures``)."""
    model_type = config.get("model_type")
    ARCHES.load_all()
    for arch in ARCHES.values():
        if model_type in arch.hf_model_types:
            return arch
    for cls in config.get("architectures") or ():
        for arch in ARCHES.values():
            if cls in arch.hf_architectures:
                return arch
    from .._core import UnsupportedTypeError
    from .generic import for_config

    hand_written = sorted(t for a in ARCHES.values() for t in a.hf_model_types)
    try:
        return for_config(config)
    except UnsupportedTypeError as e:
        raise UnsupportedTypeError(f"{e}; hand-written model types: {hand_written}") from None
