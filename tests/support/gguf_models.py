"""Tiny Hugging Face models whose vocabularies look like the real ones, for the GGUF-output tests:

* ``llama`` with a **sentencepiece** BPE ``tokenizer.model`` (byte fallback, ``<unk>``/``<s>``/``</s>``;
  llama.cpp's ``tokenizer.ggml.model = llama`` with scores),
* ``qwen3`` with a **Qwen2-style byte-level BPE** ``tokenizer.json`` (NFC, the Qwen2 split regex, ByteLevel
  without its own regex; llama.cpp's ``gpt2`` model with ``pre = qwen2``),

trained locally on ``models.SENTENCES``. Linear weights are ternarized with group-256 absmax, so llama.cpp's
TQ2_0 / TQ1_0 (one scale per 256 values) hold them exactly; embeddings and lm_head stay plain float unless
``ternary_embeddings`` (llama.cpp's converter writes them F16 in a TQ file, as for BitNet / TriLM models).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from .models import SENTENCES, TERNARY_SUFFIXES, ternarize_absmax, train_tokenizer

TQ_GROUP = 256
# The split regex of Qwen2/Qwen3's tokenizer.json (the pre-tokenizer llama.cpp calls "qwen2").
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_sentencepiece(out_dir: Path, vocab_size: int = 400) -> None:
    """A llama-style sentencepiece BPE model (``tokenizer.model``) plus a ``tokenizer_config.json``."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES * 8), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        split_digits=True, hard_vocab_limit=False, minloglevel=2,
    )
    (out_dir / "tokenizer.model").write_bytes(buf.getvalue())
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
    }, indent=2))


def train_qwen2_tokenizer(out_dir: Path, vocab_size: int = 320) -> None:
    """A Qwen2-style byte-level BPE ``tokenizer.json`` (+ config) with Qwen's special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_model(out_dir: Path, arch: str, seed: int = 0, hidden: int = 256, intermediate: int = 512,
                layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                ternary_embeddings: bool = False, tied: bool = False, vocab_size: int | None = None,
                tokenizer: str | None = None, config_extra: dict | None = None) -> Path:
    """Random ternarized (group 256) ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` with the matching vocabulary,
    saved in float16 (which holds ``t · fp16(a)`` exactly).

    ``tied``: one embedding matrix for input and output (``tie_word_embeddings``, no ``lm_head.weight``);
    ``vocab_size``: config.json's, larger than the tokenizer's like real checkpoints (Qwen3: 151936 rows for
    ~151.7k tokens; the GGUF then lists ``[PAD{i}]`` tokens); ``tokenizer``: ``"gpt2"`` for the plain
    byte-level BPE of ``models.train_tokenizer`` (GPT-2's regex), else the architecture's own;
    ``config_extra``: further config keys (e.g. ``rope_parameters``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if arch not in ("llama", "qwen3"):
        raise ValueError(arch)
    if tokenizer == "gpt2":
        train_tokenizer(out_dir)
    elif arch == "llama":
        train_sentencepiece(out_dir)
    else:
        train_qwen2_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    if vocab_size is not None and vocab_size < len(tok):
        raise ValueError(f"vocab_size {vocab_size} < {len(tok)} tokens")
    common = dict(vocab_size=vocab_size or len(tok), hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=512, tie_word_embeddings=tied, rms_norm_eps=1e-6,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  **(config_extra or {}))
    cfg = LlamaConfig(**common) if arch == "llama" else Qwen3Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    rng = np.random.default_rng(seed)
    ternary = TERNARY_SUFFIXES if ternary_embeddings else tuple(
        s for s in TERNARY_SUFFIXES if s not in ("lm_head.weight", "embed_tokens.weight"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ternary):
                w = rng.standard_normal(p.shape).astype(np.float32) * 0.05
                p.copy_(torch.from_numpy(ternarize_absmax(w, TQ_GROUP)))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32)))
    model.to(torch.float16).save_pretrained(out_dir, safe_serialization=True)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out_dir
