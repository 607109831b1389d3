"""Tiny local ``BitNetForCausalLM`` checkpoints (no hub access), written the way Microsoft's are:

* the **master** variant (like ``microsoft/bitnet-b1.58-2B-4T-bf16``): dense float linear weights and
  ``quantization_config = {quant_method: bitnet, linear_class: autobitlinear, quantization_mode: online}``,
  so transformers ternarizes them at every forward with its ``WeightQuant``;
* the **packed** variant (like ``microsoft/bitnet-b1.58-2B-4T``): every linear weight ternarized by
  transformers' own ``WeightQuant`` formula, packed with transformers' own ``pack_weights`` (uint8
  ``[N/4, K]``) plus a ``weight_scale`` in the convention of ``linear_class`` (``autobitlinear``: the
  absmean, multiplied; ``bitlinear``: its reciprocal, divided by), ``quantization_mode: offline``.

Both load in transformers' own BitNet implementation (the reference of the tests). Deterministic per seed.
"""

from __future__ import annotations

import json
from pathlib import Path

from .models import train_tokenizer

LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def weight_quant(w):
    """transformers' ``WeightQuant.forward`` (integrations/bitnet.py), uncompiled: ``(trits, 1/s)`` in f32
    with ``s = 1 / max(mean|W|, 1e-5)``, ``trits = clamp(round(W·s), -1, 1)``."""

    wf = w.float()
    scale = 1.0 / wf.abs().mean().clamp_(min=1e-5)
    return (wf * scale).round().clamp(-1, 1), 1.0 / scale


def bitnet_config(tok, *, hidden, intermediate, layers, heads, kv_heads, tie, attention_bias=False, dtype):
    from transformers import BitNetConfig

    return BitNetConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        tie_word_embeddings=tie, attention_bias=attention_bias, rms_norm_eps=1e-5,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        dtype=dtype,
    )


def build_tiny_bitnet(out_dir: Path, *, packed: bool = True, linear_class: str = "autobitlinear",
                      dtype: str = "float32", tie_word_embeddings: bool = True, seed: int = 0,
                      hidden: int = 256, intermediate: int = 512, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, attention_bias: bool = False) -> Path:
    """Write a random tiny BitNet checkpoint (packed or master) to ``out_dir``; returns ``out_dir``.

    ``hidden``/``intermediate`` default to multiples of 256 so that TP=2 row-parallel shards hold whole
    groups of 128 (and TQ*_0 blocks of 256 fit the rows)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import BitNetForCausalLM
    from transformers.integrations.bitnet import pack_weights

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out_dir)
    cfg = bitnet_config(tok, hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
                        kv_heads=kv_heads, tie=tie_word_embeddings, attention_bias=attention_bias, dtype=dtype)
    torch.manual_seed(seed)
    model = BitNetForCausalLM(cfg).to(torch.float32)
    rng = np.random.default_rng(seed)
    state = {}
    for name, p in model.state_dict().items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        if "norm" in name:
            w = 1.0 + 0.1 * rng.standard_normal(p.shape)
        elif name.endswith("bias"):
            w = 0.02 * rng.standard_normal(p.shape)
        else:  # embeddings, lm_head and the master linear weights
            w = 0.05 * rng.standard_normal(p.shape)
        state[name] = torch.from_numpy(w.astype(np.float32)).to(getattr(torch, dtype))

    qc = {"quant_method": "bitnet", "linear_class": "autobitlinear" if not packed else linear_class,
          "quantization_mode": "offline" if packed else "online"}
    if packed:
        for name in [n for n in state if n.endswith(LINEAR_SUFFIXES)]:
            trits, absmean = weight_quant(state[name])
            state[name] = pack_weights(trits.to(torch.int8).clone())
            scale = absmean if linear_class == "autobitlinear" else 1.0 / absmean
            state[name + "_scale"] = scale.reshape(1).to(getattr(torch, dtype))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    config = cfg.to_dict()
    config["architectures"] = ["BitNetForCausalLM"]
    config["quantization_config"] = qc
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out_dir


def load_reference(model_dir: Path, dtype: str = "float32"):
    """transformers' own BitNet on ``model_dir`` (CPU, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


# ------------------------------------------------------------------------------------------ bitnet.cpp GGUF
# bitnet.cpp's I2_S (docs/formats.md#i2_s, x86 ACT_PARALLEL layout): GGUF type id 36, one f32 scale per tensor.
I2_S_TYPE_ID = 36
I2_S_BLOCK = 128


