"""``bitnet`` (BitNetForCausalLM, Microsoft's BitNet b1.58 family: ``microsoft/bitnet-b1.58-2B-4T`` and kin).

A Llama-shaped decoder with ReLU² gated MLP and two extra RMSNorms per block — ``self_attn.attn_sub_norm``
(over the attention output, before ``o_proj``) and ``mlp.ffn_sub_norm`` (over ``act(gate)·up``, before
``down_proj``) — whose seven linear weights per block are ternary with **one scale per tensor**, while
``embed_tokens`` / ``lm_head`` stay dense. The serving side (activations quantized to int8 per token in
every linear) is ``ternary_rs.vllm.bitnet``.

Sources (docs/formats.md#bitnet-packing, docs/formats.md#i2_s):

* transformers' packed checkpoints (``quantization_config.quant_method = "bitnet"``, ``quantization_mode``
  offline): uint8 ``[N/4, K]`` + ``weight_scale``, either ``linear_class`` convention (decoded by the BitNet
  codec, see ``ternary_rs.decode``);
* the bf16 master-weight variant (``quantization_mode`` online, dense ``nn.Linear`` weights that transformers
  ternarizes at every forward with ``WeightQuant``): converted only when asked (``convert(ternarize=True)``,
  ``--ternarize``), by :func:`weight_quant` — transformers' formula, so trits and scales are its own;
* bitnet.cpp / llama.cpp GGUFs: ``general.architecture`` ``bitnet`` (upstream llama.cpp and bitnet.cpp's
  converters) or ``bitnet-b1.58`` / ``bitnet-25`` (bitnet.cpp's names for the 2B-4T GGUF), I2_S, TQ1_0 or
  TQ2_0 linear weights, ``blk.N.attn_sub_norm`` / ``blk.N.ffn_sub_norm``. llama.cpp runs BitNet with NeoX
  RoPE, so no q/k rows are permuted (neither converter permutes them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import LINEAR_SUFFIXES, DenseDecoderArch

# Hugging Face sub-norm names -> gguf-py's tensor kind (GGUF names come from gguf-py's own table; its BitNet
# map only knows the 1bitLLM names ``inner_attn_ln`` / ``ffn_layernorm`` on the Hugging Face side).
SUB_NORMS = {
    "model.layers.{bid}.self_attn.attn_sub_norm.weight": "ATTN_SUB_NORM",
    "model.layers.{bid}.mlp.ffn_sub_norm.weight": "FFN_SUB_NORM",
}
# gguf-py's BitNet tensor list has no output tensor (the models it knows are tied); an untied head keeps
# llama.cpp's usual name.
LM_HEAD = ("lm_head.weight", "output.weight")
# transformers' BitNetQuantConfig values this converter understands.
LINEAR_CLASSES = ("bitlinear", "autobitlinear")
# transformers' WeightQuant clamps mean|W| at this before taking its reciprocal.
WEIGHT_QUANT_FLOOR = 1e-5


def weight_quant(w) -> tuple[Any, Any]:
    """transformers' ``WeightQuant.forward`` (``integrations/bitnet.py``) on a float32 torch tensor:
    ``s = 1 / max(mean|W|, 1e-5)``, trits ``clamp(round(W·s), -1, 1)`` (half to even), magnitude ``1/s``
    (both f32). The served weight is ``trits · (1/s)`` rounded to the model dtype, exactly what
    transformers' online ``AutoBitLinear`` multiplies with.

    Same formula and the same torch reduction as transformers; ``mean`` is an f32 reduction whose last bit
    can depend on the device and summation order, so a weight whose ``|W·s|`` lies within an ulp of 0.5
    may round differently than on another device (transformers itself has that property)."""
    scale = 1.0 / w.abs().mean().clamp(min=WEIGHT_QUANT_FLOOR)
    return (w * scale).round().clamp(-1, 1), 1.0 / scale


class BitNetArch(DenseDecoderArch):
    hf_model_types = ("bitnet",)
    # transformers' class, and the older 1bitLLM spelling bitnet.cpp's converter also accepts.
    hf_architectures = ("BitNetForCausalLM", "BitnetForCausalLM")
    hf_global_names = ("model.embed_tokens.weight", "model.norm.weight")
    default_tokenizer_pre = "llama-bpe"
    dense_embeddings = True  # inspect/verify: a dense embed_tokens / lm_head is by design, not "not ternary"
    # transformers' GGUF loader has no BitNet mapping: the tokenizer is rebuilt from the metadata read as
    # this architecture (tokenizer keys are architecture-independent), the config by the built-in mapping.
    transformers_gguf_alias = "llama"

    def __init__(self, gguf_arch: str = "bitnet"):
        self.gguf_arch = gguf_arch

    def __hash__(self) -> int:  # lru_cache on _name_maps keys on the instance
        return hash(("BitNetArch", self.gguf_arch))

    def __eq__(self, other) -> bool:
        return isinstance(other, BitNetArch) and other.gguf_arch == self.gguf_arch

    def _gguf_model_arch(self):
        import gguf

        return gguf.MODEL_ARCH.BITNET  # every BitNet GGUF name uses llama.cpp's BitNet tensor names

    # ---------------------------------------------------------------- names
    def _extra_names(self, n_blocks: int) -> dict[str, str]:
        import gguf

        out = {LM_HEAD[0]: LM_HEAD[1]}
        for hf, kind in SUB_NORMS.items():
            base = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)]
            for bid in range(n_blocks):
                out[hf.format(bid=bid)] = base.format(bid=bid) + ".weight"
        return out

    def gguf_name(self, hf_name: str, n_blocks: int) -> str | None:
        extra = self._extra_names(n_blocks)
        return extra[hf_name] if hf_name in extra else super().gguf_name(hf_name, n_blocks)

    def hf_name(self, gguf_name: str, n_blocks: int) -> str | None:
        for hf, g in self._extra_names(n_blocks).items():
            if g == gguf_name:
                return hf
        return super().hf_name(gguf_name, n_blocks)

    # Every BitNet linear is a BitLinear: one kept dense would silently lose the int8 activation numerics.
    dense_linears_allowed = False

    def ternary_candidate(self, hf_name: str, shape: tuple[int, ...]) -> bool:
        # BitNet keeps embed_tokens / lm_head dense (transformers never converts lm_head).
        return len(shape) == 2 and hf_name.endswith(LINEAR_SUFFIXES)

    # ---------------------------------------------------------------- sources
    def check_source_config(self, config: dict[str, Any], path, options) -> None:
        """Refuse BitNet settings whose numerics the checkpoint contract cannot carry, before converting."""
        qc = config.get("quantization_config") or {}
        if not isinstance(qc, dict) or qc.get("quant_method") != "bitnet":
            return
        from ..sinks.checkpoint import ConversionError

        linear_class = qc.get("linear_class") or "bitlinear"
        if linear_class not in LINEAR_CLASSES:
            raise ConversionError(f"{path}: quantization_config.linear_class {linear_class!r} is not one of "
                                  f"{LINEAR_CLASSES}")
        if qc.get("use_rms_norm"):
            raise ConversionError(
                f"{path}: quantization_config.use_rms_norm = true (an extra RMSNorm inside every BitLinear) is "
                "not supported: the served BitNet model has no such norm")
        online = qc.get("quantization_mode") == "online" and linear_class == "autobitlinear"
        if online and not getattr(options, "ternarize", False):
            raise ConversionError(
                f"{path}: BitNet master weights (quantization_mode 'online': dense linear weights that "
                "transformers ternarizes at every forward); pass --ternarize (ternarize=True) to store them "
                "ternary, per tensor by absmean exactly as transformers' WeightQuant does")
        biased = config.get("attention_bias") or config.get("mlp_bias")
        if linear_class == "autobitlinear" and not online and biased:
            raise ConversionError(
                f"{path}: an offline AutoBitLinear multiplies its bias by weight_scale; BitNet checkpoints "
                "with attention_bias / mlp_bias and linear_class 'autobitlinear' are not supported")

    def ternarize_dense(self, raw: np.ndarray, dtype: str, shape, group_size: int, name: str):
        """A dense linear weight -> ``TernaryTensor`` (``convert(ternarize=True)``). Already ternary with one
        magnitude ``a`` (llama.cpp's F32/F16 BitNet GGUFs store ``t · a``): those trits and ``fp16(a)``.
        Otherwise a master weight, by :func:`weight_quant`: the scale is ``1/s`` rounded to the source dtype
        (the value transformers serves), then to fp16 (exact for bf16/fp16 sources whose scale is a normal
        fp16 number)."""
        try:
            import torch
        except ImportError as e:
            from .._core import UnsupportedTypeError

            raise UnsupportedTypeError(f"tensor {name}: --ternarize needs torch (transformers' WeightQuant "
                                       "formula runs in torch)") from e
        from ..core.formats import float_view
        from ..core.tensor import TernaryTensor, pack_codes

        n, k = int(shape[0]), int(shape[1])
        w = torch.from_numpy(np.array(float_view(raw, dtype), copy=True).reshape(n, k))
        amax = w.abs().max()
        if float(amax) > 0 and bool(((w.abs() == amax) | (w == 0)).all()):
            trits, served = torch.sign(w), amax  # t · a already: keep it, a rounded to fp16
        else:
            trits, magnitude = weight_quant(w)
            served = magnitude.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype])
        scale = np.float16(float(served.float()))
        if not np.isfinite(scale) or scale == 0:
            from .._core import ValidationError

            raise ValidationError(f"tensor {name}: absmean scale {float(served.float())!r} is not a finite "
                                  "non-zero fp16 value")
        qweight = pack_codes(trits.to(torch.int8).numpy())
        scales = np.full((n, k // group_size), scale, dtype=np.float16)
        return TernaryTensor(qweight, scales, group_size, name=name)

    # ---------------------------------------------------------------- config / metadata
    def config_fixups_from_gguf(self, config: dict[str, Any], metadata: dict[str, Any]) -> None:
        super().config_fixups_from_gguf(config, metadata)
        a = self.gguf_arch
        if f"{a}.rope.dimension_count" in metadata and f"{a}.attention.key_length" not in metadata:
            config["head_dim"] = int(metadata[f"{a}.rope.dimension_count"])
        config["model_type"] = "bitnet"
        config["hidden_act"] = "relu2"
        config.setdefault("attention_bias", False)

    def gguf_hparams(self, writer, config: dict[str, Any]) -> None:
        super().gguf_hparams(writer, config)
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        writer.add_vocab_size(int(config["vocab_size"]))
        writer.add_rope_dimension_count(int(config.get("head_dim") or hidden // heads))


ARCH = BitNetArch("bitnet")
# bitnet.cpp's names for the 2B-4T GGUF (same tensors and keys under another prefix).
ALIASES = (BitNetArch("bitnet-b1.58"), BitNetArch("bitnet-25"))
