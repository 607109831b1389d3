"""``TernaryMoEMethod``: vLLM fused-MoE method for ternary routed experts (``Qwen3MoeForCausalLM``,
``Qwen2MoeForCausalLM``: its shared expert is an ordinary ternary MLP that vLLM's runner calls itself).

Checkpoint tensors: every expert ``E`` of a MoE layer ``<p>`` (``model.layers.N.mlp.experts``) is three
ordinary ternary linears, ``<p>.E.{gate,up,down}_proj.{qweight,scales}`` (docs/checkpoint.md); vLLM's
``RoutedExperts`` loader hands them over one by one with ``shard_id`` w1 (gate), w3 (up), w2 (down).

Parameters (the canonical layout with a leading expert dimension, ``I`` = this rank's intermediate size):

* ``w13_qweight uint8 [E, 2I, H/4]`` / ``w13_scales fp16 [E, 2I, H/g]`` — gate rows then up rows;
  column-parallel: each rank takes its slice of ``I`` (rows), K = H is never split;
* ``w2_qweight uint8 [E, H, I/4]`` / ``w2_scales fp16 [E, H, I/g2]`` — row-parallel: each rank takes its
  slice of K = I. As for a row-parallel linear, a K shard that splits checkpoint groups is served at
  ``g2 = gcd(g, I)`` (scales repeated while loading: lossless) and one that is not a multiple of 32 is
  refused naming the layer and the TP sizes that work (``linear.load_group_size``).

vLLM's own loader shards them (``quant_method = "group"`` marks the scales); only the scale repeat is ours.
After loading, codes and scales are checked (code 3, NaN/Inf: the first bad expert named), then each
expert is permuted once by ``ops.prepare_weight`` and stacked, replacing the canonical tensors.

``apply`` is one call of ``torch.ops.ternary_rs.ternary_moe`` (see ``ternary_rs/ops.py``): the router's
top-k weights and ids in, this rank's partial sum out (vLLM's runner all-reduces it over TP ranks, and runs
the shared experts, if any, as ordinary linears). Refused with a clear error: a CUDA device (the grouped
GEMM is designed, not built), expert parallelism, expert biases, an activation other than SiLU-and-mul,
and Hadamard-rotated checkpoints.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

from ..serving import ops as ternary_ops  # registers torch.ops.ternary_rs.*
from .linear import load_group_size, validate_loaded
from .params import CODES_PER_BYTE

# RoutedExperts.weight_loader treats a parameter with this quant_method as group-wise scales.
_GROUP_SCALES = "group"


def refuse_unsupported(prefix: str, moe) -> None:
    """What this method cannot serve, refused before any weight is allocated."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.platforms import current_platform

    where = f"ternary MoE layer {prefix!r}"
    if not current_platform.is_cpu():
        raise NotImplementedError(
            f"{where}: ternary routed experts run on CPU only in this version (the CUDA grouped GEMM of "
            "torch.ops.ternary_rs.ternary_moe is designed, not built: see ternary_rs/ops.py); serve this "
            "model with vLLM CPU")
    if moe.moe_parallel_config.use_ep:
        raise NotImplementedError(f"{where}: expert parallelism is not supported; use tensor parallelism "
                                  "(--tensor-parallel-size without --enable-expert-parallel)")
    if moe.has_bias:
        raise NotImplementedError(f"{where}: experts with biases are not supported")
    if moe.activation != MoEActivation.SILU:
        raise NotImplementedError(f"{where}: activation {moe.activation.value!r} is not supported (SiLU-and-mul "
                                  "only, as Qwen3-MoE uses)")


