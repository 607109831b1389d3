"""``TernaryLinearMethod``: vLLM linear method for canonical ternary weights.

Checkpoint tensors of a ternary linear ``<prefix>`` (``W[N, K]``, ``N`` = out_features):

* ``qweight`` — ``uint8 [N, K/4]``, code ``t + 1`` packed four per byte along K (LSB first);
* ``scales``  — ``float16 [N, K/g]``.

Both are registered as vLLM parameter classes with ``output_dim=0`` / ``input_dim=1``, so vLLM's own
v2 weight loader shards them: column-parallel and fused layers (``qkv_proj``, ``gate_up_proj``) take
row slices along N, row-parallel layers take column slices along K. A K shard that splits a checkpoint group
(e.g. group 256, K shard 128 at TP=2) is served at group ``gcd(g, K shard)``: each scale is repeated while
loading (:class:`RegroupedScaleParameter`), which is lossless; only a shard that is not a multiple of 32 is
refused (:func:`load_group_size`).

After loading, ``ternary_rs.ops.prepare_weight`` permutes the tensors once into the layout of the
kernel of the target device (opaque here); ``apply`` calls ``torch.ops.ternary_rs.ternary_linear``.

Activation numerics: ``layer.ternary_activations`` (default ``ops.AUTO``) is passed to the op; a model sets
it per layer (BitNet: ``ops.INT8_TOKEN``). Int8 per token means one scale per token over the layer's whole
K, so a row-parallel layer whose K is split over TP ranks takes the token's max|x| over all ranks
(:func:`int8_token_sharded`), and the result equals the unsharded layer's.
"""

from __future__ import annotations

import math

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

from ..serving import _ops_cpu
from ..serving import ops as ternary_ops  # registers torch.ops.ternary_rs.*
from .params import CODES_PER_BYTE, SUPPORTED_GROUP_SIZES, k_shard_multiple

# Smallest K shard a row-parallel rank may hold: the smallest group of the contract (whole bytes of codes too).
MIN_K_SHARD = min(SUPPORTED_GROUP_SIZES)


def _working_tp_sizes(full_in: int, tp_size: int) -> list[int]:
    """TP sizes below ``tp_size`` that split ``full_in`` into shards of a multiple of MIN_K_SHARD."""
    return [t for t in range(1, tp_size) if full_in % t == 0 and (full_in // t) % MIN_K_SHARD == 0]


def load_group_size(prefix: str, in_features: int, out_features: int, full_in: int, group_size: int,
                    tp_size: int) -> int:
    """The group size this rank serves ``prefix`` at: the checkpoint's ``group_size`` when the K shard holds
    whole groups, else ``gcd(group_size, K shard)`` — each scale repeated, lossless — as long as the shard
    is a multiple of MIN_K_SHARD (32). Anything else is refused, naming the layer and TP sizes that work."""
    if out_features <= 0:
        raise ValueError(f"ternary layer {prefix!r}: out_features must be positive, got {out_features}")
    if in_features == full_in:  # K not split: the checkpoint itself must hold whole groups
        multiple = k_shard_multiple(group_size)
        if in_features % multiple:
            raise ValueError(
                f"ternary layer {prefix!r}: in_features = {in_features} is not a multiple of "
                f"lcm(4, group_size={group_size}) = {multiple}"
            )
        return group_size
    if in_features % MIN_K_SHARD:
        working = [str(t) for t in _working_tp_sizes(full_in, tp_size)]
        choices = ", ".join(working[:-1]) + (" or " if len(working) > 1 else "") + working[-1]
        raise ValueError(
            f"ternary layer {prefix!r}: a row-parallel K shard of {in_features} (K = {full_in} split over "
            f"tensor_parallel_size={tp_size}) is not a multiple of {MIN_K_SHARD}, the smallest group a ternary "
            f"layer can be served at; tensor_parallel_size {choices} splits it "
            f"into multiples of {MIN_K_SHARD}"
        )
    return math.gcd(group_size, in_features)


class RegroupedScaleParameter(GroupQuantScaleParameter):
    """Scales of a K shard served at a finer group than the checkpoint's (``repeat`` = checkpoint group /
    served group): every checkpoint scale is repeated ``repeat`` times along K before vLLM's own loader
    takes this rank's slice, so the shard starts and ends on group boundaries. Exact: same values."""

    def __init__(self, *, repeat: int, **kwargs):
        self.repeat = int(repeat)
        super().__init__(**kwargs)

    def _expand(self, loaded_weight: torch.Tensor) -> torch.Tensor:
        return loaded_weight.repeat_interleave(self.repeat, dim=self.input_dim)

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor):
        super().load_row_parallel_weight(self._expand(loaded_weight))

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor):
        super().load_column_parallel_weight(self._expand(loaded_weight))

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, **kwargs):
        super().load_merged_column_weight(self._expand(loaded_weight), **kwargs)

    def load_qkv_weight(self, loaded_weight: torch.Tensor, **kwargs):
        super().load_qkv_weight(self._expand(loaded_weight), **kwargs)


