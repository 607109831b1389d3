"""Tiny local test models (no hub access): a random Qwen3/Llama whose linear weights are ternarized
with group absmax (the Bonsai convention), plus a BPE tokenizer trained on a few sentences.

Used by the conversion, vLLM and end-to-end tests. Everything is deterministic for a given seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SENTENCES = [
    "Ternary weights take one of three values: minus one, zero or plus one.",
    "The quick brown fox jumps over the lazy dog.",
    "A scale per group of weights restores the magnitude.",
    "Hello world! This is a tiny model for testing ternary_rs.",
    "vLLM serves large language models fast, on GPUs and on CPUs.",
    "Once upon a time there was a small model that only knew three numbers.",
]

# Linear weights of these architectures that Bonsai-style checkpoints store as ternary.
TERNARY_SUFFIXES = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
    "gate_proj.weight", "up_proj.weight", "down_proj.weight",
    "lm_head.weight", "embed_tokens.weight",
)


# ChatML, as Qwen uses it.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(out_dir: Path, vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on SENTENCES, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def ternarize_absmax(w: np.ndarray, group_size: int) -> np.ndarray:
    """Group absmax ternarization along the last dim; returns t·fp16(a) as float32 (exact in fp16)."""
    n, k = w.shape
    g = w.astype(np.float32).reshape(n, k // group_size, group_size)
    a = np.abs(g).max(axis=-1, keepdims=True).astype(np.float16).astype(np.float32)
    a = np.where(a == 0, np.float32(1.0), a)
    t = np.clip(np.rint(g / a), -1, 1)
    return (t * a).reshape(n, k).astype(np.float32)


def build_tiny_model(
    out_dir: Path,
    arch: str = "qwen3",
    group_size: int = 128,
    seed: int = 0,
    dtype: str = "float16",
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    tie_word_embeddings: bool = False,
):
    """Write a random ternarized ``Qwen3ForCausalLM`` (or ``LlamaForCausalLM``) HF directory to ``out_dir``.

    Returns the transformers model (float32, weights already ternary) for reference computations.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out_dir)
    vocab = len(tok)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
    )
    if arch == "qwen3":
        cfg = Qwen3Config(head_dim=head_dim, **common)
    elif arch == "llama":
        cfg = LlamaConfig(head_dim=head_dim, **common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(TERNARY_SUFFIXES):
                w = rng.standard_normal(p.shape).astype(np.float32) * 0.05
                p.copy_(torch.from_numpy(ternarize_absmax(w, group_size)))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32)))
    model.save_pretrained(out_dir, safe_serialization=True)
    # Re-save in the requested dtype (fp16 holds t·fp16(a) exactly: an "unpacked" Bonsai-style checkpoint).
    if dtype != "float32":
        half = AutoModelForCausalLM.from_pretrained(out_dir, dtype=getattr(torch, dtype))
        half.save_pretrained(out_dir, safe_serialization=True)
    gen = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    model.eval()
    return model


if __name__ == "__main__":
    import sys
    import tempfile

    d = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    m = build_tiny_model(d)
    print(d, sorted(p.name for p in d.iterdir()), sum(p.numel() for p in m.parameters()))