def encode_i2_s(trits, scale: float):
    """docs/formats.md#i2_s, written here from the spec: codes ``t + 1``; per 128-value block 32 bytes with
    value ``j`` in byte ``j % 32`` at bits ``6 - 2·(j // 32)``; then a 32-byte tail holding the f32 scale
    (bitnet.cpp's converter writes it 8 times: ``np.tile(i2_scale, 8)``)."""
    import numpy as np

    codes = (np.asarray(trits).astype(np.int16) + 1).astype(np.uint8).reshape(-1, 4, 32)  # [block, j//32, j%32]
    shifts = (6 - 2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)
    packed = np.bitwise_or.reduce(codes << shifts, axis=1).astype(np.uint8).reshape(-1)
    tail = np.tile(np.array([scale], "<f4"), 8).view(np.uint8)
    return np.concatenate([packed, tail])


def write_bitnet_gguf(hf_dir: Path, out_path: Path, linear_type: str = "I2_S", arch: str = "bitnet",
                      magnitude_of=None) -> Path:
    """A bitnet.cpp-style GGUF of a *packed* tiny checkpoint, written with gguf-py: llama.cpp's BitNet tensor
    names (``blk.N.attn_sub_norm`` / ``blk.N.ffn_sub_norm``), linear weights as ``linear_type`` (I2_S from
    :func:`encode_i2_s`, TQ1_0 / TQ2_0 by gguf-py's own quantizers, or F16 / F32 ``t · magnitude`` as
    llama.cpp's own BitNet converter writes them), norms F32, embeddings BF16, the
    tokenizer as gpt2 BPE metadata. The trits come from transformers' ``unpack_weights``."""
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from transformers.integrations.bitnet import unpack_weights

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    linear_class = cfg["quantization_config"]["linear_class"]
    tensors = load_file(str(hf_dir / "model.safetensors"))
    n_layers = cfg["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BITNET, n_layers)
    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_name("tiny-bitnet")
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_vocab_size(cfg["vocab_size"])
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    vocab = {i: t for t, i in tok.get_vocab().items()}
    tokens = [vocab[i] for i in range(cfg["vocab_size"])]
    special = set(tok.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t in tokens])
    gguf.SpecialVocab(str(hf_dir), load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)

    data = []
    for name, t in tensors.items():
        if name.endswith("weight_scale"):
            continue
        if name.endswith(".attn_sub_norm.weight") or name.endswith(".ffn_sub_norm.weight"):
            bid = int(name.split(".")[2])
            kind = gguf.MODEL_TENSOR.ATTN_SUB_NORM if "attn_sub_norm" in name else gguf.MODEL_TENSOR.FFN_SUB_NORM
            gname = gguf.TENSOR_NAMES[kind].format(bid=bid) + ".weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if name.endswith(LINEAR_SUFFIXES):
            trits = unpack_weights(t, dtype=torch.float32)
            ws = float(tensors[name + "_scale"].float())
            magnitude = ws if linear_class == "autobitlinear" else 1.0 / ws
            if magnitude_of is not None:  # tests: a magnitude that is not an fp16 value
                magnitude = magnitude_of(magnitude)
            n, k = trits.shape
            if linear_type == "I2_S":
                raw = encode_i2_s(trits.numpy(), magnitude)
                w.add_tensor_info(gname, (n, k), np.dtype(np.float32), raw.nbytes, raw_dtype=I2_S_TYPE_ID)
            elif linear_type in ("F16", "F32"):  # llama.cpp's convert_hf_to_gguf BitnetModel: t · mean, dense
                raw = (trits * magnitude).numpy().astype(np.float16 if linear_type == "F16" else np.float32)
                w.add_tensor_info(gname, raw.shape, raw.dtype, raw.nbytes)
            else:
                qtype = getattr(gguf.GGMLQuantizationType, linear_type)
                raw = gguf.quants.quantize((trits * magnitude).numpy().astype(np.float32), qtype)
                w.add_tensor_info(gname, raw.shape, raw.dtype, raw.nbytes, raw_dtype=qtype)
        elif t.dim() == 1:
            raw = t.float().numpy()
            w.add_tensor_info(gname, raw.shape, raw.dtype, raw.nbytes)
        else:
            raw = t.to(torch.bfloat16).view(torch.uint8).numpy()
            w.add_tensor_info(gname, raw.shape, raw.dtype, raw.nbytes, raw_dtype=gguf.GGMLQuantizationType.BF16)
        data.append(raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for raw in data:
        w.write_tensor_data(raw)
    w.close()
    return Path(out_path)
