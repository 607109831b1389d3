"""Tiny Hugging Face models of architectures ternary_rs has no hand-written module for (``tests/test_generic_arch.py``):
Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``), Gemma 3 (norms llama.cpp stores as ``1 + w``, q/k norms, tied
head, sliding-window layers) and Qwen2 (q/k/v biases).

Linear weights are ternary-valued ``t · s`` with one fp16 scale per 256 values along K (group absmax), so
llama.cpp's TQ2_0 holds them exactly; everything else is random and saved in float16 (llama.cpp's F16 / F32
hold it exactly too). Hidden size 256 is the smallest whose rows fill a TQ2_0 block (a narrower row is
written F16 by llama.cpp's converter, and then the test would not read TQ2_0). Tokenizers are trained
locally on ``models.SENTENCES``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .gguf_models import TQ_GROUP, train_qwen2_tokenizer
from .models import ternarize_absmax, train_tokenizer

ARCHITECTURES = ("phi3", "gemma3", "qwen2")
# tokenizer.ggml.pre pinned for llama.cpp's converter (it cannot hash-identify a locally trained tokenizer).
TOKENIZER_PRE = {"phi3": "gpt-2", "gemma3": "gpt-2", "qwen2": "qwen2"}
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
# Gemma's RMSNorm multiplies by (1 + w): its weights are offsets around 0, the others' scales around 1.
NORM_CENTRE = {"gemma3": 0.0}
# llama.cpp's converter adds Gemma's 1 in the model's float16, so 1 + w is rounded to 2⁻¹⁰ there: offsets on
# that grid survive it exactly (and the test can ask for equality).
GEMMA_NORM_GRID = 2.0 ** -10


def _config(arch: str, tok):
    from transformers import Gemma3TextConfig, Phi3Config, Qwen2Config

    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    if arch == "phi3":
        return Phi3Config(**SHAPE, **ids)
    if arch == "gemma3":
        # Keys llama.cpp does not write (query_pre_attn_scalar, layer pattern) keep the class defaults, as
        # transformers' GGUF loader would read them back.
        return Gemma3TextConfig(head_dim=64, **SHAPE, **ids)
    if arch == "qwen2":
        return Qwen2Config(**SHAPE, **ids)
    raise ValueError(arch)


def build_generic_model(out_dir: Path, arch: str, seed: int = 0) -> Path:
    """Write a random ternary-valued ``arch`` model (one of ARCHITECTURES) with its tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if arch == "qwen2":
        train_qwen2_tokenizer(out_dir)
    else:
        train_tokenizer(out_dir)
    if arch == "phi3":  # Phi3MiniModel.set_vocab takes the byte-level BPE path only for this class name
        cfg_path = out_dir / "tokenizer_config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, tok), dtype=torch.float32)
    rng = np.random.default_rng(seed)
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    linears.discard("lm_head.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = rng.standard_normal(p.shape).astype(np.float32)
            if name in linears:
                p.copy_(torch.from_numpy(ternarize_absmax(w * 0.05, TQ_GROUP)))
            elif "norm" in name:
                norm = NORM_CENTRE.get(arch, 1.0) + 0.1 * w
                if arch == "gemma3":
                    norm = np.round(norm / GEMMA_NORM_GRID) * GEMMA_NORM_GRID
                p.copy_(torch.from_numpy(norm.astype(np.float32)))
            else:  # embeddings, head, biases
                p.copy_(torch.from_numpy(0.05 * w))
    model.to(torch.float16).save_pretrained(out_dir, safe_serialization=True)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out_dir
