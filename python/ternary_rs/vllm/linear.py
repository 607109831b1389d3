"""``TernaryLinearMethod``: vLLM linear method for canonical ternary weights.

Checkpoint tensors of a ternary linear ``<prefix>`` (``W[N, K]``, ``N`` = out_features):

* ``qweight`` — ``uint8 [N, K/4]``, code ``t + 1`` packed four per byte along K (LSB first);
* ``scales``  — ``float16 [N, K/g]``.

Both are registered as vLLM parameter classes with ``output_dim=0`` / ``input_dim=1``, so vLLM's own
v2 weight loader shards them: column-parallel and fused layers (``qkv_proj``, ``gate_up_proj``) take
row slices along N, row-parallel layers take column slices along K (a K shard must be a multiple of
``lcm(4, g)`` so that it holds whole bytes and whole groups — checked in ``create_weights``).

After loading, ``ternary_rs.ops.prepare_weight`` permutes the tensors once into the layout of the
kernel of the target device (opaque here); ``apply`` calls ``torch.ops.ternary_rs.ternary_linear``.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

from .. import ops as ternary_ops  # registers torch.ops.ternary_rs.*
from .config import CODES_PER_BYTE, TernaryConfig, k_shard_multiple


def check_partition(prefix: str, in_features: int, out_features: int, full_in: int, group_size: int, tp_size: int):
    """Refuse shard shapes the canonical layout cannot express (whole bytes, whole groups along K)."""
    multiple = k_shard_multiple(group_size)
    if in_features % multiple:
        what = (
            f"a row-parallel K shard of {in_features} (K = {full_in} split over tensor_parallel_size={tp_size})"
            if in_features != full_in
            else f"in_features = {in_features}"
        )
        raise ValueError(
            f"ternary layer {prefix!r}: {what} is not a multiple of lcm(4, group_size={group_size}) = {multiple}; "
            "use a tensor-parallel size that splits K at group boundaries"
        )
    if out_features <= 0:
        raise ValueError(f"ternary layer {prefix!r}: out_features must be positive, got {out_features}")


def create_ternary_parameters(layer, out_features: int, in_features: int, group_size: int, weight_loader):
    """Register ``qweight`` (uint8 [N, K/4]) and ``scales`` (fp16 [N, K/g]) on ``layer``."""
    qweight = PackedvLLMParameter(
        data=torch.empty(out_features, in_features // CODES_PER_BYTE, dtype=torch.uint8),
        input_dim=1,
        output_dim=0,
        packed_dim=1,
        packed_factor=CODES_PER_BYTE,
        weight_loader=weight_loader,
    )
    scales = GroupQuantScaleParameter(
        data=torch.empty(out_features, in_features // group_size, dtype=torch.float16),
        input_dim=1,
        output_dim=0,
        weight_loader=weight_loader,
    )
    layer.register_parameter("qweight", qweight)
    layer.register_parameter("scales", scales)


def validate_loaded(prefix: str, qweight: torch.Tensor, scales: torch.Tensor, locate=None) -> None:
    """Reject code 3 and non-finite scales (the contract's invalid values) with the first bad index.

    ``locate()``, called only on failure, says where in the checkpoint the bad values are (file, tensor).
    """
    where = (lambda: f"; in the checkpoint: {locate()}") if locate is not None else (lambda: "")
    # Code 3 = both bits of a 2-bit field set.
    bad_codes = (qweight & (qweight >> 1) & 0x55) != 0
    if bool(bad_codes.any()):
        row, col = (int(v) for v in bad_codes.nonzero()[0])
        raise ValueError(
            f"ternary layer {prefix!r}: qweight holds the invalid code 3 (first at byte [{row}, {col}] of this "
            f"rank's shard, {int(bad_codes.sum())} bytes affected){where()}"
        )
    bad_scales = ~torch.isfinite(scales)
    if bool(bad_scales.any()):
        row, col = (int(v) for v in bad_scales.nonzero()[0])
        raise ValueError(
            f"ternary layer {prefix!r}: scales hold NaN/Inf (first at [{row}, {col}] of this rank's shard, "
            f"{int(bad_scales.sum())} values){where()}"
        )


class TernaryMethodBase:
    """What ``TernaryLinearMethod`` and ``TernaryEmbeddingMethod`` share: the canonical parameters, the
    layer attributes and the kernel call (mixed in ahead of vLLM's method base class)."""

    def __init__(self, quant_config: TernaryConfig, prefix: str = "") -> None:
        self.quant_config = quant_config
        self.prefix = prefix

    def _tp_size(self, layer: torch.nn.Module) -> int:
        """Tensor-parallel size named in a refused K shard."""
        return int(getattr(layer, "tp_size", 1))

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        g = self.quant_config.group_size
        out_features = sum(output_partition_sizes)
        check_partition(self.prefix, input_size_per_partition, out_features, input_size, g, self._tp_size(layer))
        create_ternary_parameters(
            layer, out_features, input_size_per_partition, g, extra_weight_attrs.get("weight_loader")
        )
        layer.ternary_out_features = out_features
        layer.ternary_in_features = input_size_per_partition
        layer.ternary_group_size = g
        layer.ternary_input_transform = None

    def _ternary_linear(
        self, layer: torch.nn.Module, x: torch.Tensor, qweight_k: torch.Tensor, scales_k: torch.Tensor, bias
    ) -> torch.Tensor:
        """``transform(x) @ W.T (+ bias)`` with ``W`` in the kernel layout ``qweight_k``/``scales_k``."""
        transform = layer.ternary_input_transform
        if transform is not None:
            x = transform(x)
        return torch.ops.ternary_rs.ternary_linear(
            x,
            qweight_k,
            scales_k,
            layer.ternary_out_features,
            layer.ternary_in_features,
            layer.ternary_group_size,
            bias,
        )


@register_weight_loader_v2_supported_method
class TernaryLinearMethod(TernaryMethodBase, LinearMethodBase):
    """Linear method: ``y = transform(x) @ W.T (+ bias)`` with ternary ``W``."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        validate_loaded(self.prefix, layer.qweight.data, layer.scales.data,
                        lambda: self.quant_config.locate_invalid(self.prefix))
        qweight_k, scales_k = ternary_ops.prepare_weight(layer.qweight.data, layer.scales.data, layer.ternary_group_size)
        # Kernel layout replaces the canonical tensors (no second copy kept).
        layer.qweight = torch.nn.Parameter(qweight_k, requires_grad=False)
        layer.scales = torch.nn.Parameter(scales_k, requires_grad=False)
        layer.ternary_input_transform = self.quant_config.get_input_transform(self.prefix, layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._ternary_linear(layer, x, layer.qweight, layer.scales, bias)