def create_ternary_parameters(layer, out_features: int, in_features: int, group_size: int, weight_loader,
                              checkpoint_group_size: int | None = None):
    """Register ``qweight`` (uint8 [N, K/4]) and ``scales`` (fp16 [N, K/g]) on ``layer``; ``g`` is the served
    group, finer than ``checkpoint_group_size`` when a K shard splits checkpoint groups."""
    qweight = PackedvLLMParameter(
        data=torch.empty(out_features, in_features // CODES_PER_BYTE, dtype=torch.uint8),
        input_dim=1,
        output_dim=0,
        packed_dim=1,
        packed_factor=CODES_PER_BYTE,
        weight_loader=weight_loader,
    )
    scale_args = dict(data=torch.empty(out_features, in_features // group_size, dtype=torch.float16),
                      input_dim=1, output_dim=0, weight_loader=weight_loader)
    repeat = (checkpoint_group_size or group_size) // group_size
    scales = RegroupedScaleParameter(repeat=repeat, **scale_args) if repeat > 1 else GroupQuantScaleParameter(**scale_args)
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

    # quant_config: the checkpoint's TernaryConfig (typed by its vLLM base: the config module imports this one)
    def __init__(self, quant_config: QuantizationConfig, prefix: str = "") -> None:
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
        checkpoint_g = self.quant_config.group_size
        out_features = sum(output_partition_sizes)
        g = load_group_size(self.prefix, input_size_per_partition, out_features, input_size, checkpoint_g,
                            self._tp_size(layer))
        create_ternary_parameters(
            layer, out_features, input_size_per_partition, g, extra_weight_attrs.get("weight_loader"), checkpoint_g
        )
        layer.ternary_out_features = out_features
        layer.ternary_in_features = input_size_per_partition
        layer.ternary_group_size = g
        layer.ternary_input_transform = None
        layer.ternary_activations = ternary_ops.AUTO
        layer.ternary_k_sharded = input_size_per_partition != input_size  # row-parallel, TP > 1

    def _ternary_linear(
        self, layer: torch.nn.Module, x: torch.Tensor, qweight_k: torch.Tensor, scales_k: torch.Tensor, bias
    ) -> torch.Tensor:
        """``transform(x) @ W.T (+ bias)`` with ``W`` in the kernel layout ``qweight_k``/``scales_k``."""
        transform = layer.ternary_input_transform
        if transform is not None:
            x = transform(x)
        activations = getattr(layer, "ternary_activations", ternary_ops.AUTO)
        if activations == ternary_ops.INT8_TOKEN and getattr(layer, "ternary_k_sharded", False):
            return int8_token_sharded(layer, x, qweight_k, scales_k, bias)
        return torch.ops.ternary_rs.ternary_linear(
            x,
            qweight_k,
            scales_k,
            layer.ternary_out_features,
            layer.ternary_in_features,
            layer.ternary_group_size,
            bias,
            activations,
        )


def int8_only(layer: torch.nn.Module) -> bool:
    """Whether every call of the layer runs an int8 activation mode, so that its weight may take the int8
    layout (``ops.prepare_weight(int8_only=True)``): the int8 modes asked for, except BitNet's per-token mode on
    a K shard (``int8_token_sharded`` calls the op's exact mode), or the auto mode on bf16 / fp16 activations —
    vLLM processes the weights with the model dtype as torch's default — unless ``TERNARY_RS_CPU_INT8`` says
    otherwise."""
    activations = getattr(layer, "ternary_activations", ternary_ops.AUTO)
    if activations == ternary_ops.INT8_TOKEN and getattr(layer, "ternary_k_sharded", False):
        return False
    if activations in (ternary_ops.INT8_GROUP, ternary_ops.INT8_TOKEN):
        return True
    if activations != ternary_ops.AUTO:
        return False
    default = _ops_cpu.default_int8()
    if default is not None:
        return default
    return torch.get_default_dtype() in (torch.bfloat16, torch.float16)


def int8_token_sharded(layer: torch.nn.Module, x: torch.Tensor, qweight_k, scales_k, bias) -> torch.Tensor:
    """The op's int8-per-token mode for a K shard: the token scale ``127 / max(max|x|, 1e-5)`` takes max|x|
    over every rank's shard (one all-gather of a float per token), ``q = clamp(round(x · scale), -128, 127)``
    as the op does; the shard's integer products come from the op's exact mode on ``q`` (integers, exact
    in f32 / fp16), then ``÷ scale`` (+ bias). Summed over ranks by the layer, this is the unsharded result."""
    from vllm.distributed import tensor_model_parallel_all_gather

    xf = x.float()
    amax = tensor_model_parallel_all_gather(xf.abs().amax(dim=-1, keepdim=True), dim=-1).amax(dim=-1, keepdim=True)
    scale = xf.new_full((), 127.0) / amax.clamp(min=1e-5)  # one rounding, as the op (not torch's 127 · 1/amax)
    q = (xf * scale).round().clamp(-128, 127)  # torch.round: half to even, as the op
    # The CUDA kernels take fp16: q · 2⁻⁷ is exact there and keeps the output in range (as _ops_cuda does).
    code_scale = 2.0 ** -7 if q.is_cuda else 1.0
    y = torch.ops.ternary_rs.ternary_linear(
        (q * code_scale).to(torch.float16) if q.is_cuda else q,
        qweight_k,
        scales_k,
        layer.ternary_out_features,
        layer.ternary_in_features,
        layer.ternary_group_size,
        None,
        ternary_ops.EXACT,
    ).float() * (1.0 / (scale * code_scale))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@register_weight_loader_v2_supported_method
class TernaryLinearMethod(TernaryMethodBase, LinearMethodBase):
    """Linear method: ``y = transform(x) @ W.T (+ bias)`` with ternary ``W``."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        validate_loaded(self.prefix, layer.qweight.data, layer.scales.data,
                        lambda: self.quant_config.locate_invalid(self.prefix))
        qweight_k, scales_k = ternary_ops.prepare_weight(layer.qweight.data, layer.scales.data, layer.ternary_group_size,
                                                         int8_only=int8_only(layer))
        # Kernel layout replaces the canonical tensors (no second copy kept).
        layer.qweight = torch.nn.Parameter(qweight_k, requires_grad=False)
        layer.scales = torch.nn.Parameter(scales_k, requires_grad=False)
        layer.ternary_input_transform = self.quant_config.get_input_transform(self.prefix, layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._ternary_linear(layer, x, layer.qweight, layer.scales, bias)
