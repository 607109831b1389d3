"""``TernaryConfig``: vLLM quantization config for checkpoints with ``quant_method: "ternary"``.

Reads the ``quantization_config`` block of ``config.json`` (checkpoint contract, docs/checkpoint.md#checkpoint-contract) and decides,
per layer, which quant method serves it:

* a linear layer whose checkpoint tensors are ``<prefix>.qweight`` / ``<prefix>.scales`` gets
  :class:`~ternary_rs.vllm.linear.TernaryLinearMethod`;
* ``embed_tokens`` / ``lm_head`` stored that way get :class:`~ternary_rs.vllm.embedding.TernaryEmbeddingMethod`
  (a tied ``lm_head`` follows ``embed_tokens``);
* a fused-MoE layer (vLLM's ``RoutedExperts``, prefix ``<p>``) whose experts are stored as
  ``<p>.E.{gate,up,down}_proj.qweight``/``.scales`` gets :class:`~ternary_rs.vllm.moe.TernaryMoEMethod`
  (all experts ternary, or all dense: a mix, or a missing expert, is refused naming the layer);
* everything listed in ``modules_not_converted``, or stored as a plain ``<prefix>.weight``, stays dense.

Which prefixes are ternary is read from the safetensors headers once (``maybe_update_config``), so a
checkpoint that keeps some linears dense loads without listing them. Unknown keys of
``quantization_config`` are kept in :attr:`TernaryConfig.extra` (the Bonsai 2 ``"hadamard"`` entry is
one of them, see :meth:`TernaryConfig.get_input_transform`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

from .. import _core
from . import preflight
from .params import SUPPORTED_GROUP_SIZES

QUANT_METHOD = "ternary"
SUPPORTED_FORMAT_VERSIONS = (1,)
SUPPORTED_SCALE_DTYPES = ("float16",)
_WHERE = f"ternary quantization_config ({preflight.CONFIG_FILE})"
_KNOWN_KEYS = {"quant_method", "format_version", "group_size", "scale_dtype", "modules_not_converted"}


class TernaryConfig(QuantizationConfig):
    """Ternary weights (codes 2 bits along K, one fp16 scale per ``group_size`` inputs)."""

    def __init__(
        self,
        group_size: int,
        modules_not_converted: list[str] | None = None,
        format_version: int = 1,
        scale_dtype: str = "float16",
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if format_version not in SUPPORTED_FORMAT_VERSIONS:
            raise ValueError(
                f"{_WHERE}: format_version {format_version!r} is not supported "
                f"(this ternary_rs reads {SUPPORTED_FORMAT_VERSIONS}); upgrade ternary_rs"
            )
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(
                f"{_WHERE}: group_size {group_size!r} is not one of {SUPPORTED_GROUP_SIZES}"
            )
        if scale_dtype not in SUPPORTED_SCALE_DTYPES:
            raise ValueError(
                f"{_WHERE}: scale_dtype {scale_dtype!r} is not one of {SUPPORTED_SCALE_DTYPES}"
            )
        self.group_size = group_size
        self.format_version = format_version
        self.scale_dtype = scale_dtype
        self.modules_not_converted = list(modules_not_converted or [])
        self.extra = dict(extra or {})
        # Bonsai 2 rotation description, passed as-is to ternary_rs.vllm.hadamard; parsed here once so
        # that an entry this version cannot honour is refused before any weight is loaded.
        self.hadamard = self.extra.get("hadamard")
        if self.hadamard is not None:
            validate = getattr(self._hadamard_module(), "spec_index", None)
            if validate is not None:
                try:
                    validate(self.hadamard)
                except _core.ValidationError as e:
                    raise _core.ValidationError(f"{_WHERE}: 'hadamard' entry refused: {e}") from None
        # The local checkpoint's tensors (preflight.read_checkpoint), and vLLM name -> checkpoint name.
        self.checkpoint: preflight.CheckpointTensors | None = None
        self.checkpoint_names: dict[str, str] = {}
        # Filled from the safetensors headers by maybe_update_config (checkpoint names, vLLM-mapped).
        self.ternary_prefixes: set[str] = set()
        self.dense_prefixes: set[str] = set()
        self.tie_word_embeddings = False

    def __repr__(self) -> str:
        return (
            f"TernaryConfig(group_size={self.group_size}, format_version={self.format_version}, "
            f"modules_not_converted={self.modules_not_converted}, extra_keys={sorted(self.extra)})"
        )

    # ---- QuantizationConfig interface -------------------------------------------------------------
    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # cuda/ is built for sm_89 and sm_90 (+ compute_90 PTX): Ada and newer. CPU has no capability check.
        return 89

    @staticmethod
    def get_config_filenames() -> list[str]:
        # Everything is in config.json's quantization_config.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TernaryConfig:
        method = str(config.get("quant_method", "")).lower()
        if method != QUANT_METHOD:
            raise ValueError(f"{_WHERE}: quant_method is {method!r}, expected 'ternary'")
        group_size = cls.get_from_keys(config, ["group_size"])
        return cls(
            group_size=int(group_size),
            modules_not_converted=cls.get_from_keys_or(config, ["modules_not_converted"], []) or [],
            format_version=int(cls.get_from_keys_or(config, ["format_version"], 1)),
            scale_dtype=str(cls.get_from_keys_or(config, ["scale_dtype"], "float16")),
            extra={k: v for k, v in config.items() if k not in _KNOWN_KEYS},
        )

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Learn from the safetensors headers which prefixes are ternary and which are dense; refuse a local
        checkpoint with malformed shards or qweight/scales tensors (preflight) before any weight loads."""
        from vllm.transformers_utils.config import get_safetensors_params_metadata

        self.checkpoint = preflight.read_checkpoint(model_name)
        if self.checkpoint is not None:
            preflight.check_ternary_tensors(self.checkpoint, self.group_size)
            self.checkpoint_names = {n: n for n in self.checkpoint.tensors}

        if hf_config is not None:
            text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
            self.tie_word_embeddings = bool(getattr(text_config, "tie_word_embeddings", False))
        metadata = get_safetensors_params_metadata(model_name, revision=revision)
        for name in metadata:
            if name.endswith(".qweight"):
                self.ternary_prefixes.add(name[: -len(".qweight")])
            elif name.endswith(".weight"):
                self.dense_prefixes.add(name[: -len(".weight")])

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        self.modules_not_converted = hf_to_vllm_mapper.apply_list(self.modules_not_converted)
        self.ternary_prefixes = set(hf_to_vllm_mapper.apply_list(sorted(self.ternary_prefixes)))
        self.dense_prefixes = set(hf_to_vllm_mapper.apply_list(sorted(self.dense_prefixes)))
        self.checkpoint_names = hf_to_vllm_mapper.apply_dict(self.checkpoint_names)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        from .dense import DenseEmbeddingMethod, DenseLinearMethod
        from .embedding import TernaryEmbeddingMethod
        from .gdn_decode import install_cpu_gdn_decode
        from .gdn_prefill import install_cpu_gdn_prefill
        from .linear import TernaryLinearMethod
        from .warm_up import install_cpu_warm_up_pass

        install_cpu_warm_up_pass()
        install_cpu_gdn_prefill()
        install_cpu_gdn_decode()
        if isinstance(layer, ParallelLMHead):
            # A tied lm_head has no tensors of its own: it is whatever embed_tokens is.
            ternary = self._embedding_is_ternary() if self.tie_word_embeddings else self._is_ternary(prefix)
            return TernaryEmbeddingMethod(self, prefix) if ternary else self._dense(prefix, DenseEmbeddingMethod())
        if isinstance(layer, VocabParallelEmbedding):
            # Some vLLM models (Llama's) build embed_tokens without a prefix: find it by its checkpoint name.
            if self._is_ternary(prefix) if prefix else self._embedding_is_ternary():
                return TernaryEmbeddingMethod(self, prefix)
            return self._dense(prefix, DenseEmbeddingMethod())
        if isinstance(layer, LinearBase):
            if self._is_ternary(prefix):
                return TernaryLinearMethod(self, prefix)
            return self._dense(prefix, DenseLinearMethod())
        if isinstance(layer, RoutedExperts):
            from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

            from .moe import TernaryMoEMethod

            if self._experts_are_ternary(prefix, layer):
                if self.hadamard is not None:
                    raise ValueError(f"ternary checkpoint: MoE layer {prefix!r}: Hadamard-rotated experts are not "
                                     "supported")
                return TernaryMoEMethod(self, layer.moe_config, prefix)
            return self._dense(prefix, UnquantizedFusedMoEMethod(layer.moe_config))
        return None

    def _dense(self, prefix: str, method: QuantizeMethodBase) -> QuantizeMethodBase:
        """A dense layer must not be one the Hadamard rotation lists (its transform would be dropped)."""
        if self.hadamard is not None:
            self._hadamard_module().refuse_dense(self.hadamard, prefix)
        return method

    # ---- layer classification ---------------------------------------------------------------------
    def _shard_prefixes(self, prefix: str) -> list[str]:
        """Checkpoint prefixes behind a (possibly fused) vLLM layer: qkv_proj -> q_proj, k_proj, v_proj."""
        head, _, proj = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(proj)
        if not parts:
            return [prefix]
        return [f"{head}.{p}" if head else p for p in parts]

    def _is_ternary(self, prefix: str) -> bool:
        if self.modules_not_converted and is_layer_skipped(
            prefix, self.modules_not_converted, self.packed_modules_mapping, match_mode="suffix"
        ):
            return False
        kinds = set()
        for shard in self._shard_prefixes(prefix):
            if shard in self.ternary_prefixes:
                kinds.add("ternary")
            elif shard in self.dense_prefixes:
                kinds.add("dense")
        if kinds == {"ternary", "dense"}:
            raise ValueError(
                f"ternary checkpoint: fused layer {prefix!r} mixes ternary and dense parts "
                f"({self._shard_prefixes(prefix)}); vLLM needs one format per fused layer"
            )
        known = self.ternary_prefixes | self.dense_prefixes
        missing = [p for p in self._shard_prefixes(prefix) if p not in known]
        if missing and known and kinds != {"dense"}:
            # Headers were read and this layer (or part of a fused one) has no tensors: vLLM would
            # serve whatever memory the parameter was allocated with.
            where = self.checkpoint.directory if self.checkpoint is not None else "the checkpoint"
            raise ValueError(
                f"ternary checkpoint {where}: layer {prefix!r} has no tensors for {missing} (expected "
                f"'<p>.qweight' + '<p>.scales', or a dense '<p>.weight' listed in modules_not_converted)"
            )
        # No header information (e.g. a remote repository without metadata): the contract default.
        return kinds != {"dense"}

    def _experts_are_ternary(self, prefix: str, layer: torch.nn.Module) -> bool:
        """Whether every routed expert of MoE layer ``prefix`` is stored ternary (``<prefix>.E.<proj>``,
        ``<proj>`` the layer's checkpoint names); all dense is served dense, anything between is refused."""
        projections = [n for n in (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name) if n]
        parts = [f"{prefix}.{e}.{p}" for e in range(layer.moe_config.num_logical_experts) for p in projections]
        skipped = [p for p in parts if self.modules_not_converted and is_layer_skipped(
            p, self.modules_not_converted, self.packed_modules_mapping, match_mode="suffix")]
        ternary = [p for p in parts if p in self.ternary_prefixes and p not in skipped]
        dense = [p for p in parts if p in self.dense_prefixes or p in skipped]
        if ternary and dense:
            raise ValueError(
                f"ternary checkpoint: MoE layer {prefix!r} mixes ternary experts ({ternary[0]}, …) and dense ones "
                f"({dense[0]}, …); vLLM serves one format per MoE layer")
        if not (self.ternary_prefixes or self.dense_prefixes):
            return not dense  # no header information: the contract default
        missing = [p for p in parts if p not in ternary and p not in dense]
        if missing:
            # vLLM would serve whatever memory the expert parameters were allocated with.
            where = self.checkpoint.directory if self.checkpoint is not None else "the checkpoint"
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ValueError(
                f"ternary checkpoint {where}: MoE layer {prefix!r} has no tensors for {missing[:3]}{more} (expected "
                f"'<p>.qweight' + '<p>.scales' for each of its {layer.moe_config.num_logical_experts} experts' "
                f"{'/'.join(projections)})")
        return bool(ternary)

    def _embedding_is_ternary(self) -> bool:
        names = self.ternary_prefixes | self.dense_prefixes
        embed = [n for n in names if n.endswith("embed_tokens")]
        if not embed:
            return not any(m.endswith("embed_tokens") for m in self.modules_not_converted)
        return all(self._is_ternary(n) for n in embed)

    def locate_invalid(self, prefix: str) -> str:
        """Where layer ``prefix``'s invalid values (code 3, NaN/Inf scales) are: file, tensor, index."""
        return self.locate_invalid_parts(self._shard_prefixes(prefix))

    def locate_invalid_parts(self, parts: list[str]) -> str:
        """Where the invalid values of the checkpoint prefixes ``parts`` are (one MoE expert's projections)."""
        return preflight.locate_invalid(self.checkpoint, self.checkpoint_names, parts)

    # ---- Bonsai 2 Hadamard hook (implemented by ternary_rs.vllm.hadamard) ------------------------
    def _hadamard_module(self):
        try:
            from . import hadamard
        except ImportError as e:  # only hadamard checkpoints need it
            raise ValueError(
                "this ternary checkpoint has a 'hadamard' quantization_config entry (Bonsai 2 rotation) "
                f"but ternary_rs.vllm.hadamard cannot be imported: {e}"
            ) from e
        return hadamard

    def get_input_transform(self, prefix: str, layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Activation transform applied before the ternary matmul of ``prefix`` (None: identity)."""
        if self.hadamard is None:
            return None
        tp_rank, tp_size = _layer_tp(layer)
        return self._hadamard_module().make_input_transform(self.hadamard, prefix, layer, tp_rank, tp_size)

    def get_embedding_transform(self, prefix: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Transform applied to looked-up embedding rows of ``prefix`` (None: identity)."""
        if self.hadamard is None:
            return None
        return self._hadamard_module().make_embedding_transform(self.hadamard, prefix)


def _layer_tp(layer: torch.nn.Module) -> tuple[int, int]:
    """TP rank/size the layer was sharded with (layers built with disable_tp report 0/1)."""
    if hasattr(layer, "tp_rank") and hasattr(layer, "tp_size"):
        return int(layer.tp_rank), int(layer.tp_size)
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
