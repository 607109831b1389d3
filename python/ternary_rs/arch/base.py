"""Shared machinery for dense decoder-only architectures (llama, qwen3 and kin).

Naming comes from gguf-py's own tables (``gguf.get_tensor_name_map``), so a GGUF name is exactly what
llama.cpp's ``convert_hf_to_gguf.py`` would write for the Hugging Face name. The reverse map is built
from the same forward map, restricted to the Hugging Face names this architecture really uses (the
forward table knows names from dozens of model families, so it alone would be ambiguous backwards).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from .rope import ROPE_FREQS_TENSOR, add_rope_keys

# GGUF tensors llama.cpp derives from hyper-parameters: they have no Hugging Face weight to map to.
DERIVED_GGUF_TENSORS = (ROPE_FREQS_TENSOR,)
DERIVED_GGUF_SUFFIXES = (".attn_rot_embd.weight",)

# Hugging Face suffixes of the weights a Bonsai-style ternary checkpoint stores as ternary.
LINEAR_SUFFIXES = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
    "gate_proj.weight", "up_proj.weight", "down_proj.weight",
)
EMBEDDING_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


class DenseDecoderArch:
    """A llama-shaped decoder: embeddings, ``n`` blocks of attention + gated MLP, final norm, lm_head.

    Subclasses set the class attributes; see :mod:`ternary_rs.arch` for the registry contract.
    """

    gguf_arch: str = ""
    hf_model_types: tuple[str, ...] = ()
    hf_architectures: tuple[str, ...] = ()
    # Hugging Face tensor names; ``{bid}`` is the block index.
    hf_global_names: tuple[str, ...] = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    hf_block_names: tuple[str, ...] = (
        "model.layers.{bid}.input_layernorm.weight",
        "model.layers.{bid}.post_attention_layernorm.weight",
        "model.layers.{bid}.self_attn.q_proj.weight",
        "model.layers.{bid}.self_attn.k_proj.weight",
        "model.layers.{bid}.self_attn.v_proj.weight",
        "model.layers.{bid}.self_attn.o_proj.weight",
        "model.layers.{bid}.self_attn.q_proj.bias",
        "model.layers.{bid}.self_attn.k_proj.bias",
        "model.layers.{bid}.self_attn.v_proj.bias",
        "model.layers.{bid}.self_attn.o_proj.bias",
        "model.layers.{bid}.mlp.gate_proj.weight",
        "model.layers.{bid}.mlp.up_proj.weight",
        "model.layers.{bid}.mlp.down_proj.weight",
    )
    # tokenizer.ggml.pre to write when the tokenizer's pre-tokenizer is not recognised.
    default_tokenizer_pre: str = "gpt-2"
    # GGUF vocabulary writer (a key of ternary_rs.sinks.gguf_metadata.VOCAB_WRITERS): the order in which the
    # architecture's llama.cpp converter class tries tokenizer.model / tokenizer.json.
    gguf_vocab: str = "gpt2"
    write_vllm_checkpoint = None  # dense decoders use the generic writer in ternary_rs.convert

    # ---------------------------------------------------------------- names
    def _gguf_model_arch(self):
        import gguf

        for arch_enum, name in gguf.MODEL_ARCH_NAMES.items():
            if name == self.gguf_arch:
                return arch_enum
        raise KeyError(f"gguf-py does not know the architecture {self.gguf_arch!r}")

    @lru_cache(maxsize=8)  # noqa: B019 - one map per (arch, block count); arches are singletons
    def _name_maps(self, n_blocks: int) -> tuple[dict[str, str], dict[str, str]]:
        import gguf

        tmap = gguf.get_tensor_name_map(self._gguf_model_arch(), n_blocks)
        hf_names = list(self.hf_global_names)
        for bid in range(n_blocks):
            hf_names += [t.format(bid=bid) for t in self.hf_block_names]
        to_gguf: dict[str, str] = {}
        for hf in hf_names:
            g = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
            if g is None:
                raise RuntimeError(f"gguf-py's {self.gguf_arch} tensor map has no entry for {hf}")
            to_gguf[hf] = g
        from_gguf = {g: hf for hf, g in to_gguf.items()}
        if len(from_gguf) != len(to_gguf):
            raise RuntimeError(f"{self.gguf_arch}: two Hugging Face names map to one GGUF name")
        return to_gguf, from_gguf

    def gguf_name(self, hf_name: str, n_blocks: int) -> str | None:
        """llama.cpp's name for a Hugging Face tensor name (None: not part of this architecture)."""
        return self._name_maps(n_blocks)[0].get(hf_name)

    def hf_name(self, gguf_name: str, n_blocks: int) -> str | None:
        """The Hugging Face name for a llama.cpp tensor name (None: no HF weight, e.g. rope_freqs)."""
        if gguf_name in DERIVED_GGUF_TENSORS or gguf_name.endswith(DERIVED_GGUF_SUFFIXES):
            return None
        hf = self._name_maps(n_blocks)[1].get(gguf_name)
        if hf is None:
            raise KeyError(f"GGUF tensor {gguf_name!r} is not a known {self.gguf_arch} tensor")
        return hf

    def ternary_candidate(self, hf_name: str, shape: tuple[int, ...]) -> bool:
        """Whether a float tensor of this name may be stored as ternary (if its values are ternary)."""
        return len(shape) == 2 and (hf_name.endswith(LINEAR_SUFFIXES) or hf_name in EMBEDDING_NAMES)

    # ---------------------------------------------------------------- row permutations
    def rows_from_gguf(self, hf_name: str, config: dict[str, Any], n_rows: int) -> np.ndarray | None:
        """Index array ``p`` with ``hf_rows = gguf_rows[p]`` (None: no permutation)."""
        return None

    def rows_to_gguf(self, hf_name: str, config: dict[str, Any], n_rows: int) -> np.ndarray | None:
        """Index array ``p`` with ``gguf_rows = hf_rows[p]`` (None: no permutation)."""
        return None

    # ---------------------------------------------------------------- config / metadata
    @staticmethod
    def n_blocks_from_gguf(metadata: dict[str, Any], arch: str) -> int:
        return int(metadata[f"{arch}.block_count"])

    def config_fixups_from_gguf(self, config: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Fill what transformers' GGUF config mapping leaves out for this architecture."""
        a = self.gguf_arch
        if f"{a}.attention.key_length" in metadata:
            config["head_dim"] = int(metadata[f"{a}.attention.key_length"])

    def gguf_hparams(self, writer, config: dict[str, Any]) -> None:
        """Add llama.cpp's hyper-parameter keys for ``config`` to a ``gguf.GGUFWriter`` (as
        ``convert_hf_to_gguf.py``'s ``TextModel.set_gguf_parameters`` does, rope scaling included)."""
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        writer.add_block_count(int(config["num_hidden_layers"]))
        if config.get("max_position_embeddings") is not None:
            writer.add_context_length(int(config["max_position_embeddings"]))
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_head_count(heads)
        writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
        add_rope_keys(writer, config)
        writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)

    def gguf_extra_tensors(self, config: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
        """Tensors llama.cpp's converter derives from the config (``generate_extra_tensors``), as
        ``(GGUF name, float32 array)``; written before the weights, as upstream writes them."""
        return []


def llama_qk_permutation(n_rows: int, n_head: int) -> np.ndarray:
    """Row order llama.cpp writes q/k in: ``convert_hf_to_gguf.py``'s ``LlamaModel.permute``

    ``w.reshape(n_head, 2, n_rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)``
    is a pure row gather; this returns the gathered indices ``p`` (``gguf = hf[p]``). Rows only, so it
    applies to packed ternary rows and their scale rows alike (groups never cross rows).
    """
    if n_head <= 0 or n_rows % (2 * n_head):
        raise ValueError(f"cannot permute {n_rows} rows for {n_head} heads (need a multiple of {2 * n_head})")
    half = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(-1)
