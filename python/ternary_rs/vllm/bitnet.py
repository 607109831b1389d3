"""BitNet b1.58 (``BitNetForCausalLM``) for vLLM, registered by :func:`ternary_rs.vllm.plugin.register`.

vLLM has no BitNet architecture; this follows its Llama model (``vllm/model_executor/models/llama.py``,
whose ``LlamaModel`` / ``LlamaForCausalLM`` / ``LlamaAttention`` it reuses: GQA, NeoX RoPE, tied or untied
``lm_head``, torch.compile, tensor parallel) and transformers' ``modeling_bitnet.py`` for what differs:

* ``self_attn.attn_sub_norm``: RMSNorm over the attention output, before ``o_proj``;
* ``mlp``: ``down_proj(ffn_sub_norm(relu(gate)² · up))`` (``hidden_act = "relu2"``);
* every linear layer is a BitLinear: its input is quantized per token to int8 exactly as transformers'
  ``activation_quant`` (``scale = 127 / max(max|x|, 1e-5)``, round half to even, clamp −128..127), the
  product with the trits is an exact integer sum, then ``× weight scale ÷ scale``. Each ternary linear asks
  the op for that mode (``layer.ternary_activations = ops.INT8_TOKEN``) whatever the global default; a
  row-parallel layer whose K is split over TP ranks takes the token's max over all ranks
  (``ternary_rs.vllm.linear``), so the numerics do not depend on the TP size.

Tensor parallel: both sub-norms normalize over a dimension that column-parallel layers split across ranks
(heads, intermediate). :class:`ShardedRMSNorm` holds this rank's slice of the norm weight and all-reduces
the per-token sum of squares, so every rank normalizes by the RMS of the whole row, as transformers does.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from vllm.model_executor.layers.activation import ReLUSquaredActivation
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.models.llama import LlamaAttention, LlamaForCausalLM
from vllm.model_executor.utils import set_weight_attrs

from ..serving import ops as ternary_ops


def use_bitnet_activations(module: nn.Module) -> None:
    """Every linear layer under ``module`` runs BitNet's int8-per-token activation numerics."""
    for m in module.modules():
        if isinstance(m, LinearBase):
            m.ternary_activations = ternary_ops.INT8_TOKEN


class ShardedRMSNorm(nn.Module):
    """transformers' ``BitNetRMSNorm`` (= ``LlamaRMSNorm``: ``w · (x / sqrt(mean(x²) + eps))`` computed in
    f32, rounded to the input dtype before the weight) over a dimension of ``size`` split evenly across the
    TP ranks: each rank holds its contiguous slice of ``x`` and of the weight; the sum of squares is
    all-reduced so that the mean is over the whole ``size``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        if size % self.tp_size:
            raise ValueError(f"BitNet sub-norm of size {size} cannot be split over tensor_parallel_size={self.tp_size}")
        self.size = size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size // self.tp_size))
        set_weight_attrs(self.weight, {"weight_loader": sharded_weight_loader(0)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        sum_sq = xf.pow(2).sum(dim=-1, keepdim=True)
        if self.tp_size > 1:
            sum_sq = tensor_model_parallel_all_reduce(sum_sq)
        xf = xf * torch.rsqrt(sum_sq / self.size + self.eps)
        return self.weight * xf.to(dtype)

    def extra_repr(self) -> str:
        return f"size={self.size}, shard={self.size // self.tp_size}, eps={self.eps}"


class BitNetAttention(LlamaAttention):
    """Llama attention with ``attn_sub_norm`` on the attention output (sharded by heads under TP)."""

    def __init__(self, *, config, hidden_size: int, num_heads: int, **kwargs):
        super().__init__(config=config, hidden_size=hidden_size, num_heads=num_heads, **kwargs)
        width = self.total_num_heads * self.head_dim
        if width != config.hidden_size:
            raise ValueError(f"BitNet attn_sub_norm normalizes hidden_size = {config.hidden_size} values, but the "
                             f"attention output has {width} (heads · head_dim)")
        self.attn_sub_norm = ShardedRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        output, _ = self.o_proj(self.attn_sub_norm(attn_output))
        return output


class BitNetMLP(nn.Module):
    """``down_proj(ffn_sub_norm(relu(gate_proj(x))² · up_proj(x)))``, gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, eps: float, quant_config,
                 bias: bool = False, prefix: str = ""):
        super().__init__()
        if hidden_act != "relu2":
            raise ValueError(f"BitNet MLP: hidden_act {hidden_act!r} is not supported (BitNet b1.58 uses relu2)")
        self.gate_up_proj = MergedColumnParallelLinear(
            input_size=hidden_size, output_sizes=[intermediate_size] * 2, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(
            input_size=intermediate_size, output_size=hidden_size, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.down_proj")
        self.act_fn = ReLUSquaredActivation()
        self.ffn_sub_norm = ShardedRMSNorm(intermediate_size, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        x, _ = self.down_proj(self.ffn_sub_norm(self.act_fn(gate) * up))
        return x


class BitNetDecoderLayer(nn.Module):
    """``LlamaDecoderLayer`` with the BitNet attention and MLP (vLLM's Llama MLP only supports silu)."""

    def __init__(self, vllm_config, prefix: str = "", config=None):
        super().__init__()
        config = config or vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.hidden_size = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = BitNetAttention(
            config=config,
            hidden_size=self.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            quant_config=quant_config,
            bias=bias,
            bias_o_proj=bias,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = BitNetMLP(self.hidden_size, config.intermediate_size, config.hidden_act, config.rms_norm_eps,
                             quant_config, bias=bool(getattr(config, "mlp_bias", False)), prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        use_bitnet_activations(self)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class BitNetForCausalLM(LlamaForCausalLM):
    """vLLM's ``LlamaForCausalLM`` built from :class:`BitNetDecoderLayer` (weights load through Llama's
    mapping: q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``; the sub-norms by name)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=BitNetDecoderLayer)


__all__ = ["BitNetForCausalLM", "ShardedRMSNorm", "use_bitnet_activations"]