class TernaryMoEMethod(FusedMoEMethodBase):
    """Routed ternary experts: ``y = Σ_k w_k · down_e(silu(gate_e(x)) · up_e(x))`` through one op."""

    # quant_config: the checkpoint's TernaryConfig (typed by its vLLM base: the config module imports this one)
    def __init__(self, quant_config: QuantizationConfig, moe, prefix: str = "") -> None:
        super().__init__(moe)
        refuse_unsupported(prefix, moe)
        self.quant_config = quant_config
        self.prefix = prefix

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
        # Packed codes cannot be padded like dense weights: serve the sizes the checkpoint has.
        return hidden_size, intermediate_size_per_partition

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        g = self.quant_config.group_size
        inter, full_inter = intermediate_size_per_partition, self.moe.intermediate_size
        tp = self.moe.tp_size
        # gate/up: K = hidden, whole on every rank; down: K = this rank's slice of the intermediate size.
        g13 = load_group_size(f"{self.prefix} (gate_proj/up_proj)", hidden_size, 2 * inter, hidden_size, g, tp)
        g2 = load_group_size(f"{self.prefix} (down_proj)", inter, hidden_size, full_inter, g, tp)
        loader = extra_weight_attrs["weight_loader"]
        shapes = {
            "w13_qweight": ((num_experts, 2 * inter, hidden_size // CODES_PER_BYTE), torch.uint8, loader),
            "w13_scales": ((num_experts, 2 * inter, hidden_size // g13), torch.float16, loader),
            "w2_qweight": ((num_experts, hidden_size, inter // CODES_PER_BYTE), torch.uint8, loader),
            "w2_scales": ((num_experts, hidden_size, inter // g2), torch.float16, _regrouping_loader(loader, g // g2)),
        }
        for name, (shape, dtype, weight_loader) in shapes.items():
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {"weight_loader": weight_loader, "quant_method": _GROUP_SCALES})
        layer.ternary_hidden_size = hidden_size
        layer.ternary_intermediate_size = inter
        layer.ternary_w13_group_size = g13
        layer.ternary_w2_group_size = g2
        layer.ternary_activations = ternary_ops.AUTO

    def process_weights_after_loading(self, layer) -> None:
        for stem, parts in (("w13", "gate_proj/up_proj"), ("w2", "down_proj")):
            qweight, scales = getattr(layer, f"{stem}_qweight").data, getattr(layer, f"{stem}_scales").data
            self._validate(layer, stem, parts, qweight, scales)
            group = getattr(layer, f"ternary_{stem}_group_size")
            codes, prepared_scales = ternary_ops.prepare_stacked(qweight, scales, group)
            # Kernel layout replaces the canonical tensors (no second copy kept).
            setattr(layer, f"{stem}_qweight", torch.nn.Parameter(codes, requires_grad=False))
            setattr(layer, f"{stem}_scales", torch.nn.Parameter(prepared_scales, requires_grad=False))

    def _validate(self, layer, stem: str, parts: str, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        """Code 3 and NaN/Inf scales refused, naming the first bad expert (checked whole first: cheap)."""
        if not bool(((qweight & (qweight >> 1) & 0x55) != 0).any()) and bool(torch.isfinite(scales).all()):
            return
        names = [layer.ckpt_down_proj_name] if stem == "w2" else [layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name]
        for e in range(qweight.shape[0]):
            ckpt = [f"{self.prefix}.{e}.{n}" for n in names]
            validate_loaded(f"{self.prefix} expert {e} ({parts})", qweight[e], scales[e],
                            lambda ckpt=ckpt: self.quant_config.locate_invalid_parts(ckpt))

    def get_fused_moe_quant_config(self, layer):
        return None  # no modular kernel: apply() calls the op directly

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        # Shared experts (if any) are run by vLLM's runner itself: this method never overlaps them.
        return torch.ops.ternary_rs.ternary_moe(
            x, topk_weights, topk_ids, layer.w13_qweight, layer.w13_scales, layer.w2_qweight, layer.w2_scales,
            layer.ternary_intermediate_size, layer.ternary_w13_group_size, layer.ternary_w2_group_size,
            layer.ternary_activations, layer.apply_router_weight_on_input)


def _regrouping_loader(weight_loader, repeat: int):
    """``weight_loader`` for down_proj scales served at a finer group than the checkpoint's: each checkpoint
    scale repeated ``repeat`` times along K before vLLM takes this rank's slice (exact: same values)."""
    if repeat == 1:
        return weight_loader

    def load(param, loaded_weight, *args, **kwargs):
        return weight_loader(param, loaded_weight.repeat_interleave(repeat, dim=-1), *args, **kwargs)

    load.supports_moe_loading = True  # type: ignore[attr-defined]  (as RoutedExperts.weight_loader)
    return load
