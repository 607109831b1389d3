"""Shared machinery for decoders with a routed Mixture-of-Experts MLP (``qwen3moe``, ``qwen2moe``).

llama.cpp stacks the experts of a block into one 3-D tensor per projection, ``blk.N.ffn_{gate,up,down}_exps``
(``[n_expert, N, K]`` in PyTorch order, each expert a contiguous ``[N, K]`` slice of its bytes); Hugging Face
and vLLM name them one by one, ``model.layers.N.mlp.experts.E.{gate,up,down}_proj``. ``convert`` splits a
stack into its experts (:meth:`MoEDecoderArch.expert_hf_names`), so every expert becomes its own
``qweight``/``scales`` pair in the checkpoint (docs/checkpoint.md); the router ``mlp.gate`` stays dense.
"""

from __future__ import annotations

from typing import Any

from .base import DenseDecoderArch

# A block's router and stacked experts (llama.cpp's 3-D ``ffn_*_exps``, under the names gguf-py's table maps).
MOE_BLOCK_NAMES = (
    "model.layers.{bid}.mlp.gate.weight",
    "model.layers.{bid}.mlp.experts.gate_proj.weight",
    "model.layers.{bid}.mlp.experts.up_proj.weight",
    "model.layers.{bid}.mlp.experts.down_proj.weight",
)
# A dense MLP's names, which a block with experts does not have.
DENSE_MLP_NAMES = tuple(f"model.layers.{{bid}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
_EXPERTS_MARK = ".mlp.experts."


def gguf_output_refused(path, arch: str) -> str:
    """Why a Mixture-of-Experts model is not written as GGUF (one message for every source kind)."""
    return (f"{path}: GGUF output of a Mixture-of-Experts model ({arch}) is not supported; convert it to a "
            "vLLM checkpoint (a destination folder) instead")


class MoEDecoderArch(DenseDecoderArch):
    """A decoder whose blocks have a routed Mixture-of-Experts MLP; subclasses set the names
    (``hf_block_names``: the attention's plus :data:`MOE_BLOCK_NAMES`)."""

    # GGUF key suffix -> config.json key: what llama.cpp's Qwen2MoeModel / Qwen3MoeModel write.
    moe_keys = (
        ("expert_count", "num_experts"),
        ("expert_used_count", "num_experts_per_tok"),
        ("expert_feed_forward_length", "moe_intermediate_size"),
    )

    default_norm_topk_prob = True

    def expert_hf_names(self, hf_name: str, n_expert: int) -> list[str]:
        """The per-expert Hugging Face names of a stacked expert tensor, in stack order
        (``…mlp.experts.gate_proj.weight`` -> ``…mlp.experts.E.gate_proj.weight``)."""
        head, mark, tail = hf_name.partition(_EXPERTS_MARK)
        if not mark or "." in tail[: -len(".weight")]:
            raise KeyError(f"{hf_name!r} is not a stacked expert tensor of {self.gguf_arch}")
        return [f"{head}{mark}{e}.{tail}" for e in range(n_expert)]

    def config_fixups_from_gguf(self, config: dict[str, Any], metadata: dict[str, Any]) -> None:
        super().config_fixups_from_gguf(config, metadata)
        a = self.gguf_arch
        for key, name in self.moe_keys:
            if f"{a}.{key}" in metadata:
                config[name] = int(metadata[f"{a}.{key}"])
        if "num_experts" not in config or "moe_intermediate_size" not in config:
            from .._core import FormatError

            # Without them the config would describe a different model than the tensors.
            raise FormatError(f"{a} GGUF metadata lacks {a}.expert_count or {a}.expert_feed_forward_length")
        # What llama.cpp's graph does when the file does not say (expert_weights_norm): qwen3moe always
        # renormalises the selected experts' weights, qwen2moe never does.
        config["norm_topk_prob"] = bool(metadata.get(f"{a}.expert_weights_norm", self.default_norm_topk_prob))
        # Every block is sparse in llama.cpp's qwen3moe (its tensor table has no dense ffn_gate/up/down).
        config["decoder_sparse_step"] = 1
        config["mlp_only_layers"] = []
