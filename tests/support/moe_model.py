"""A tiny Qwen3-MoE (``Qwen3MoeForCausalLM``) built locally with transformers, its weights made exactly
ternary, and written as a ``qwen3moe`` TQ2_0 GGUF — by llama.cpp's own ``convert_hf_to_gguf.py`` when
``tests/support/llama_cpp.py`` finds it, otherwise by :func:`write_qwen3moe_gguf` with the pip ``gguf`` package (the
same tensor names, types and metadata keys llama.cpp's converter writes; ``tests/test_moe.py`` compares the
two when both are available).

Every linear weight, the experts included, is ``t · a`` with one fp16-exact ``a`` per 256 values along K
(group-256 absmax), so TQ2_0 holds it exactly; the router ``mlp.gate`` and the embeddings stay float
(llama.cpp keeps ``ffn_gate_inp`` in F32 and writes the embeddings F16 in a TQ file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .gguf_models import TQ_GROUP, train_qwen2_tokenizer
from .models import ternarize_absmax

EXPERT_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
ATTENTION_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
# Qwen2-MoE's shared expert: an ordinary SwiGLU MLP beside the routed ones (ternary like them).
SHARED_EXPERT_SUFFIXES = ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                          "shared_expert.down_proj.weight")


@dataclass
class TinyMoE:
    hf_dir: Path
    config: dict


def build_tiny_moe(out_dir: Path, *, seed: int = 0, hidden: int = 256, moe_intermediate: int = 256,
                   experts: int = 8, top_k: int = 2, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                   head_dim: int = 64, shared_intermediate: int = 0) -> TinyMoE:
    """Random ternary ``Qwen3MoeForCausalLM`` saved in float16 (which holds ``t · fp16(a)`` exactly); with
    ``shared_intermediate`` a ``Qwen2MoeForCausalLM`` instead (q/k/v biases, a shared expert of that size
    gated by a dense ``shared_expert_gate``, router weights not renormalised, as Qwen1.5-MoE).

    ``hidden`` and ``moe_intermediate`` are multiples of 256: llama.cpp writes a tensor TQ2_0 only when its
    rows fill whole 256-value blocks (F16 otherwise), and the point is the packed 3-D expert tensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2MoeConfig, Qwen3MoeConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_qwen2_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    common = dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=512,
        tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    if shared_intermediate:
        assert head_dim == hidden // heads, "Qwen2-MoE has no head_dim of its own"
        cfg = Qwen2MoeConfig(**common, shared_expert_intermediate_size=shared_intermediate, norm_topk_prob=False)
    else:
        cfg = Qwen3MoeConfig(**common, head_dim=head_dim, norm_topk_prob=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ATTENTION_SUFFIXES + EXPERT_SUFFIXES + SHARED_EXPERT_SUFFIXES):
                # Experts: [E, N, K], ternarized per expert row along K.
                w = rng.standard_normal(p.shape).astype(np.float32) * 0.05
                flat = ternarize_absmax(w.reshape(-1, p.shape[-1]), TQ_GROUP).reshape(p.shape)
                p.copy_(torch.from_numpy(flat))
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                # router and shared-expert gate: dense, spread enough to route tokens apart
                p.copy_(torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32) * 0.5))
            elif name.endswith("_proj.bias"):  # Qwen2's q/k/v biases: dense
                p.copy_(torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32) * 0.1))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32)))
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.copy_(torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32) * 0.5))
    model.to(torch.float16).save_pretrained(out_dir, safe_serialization=True)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return TinyMoE(out_dir, json.loads((out_dir / "config.json").read_text()))


def write_qwen3moe_gguf(hf_dir: Path, out: Path) -> Path:
    """The TQ2_0 GGUF llama.cpp's ``convert_hf_to_gguf.py --outtype tq2_0`` writes for this model
    (``Qwen3MoeModel``: ``TextModel`` keys + ``expert_feed_forward_length``, gpt2 vocabulary with
    ``tokenizer.ggml.pre = qwen2``), written with the pip ``gguf`` package — for machines without llama.cpp's
    converter. Same keys, key order, tensor names, order and types: F32 for 1-D tensors and the router
    (``ffn_gate_inp``), F16 for the embeddings (as in every TQ file), the experts stacked into one 3-D
    ``[n_expert, N, K]`` tensor per projection, TQ2_0 where rows fill 256-value blocks, else F16."""
    import gguf
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    n_expert = int(cfg.get("num_experts") or cfg["num_local_experts"])
    state = {k: v.float().numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, cfg["num_hidden_layers"])
    tensors: list[tuple[str, np.ndarray]] = []
    for name in sorted(state):  # the converter's order: the safetensors keys, experts merged at the first one
        if ".mlp.experts." in name:
            head, _, tail = name.partition(".mlp.experts.")
            if not tail.startswith("0.") or not tail.endswith("down_proj.weight"):
                continue
            for proj in ("down_proj", "gate_proj", "up_proj"):
                stack = np.stack([state[f"{head}.mlp.experts.{e}.{proj}.weight"] for e in range(n_expert)])
                tensors.append((tmap.get_name(f"{head}.mlp.experts.{proj}.weight", try_suffixes=(".weight",)), stack))
        else:
            tensors.append((tmap.get_name(name, try_suffixes=(".weight", ".bias")), state[name]))
    typed = []
    for gname, data in tensors:
        if data.ndim <= 1 or gname.endswith("_norm.weight") or ".ffn_gate_inp." in gname:
            typed.append((gname, data.astype(np.float32), gguf.GGMLQuantizationType.F32))
        elif gname in ("token_embd.weight", "output.weight") or data.shape[-1] % TQ_GROUP:
            typed.append((gname, data.astype(np.float16), gguf.GGMLQuantizationType.F16))
        else:
            typed.append((gname, gguf.quants.quantize(data, gguf.GGMLQuantizationType.TQ2_0),
                          gguf.GGMLQuantizationType.TQ2_0))
    return write_gguf_tensors(hf_dir, cfg, typed, out)


def write_gguf_tensors(hf_dir: Path, cfg: dict, typed: list, out: Path) -> Path:
    """A ``qwen3moe`` GGUF of ``typed`` (``(name, array, GGMLQuantizationType)``; quantized arrays are the
    blocks' bytes, ``[..., N, K/256·66]`` for TQ2_0) with the metadata llama.cpp's converter writes for
    ``cfg`` and the tokenizer in ``hf_dir``."""
    import gguf
    from transformers import AutoTokenizer

    writer = gguf.GGUFWriter(str(out), "qwen3moe")
    for gname, data, qtype in typed:
        writer.add_tensor(gname, data, raw_dtype=qtype)
    # general.* exactly as ModelBase.prepare_metadata derives them (name and size label from the folder/tensors).
    total, shared, expert, expert_count = writer.get_total_parameter_count()
    meta = gguf.Metadata.load(None, hf_dir, None, total)
    meta.name = meta.name or hf_dir.name
    meta.size_label = meta.size_label or gguf.size_label(total, shared, expert, expert_count)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(int(cfg.get("num_experts") or cfg["num_local_experts"]))
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_TQ2_0)
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # Vocabulary: TextModel.get_vocab_base + _set_vocab_gpt2.
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    reverse = {i: t for t, i in tok.vocab.items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(cfg["vocab_size"]):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif reverse[i] in added:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if decoder[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True).add_to_gguf(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
