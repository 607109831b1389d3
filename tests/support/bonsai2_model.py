"""A tiny "Bonsai 2" (Qwen3.5 text, Hadamard-rotated ternary) built locally, plus an independent reference
writer of PrismML's file layouts: the ``qwen35`` GGUF (PQ2_0 / PTQ1_0 + ``prism.hadamard.*``) and the MLX
Bonsai 2 pack (docs/formats.md#pq2_0, docs/formats.md#ptq1_0, docs/formats.md#bonsai2-rotation, docs/formats.md#prism-qwen35-conventions, docs/formats.md#bonsai2-mlx-pack).

Everything here is written from docs/formats.md (docs/formats.md#bonsai2-rotation, docs/formats.md#prism-qwen35-conventions) with NumPy and the PyPI ``gguf`` writer — never with ternary_rs —
so the tests compare ternary_rs against an independent reference.

How the rotated weights stay exactly ternary: the *stored* weight ``W'`` (ternary codes × fp16 group scale)
is generated directly; the dense model transformers runs is ``W = W'·H·D`` (per row: normalized blockwise
WHT, then times the signs). Then ``W'·(H·D·x) = W·x`` exactly, since ``H·D·D·H = I``. Embedding rows are
stored inverse-rotated: the model's embedding ``e = WHT(E'_row)·s``, again ``E'·H·D``.

The GGUF uses PrismML's conventions: norms stored as ``w + 1`` (except ``ssm_norm``), ``ssm_a = -exp(A_log)``,
GDN value heads in llama.cpp's *tiled* order on ``attn_qkv`` (V rows), ``attn_gate``, ``ssm_alpha/beta``,
``ssm_dt``, ``ssm_a`` and the conv1d V channels, while ``ssm_out`` stays in the *grouped* basis it was rotated
in (so llama.cpp needs the GDN permutation of its tiled activation: ``gdn_v_grouped = true``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .models import train_tokenizer

GDN = "linear_attn"
# HF module suffix → GGUF tensor suffix (qwen35, gguf-py constants).
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.out_proj": "ssm_out",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
}
# Ternary + rotated in Bonsai 2 (the 401 `weight_names` of the real file are exactly these kinds + output).
ROTATED = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
)
GGML_F32 = 0
GGML_PQ2_0 = 142
GGML_PTQ1_0 = 143
QK = 128


# ------------------------------------------------------------------------------------------------------
# Plain NumPy references of the math and the codecs
# ------------------------------------------------------------------------------------------------------


def wht_rows(w: np.ndarray, block: int) -> np.ndarray:
    """Normalized blockwise Sylvester WHT of each row (float64), via scipy's Hadamard matrix."""
    from scipy.linalg import hadamard

    h = hadamard(block).astype(np.float64) / math.sqrt(block)
    w = np.asarray(w, dtype=np.float64)
    return (w.reshape(*w.shape[:-1], -1, block) @ h.T).reshape(w.shape)


def unrotate(w_stored: np.ndarray, signs: np.ndarray, block: int) -> np.ndarray:
    """Dense weight of a stored rotated one: ``W = W'·H·D`` (row: WHT then ·s)."""
    return wht_rows(w_stored, block) * signs.astype(np.float64)


def random_ternary(rng, n: int, k: int, group: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Codes ``t ∈ {-1,0,1}`` [n, k] and fp16-exact group scales [n, k/group] (one +-1 per group kept)."""
    t = rng.choice(np.array([-1, 0, 1], dtype=np.int8), size=(n, k), p=[0.3, 0.4, 0.3])
    t[:, ::group] = rng.choice(np.array([-1, 1], dtype=np.int8), size=(n, k // group))  # absmax = scale
    d = (scale * (0.75 + 0.5 * rng.random((n, k // group)))).astype(np.float16)
    return t, d


def dequant(t: np.ndarray, d: np.ndarray, group: int) -> np.ndarray:
    return t.astype(np.float32) * np.repeat(d.astype(np.float32), group, axis=1)


def encode_q2(t: np.ndarray, d: np.ndarray) -> bytes:
    """The consecutive 2-bit codec of PQ2_0 / Q2_0 (§1.3.2): per block ``d f16`` + block/4 bytes, code = t+1
    at bits 2·(j%4) of byte j/4. The block is ``K / d.shape[1]`` values (128: 34-byte blocks, 64: 18-byte)."""
    n, k = t.shape
    qk = k // d.shape[1]
    codes = (t.astype(np.int16) + 1).astype(np.uint8).reshape(n, k // qk, qk // 4, 4)
    qs = codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)
    blocks = np.concatenate([d.astype("<f2").reshape(n, k // qk, 1).view(np.uint8), qs], axis=-1)
    assert blocks.shape[-1] == 2 + qk // 4
    return blocks.tobytes()


def encode_pq2_0(t: np.ndarray, d: np.ndarray) -> bytes:
    """PQ2_0 (id 142): per 128 values ``d f16`` + 32 bytes, code = t+1 at bits 2·(j%4) of byte j/4."""
    assert t.shape[1] == d.shape[1] * QK
    return encode_q2(t, d)


def _pack_base3(codes: np.ndarray) -> np.ndarray:
    """codes [..., m] (first most significant) → byte = ceil(v·256 / 3^m) (as TQ1_0 / PTQ1_0)."""
    m = codes.shape[-1]
    v = np.zeros(codes.shape[:-1], dtype=np.int64)
    for c in range(m):
        v = v * 3 + codes[..., c]
    if m == 4:
        v = v * 3
    return ((v * 256 + 242) // 243).astype(np.uint8)


def encode_ptq1_0(t: np.ndarray, d: np.ndarray) -> bytes:
    """PTQ1_0 (id 143): qs[24] (stages 16 and 8) + qh[2] + d f16 LAST, docs/formats.md#ptq1_0."""
    n, k = t.shape
    c = (t.astype(np.int64) + 1).reshape(n, k // QK, QK)
    # values 0..79: value n*16 + m is trit n of qs[m]
    qs0 = _pack_base3(c[..., :80].reshape(n, k // QK, 5, 16).transpose(0, 1, 3, 2))
    # values 80..119: value 80 + n*8 + m is trit n of qs[16+m]
    qs1 = _pack_base3(c[..., 80:120].reshape(n, k // QK, 5, 8).transpose(0, 1, 3, 2))
    # values 120..127: value 120 + n*2 + h is trit n of qh[h]
    qh = _pack_base3(c[..., 120:].reshape(n, k // QK, 4, 2).transpose(0, 1, 3, 2))
    dd = d.astype("<f2").reshape(n, k // QK, 1).view(np.uint8)
    blocks = np.concatenate([qs0, qs1, qh, dd], axis=-1)
    assert blocks.shape[-1] == 28
    return blocks.tobytes()


def vperm(nv: int, nk: int, unit: int) -> np.ndarray:
    """docs/formats.md#gdn-head-order: grouped = tiled[vperm]; tiled = grouped[argsort(vperm)]."""
    return np.arange(nv * unit).reshape(nv // nk, nk, unit).transpose(1, 0, 2).ravel()


def to_tiled(x: np.ndarray, nv: int, nk: int, unit: int, axis: int = 0) -> np.ndarray:
    return np.take(x, np.argsort(vperm(nv, nk, unit)), axis=axis)


# ------------------------------------------------------------------------------------------------------
# The tiny model
# ------------------------------------------------------------------------------------------------------


@dataclass
class Bonsai2Tiny:
    hf_dir: Path  # dense, unrotated reference (float32) + tokenizer — what transformers runs
    config: dict  # HF text config (model_type qwen3_5_text)
    block_size: int
    group_size: int
    signs: dict[int, np.ndarray]  # input width → int8 ±1
    stored: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # HF name → (t, d) W'
    dense: dict[str, np.ndarray] = field(default_factory=dict)  # other HF tensors (float32, HF convention)
    unrotated: set[str] = field(default_factory=set)  # stored ternary names that carry no rotation
    # MTP head (``mtp.*``, vLLM / Hugging Face Qwen3.5 names): the dense unrotated weights it stands for.
    mtp_reference: dict[str, np.ndarray] = field(default_factory=dict)
    sign_mode: str = "explicit"  # "identity": every sign is +1 and the GGUF carries no sign arrays

    @property
    def rotated_names(self) -> list[str]:
        return sorted(n for n in self.stored if not n.endswith("embed_tokens.weight") and n not in self.unrotated)

    @property
    def inverse_names(self) -> list[str]:
        return [n for n in self.stored if n.endswith("embed_tokens.weight")]

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def mtp_layers(self) -> int:
        return int(self.config.get("mtp_num_hidden_layers") or 0) if self.mtp_reference else 0


def build_bonsai2_tiny(
    out_dir: Path,
    block_size: int = 128,
    group_size: int = 128,
    seed: int = 0,
    hidden: int = 256,
    intermediate: int = 768,
    num_layers: int = 4,
    tie_word_embeddings: bool = False,
    mtp_layers: int = 0,
    sign_mode: str = "explicit",
    layer_types: list[str] | None = None,
    linear_scale: float = 1.6,
    mtp_fc: str = "random",
    lm_head: str = "random",
    mtp_linear_scale: float | None = None,
) -> Bonsai2Tiny:
    """Random Qwen3.5-text model (3 GDN + 1 full-attention layer) whose ternary weights are stored rotated.

    ``tie_word_embeddings``: no ``lm_head``; the (inverse-rotated) embedding is also the output head, as in a
    ``prism.hadamard.version = 2`` / ``tied_output`` file. ``mtp_layers``: that many multi-token-prediction
    layers (``mtp.fc``, ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.layers.N.*`` (full attention),
    ``mtp.norm``) — transformers' Qwen3.5 has no MTP module, so their dense weights are kept in
    ``mtp_reference`` for a reference forward built from transformers' decoder layer (see
    :func:`mtp_reference_logits`). Linears are ternary (the layer's rotated like the decoder's, ``fc``
    unrotated), norms dense. ``sign_mode="identity"``: the rotation has no sign flips (s = 1).

    ``linear_scale``: ternary linear layers get group scales ≈ ``linear_scale / sqrt(K)``; small values make the
    model nearly a bigram map (the embedding dominates the residual stream). ``mtp_fc="embedding"``: the MTP
    ``fc`` is ``[I | 0]`` (it passes the normed embedding of the next token through), which with a small
    ``linear_scale`` makes the MTP head predict what the main model predicts one step later — a head whose
    drafts are often accepted, so acceptance is a meaningful number. ``lm_head="permuted_embedding"``: the head
    is the embedding with rows permuted by one long cycle π (stored ``W' = E'[π⁻¹]``, ternary like the
    rest), so the model's next token is decisively π(current token) up to what its layers add — large logit
    margins, immune to bf16 near-ties, while still a non-trivial sequence. ``mtp_linear_scale``: the MTP
    layer's ``linear_scale`` (default: the decoder's); larger values make its drafts deviate more often.
    """
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out_dir)
    cfg = Qwen3_5TextConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    )
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    if layer_types is not None:
        cfg.layer_types = list(layer_types)
    if mtp_layers:
        cfg.mtp_num_hidden_layers = mtp_layers
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).to(torch.float32).eval()
    rng = np.random.default_rng(seed)
    widths = sorted({hidden, intermediate, cfg.linear_num_value_heads * cfg.linear_value_head_dim})
    signs = {w: rng.choice(np.array([-1, 1], dtype=np.int8), size=w) for w in widths}
    if sign_mode == "identity":
        signs = {w: np.ones(w, dtype=np.int8) for w in widths}
    m = Bonsai2Tiny(out_dir, {}, block_size, group_size, signs, sign_mode=sign_mode)
    if lm_head == "permuted_embedding":  # own generator: the default model's random stream is unchanged
        order = np.random.default_rng(seed + 1).permutation(cfg.vocab_size)
        cycle = np.empty(cfg.vocab_size, dtype=np.int64)
        cycle[order] = np.roll(order, -1)  # π: order[i] -> order[i+1], one cycle through the whole vocabulary
        cycle_inverse = np.argsort(cycle)  # head row v = embedding row π⁻¹(v)

    def fill(name: str, shape: tuple[int, ...], rotated: bool = True) -> np.ndarray:
        """Random weight of HF tensor ``name``; ternary ones are recorded as stored ``W'`` (``m.stored``)."""
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight" or name == "mtp.fc.weight" or any(
            name.endswith(s + ".weight") for s in ROTATED
        ):
            n, k = shape
            layer_scale = mtp_linear_scale if name.startswith("mtp.") and mtp_linear_scale else linear_scale
            scale = 0.5 if "embed" in name else (1.6 if name == "lm_head.weight" else layer_scale) / math.sqrt(k)
            t, d = random_ternary(rng, n, k, group_size, scale)
            if name == "lm_head.weight" and lm_head == "permuted_embedding":
                te, de = m.stored["model.embed_tokens.weight"]
                t, d = te[cycle_inverse], de[cycle_inverse]
            if name == "mtp.fc.weight" and mtp_fc == "embedding":
                t = np.zeros((n, k), dtype=np.int8)
                t[np.arange(n), np.arange(n)] = 1  # fc([e, h]) = e
                d = np.ones_like(d)
            m.stored[name] = (t, d)
            if not rotated:
                m.unrotated.add(name)
                return dequant(t, d, group_size)
            return unrotate(dequant(t, d, group_size), signs[k], block_size).astype(np.float32)
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
            w = rng.standard_normal(shape) * 0.5 / math.sqrt(shape[1])
        elif name.endswith("A_log"):
            w = np.log(rng.uniform(1.0, 8.0, shape))
        elif name.endswith("dt_bias"):
            w = rng.uniform(-1.0, 1.0, shape)
        elif name.endswith("conv1d.weight"):
            w = rng.standard_normal(shape) * 0.4
        elif name.endswith("linear_attn.norm.weight"):  # plain RMSNormGated weight (≈1)
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "norm" in name:  # Qwen3.5 RMSNorm computes x·(1 + w)
            w = 0.1 * rng.standard_normal(shape)
        else:
            raise AssertionError(f"unexpected parameter {name}")
        w = np.asarray(w, dtype=np.float32)
        m.dense[name] = w
        return w

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(fill(name, tuple(p.shape))))
        if mtp_layers:
            from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

            full = cfg.layer_types.index("full_attention")
            m.mtp_reference["mtp.fc.weight"] = fill("mtp.fc.weight", (hidden, 2 * hidden), rotated=False)
            for norm in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
                m.mtp_reference[norm] = fill(norm, (hidden,))
            for j in range(mtp_layers):
                layer = Qwen3_5DecoderLayer(cfg, full)  # a full-attention layer's parameter set
                for name, p in layer.named_parameters():
                    hf = f"mtp.layers.{j}.{name}"
                    m.mtp_reference[hf] = fill(hf, tuple(p.shape))
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "do_sample": False})
    )
    m.config = json.loads((out_dir / "config.json").read_text())
    if mtp_layers:
        m.config["mtp_num_hidden_layers"] = mtp_layers
    return m


def mtp_reference_logits(m: Bonsai2Tiny, ref_model, sequence: list[int]):
    """What the MTP head predicts at every position of ``sequence``, teacher-forced (float32, torch).

    Row ``i`` is the distribution for token ``i + 2`` from the main model's final (normed) hidden state at
    ``i`` and the embedding of token ``i + 1`` — the draft vLLM's ``qwen3_5_mtp`` proposes after position
    ``i`` (Qwen3.5 MTP: ``fc([enorm(embed(x_{i+1})), hnorm(h_i)])`` → full-attention decoder layer →
    ``norm`` → the shared ``lm_head``). Built from transformers' ``Qwen3_5DecoderLayer`` and RMSNorm with the
    dense unrotated ``m.mtp_reference`` weights; never from ternary_rs or vLLM.
    """
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    cfg = ref_model.config
    cfg._attn_implementation = "sdpa"
    w = {k: torch.from_numpy(v) for k, v in m.mtp_reference.items()}
    hidden = cfg.hidden_size

    def norm(name):
        n = Qwen3_5RMSNorm(hidden, eps=cfg.rms_norm_eps)
        n.weight.data.copy_(w[name])
        return n

    ids = torch.tensor([sequence])
    with torch.no_grad():
        out = ref_model.model(ids)
        h = out.last_hidden_state[:, :-1]  # h_i for i < L-1
        e = ref_model.model.embed_tokens(ids[:, 1:])  # token i+1
        x = torch.cat([norm("mtp.pre_fc_norm_embedding.weight")(e), norm("mtp.pre_fc_norm_hidden.weight")(h)], -1)
        x = x @ w["mtp.fc.weight"].T
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        pos_emb = ref_model.model.rotary_emb(x, positions)
        full = cfg.layer_types.index("full_attention")
        for j in range(m.mtp_layers):
            layer = Qwen3_5DecoderLayer(cfg, full).eval()
            layer.load_state_dict({k[len(f"mtp.layers.{j}."):]: v for k, v in w.items()
                                   if k.startswith(f"mtp.layers.{j}.")})
            x = layer(x, position_embeddings=pos_emb, attention_mask=None, position_ids=positions)
            x = x[0] if isinstance(x, tuple) else x
        x = norm("mtp.norm.weight")(x)
        return ref_model.lm_head(x)[0]


def expected_mtp_acceptance(draft_tokens: list[int], sequence: list[int], prompt_len: int,
                            max_tokens: int) -> tuple[int, int]:
    """``(drafts, accepted)`` of greedy decoding with one speculative token, from the drafts the MTP head
    makes teacher-forced (``draft_tokens[i]`` = argmax of :func:`mtp_reference_logits` row ``i``).

    After the token at ``i + 1`` is known, the head drafts token ``i + 2`` from the hidden state at ``i``; the
    target verifies it: accepted → two new tokens, next draft from ``i + 2``; rejected → one, next from
    ``i + 1``. Drafting continues while fewer than ``max_tokens`` tokens are out (the first comes from the
    prefill). The greedy sequence does not depend on acceptance, so it is the non-speculative one."""
    i, out, drafts, accepted = prompt_len - 1, 1, 0, 0
    while out < max_tokens:
        drafts += 1
        if draft_tokens[i] == sequence[i + 2]:
            accepted, out, i = accepted + 1, out + 2, i + 2
        else:
            out, i = out + 1, i + 1
    return drafts, accepted


# ------------------------------------------------------------------------------------------------------
# PrismML qwen35 GGUF writer (reference)
# ------------------------------------------------------------------------------------------------------

# Ternary GGUF types: (encoder, ggml type id, values per block). Id 42 is two formats (docs/formats.md#prism-gguf-types):
# the first-generation fork "Q2_0" (128-value, 34-byte blocks; what ternary_rs reports as Q2_0_G128) and
# upstream Q2_0 / PrismML's ``*-Q2_g64.gguf`` (64-value, 18-byte blocks).
GGUF_QTYPES = {
    "PQ2_0": (encode_q2, GGML_PQ2_0, 128),
    "PTQ1_0": (encode_ptq1_0, GGML_PTQ1_0, 128),
    "Q2_0_G128": (encode_q2, 42, 128),
    "Q2_0": (encode_q2, 42, 64),
}
# llama.cpp's names of the MTP ("nextn") tensors of block L = num_hidden_layers (gguf-py MODEL_TENSOR.NEXTN_*;
# convert_hf_to_gguf maps mtp.fc → eh_proj, pre_fc_norm_embedding → enorm, pre_fc_norm_hidden → hnorm,
# norm → shared_head.norm and mtp.layers.j.* to the regular names of block L + j).
NEXTN_NAMES = {
    "mtp.fc": "nextn.eh_proj",
    "mtp.pre_fc_norm_embedding": "nextn.enorm",
    "mtp.pre_fc_norm_hidden": "nextn.hnorm",
    "mtp.norm": "nextn.shared_head_norm",
}


def gguf_name(hf_name: str, num_layers: int = 0) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base == "model.embed_tokens":
        return "token_embd." + suffix
    if base == "model.norm":
        return "output_norm." + suffix
    if base == "lm_head":
        return "output." + suffix
    if base in NEXTN_NAMES:
        return f"blk.{num_layers}.{NEXTN_NAMES[base]}.{suffix}"
    parts = base.split(".")  # model.layers.N.<module...> | mtp.layers.j.<module...>
    if parts[0] == "mtp":
        layer, module = num_layers + int(parts[2]), ".".join(parts[3:])
        return f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}"
    if hf_name.endswith("linear_attn.A_log"):
        return f"blk.{hf_name.split('.')[2]}.ssm_a"
    if hf_name.endswith("linear_attn.dt_bias"):
        return f"blk.{hf_name.split('.')[2]}.ssm_dt.bias"
    layer, module = parts[2], ".".join(parts[3:])
    return f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}"


def _tiled_rows(m: Bonsai2Tiny, name: str, rows: np.ndarray) -> np.ndarray:
    """Reorder GDN V-side rows (axis 0) from HF grouped to llama.cpp tiled order."""
    c = m.config
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        qk = 2 * nk * dk
        return np.concatenate([rows[:qk], to_tiled(rows[qk:], nv, nk, dv)], axis=0)
    if name.endswith("in_proj_z.weight"):
        return to_tiled(rows, nv, nk, dv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return to_tiled(rows, nv, nk, 1)
    return rows


def write_prism_gguf(m: Bonsai2Tiny, path: Path, qtype: str = "PQ2_0", hadamard: bool = True,
                     overrides: dict | None = None, copies: dict[str, str] | None = None) -> Path:
    """Write ``m`` as PrismML's ``qwen35`` GGUF with ternary tensors of ``qtype`` (PQ2_0, PTQ1_0, the
    first-generation id-42 ``Q2_0_G128`` or upstream g64 ``Q2_0``). ``overrides`` replaces metadata keys
    (a value of ``None`` leaves the key out); ``copies`` adds tensors: GGUF name → HF name whose data it holds."""
    import gguf

    encode, type_id, block = GGUF_QTYPES[qtype]
    assert m.group_size % block == 0, f"a g{m.group_size} model cannot be written as {qtype} (block {block})"
    c = m.config
    arch = "qwen35"
    n_mtp = m.mtp_layers
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", c["num_hidden_layers"] + n_mtp)
    if n_mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", n_mtp)
    w.add_uint32(f"{arch}.context_length", c["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", c["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", c["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", c["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", c["num_key_value_heads"])
    w.add_uint32(f"{arch}.attention.key_length", c["head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", c["head_dim"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    rope = c["rope_parameters"]
    w.add_uint32(f"{arch}.rope.dimension_count", int(c["head_dim"] * rope["partial_rotary_factor"]))
    w.add_array(f"{arch}.rope.dimension_sections", list(rope["mrope_section"]) + [0])
    w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    w.add_uint32(f"{arch}.ssm.conv_kernel", c["linear_conv_kernel_dim"])
    w.add_uint32(f"{arch}.ssm.state_size", c["linear_key_head_dim"])
    w.add_uint32(f"{arch}.ssm.group_count", c["linear_num_key_heads"])
    w.add_uint32(f"{arch}.ssm.time_step_rank", c["linear_num_value_heads"])
    w.add_uint32(f"{arch}.ssm.inner_size", c["linear_num_value_heads"] * c["linear_value_head_dim"])
    w.add_uint32(f"{arch}.full_attention_interval", 4)
    w.add_string("general.name", "Tiny-Ternary-Bonsai-2")
    _add_tokenizer(w, m.hf_dir)
    if hadamard:
        kv = prism_metadata(m)
        kv.update(overrides or {})
        for key, (value, vtype, sub) in kv.items():
            if value is None:
                continue
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, value, vtype, sub_type=sub)
            else:
                w.add_key_value(key, value, vtype)
    tensors = []
    for name in _hf_order(m):
        gname = gguf_name(name, m.num_layers)
        if name in m.stored:
            t, d = m.stored[name]
            d = np.repeat(d, m.group_size // block, axis=1)  # a g128 scale repeated per 64-value block
            t, d = _tiled_rows(m, name, t), _tiled_rows(m, name, d)
            tensors.append((gname, t.shape, type_id, encode(t, d)))
            continue
        x = m.dense[name].astype(np.float32)
        if name.endswith("A_log"):
            x = -np.exp(x)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + 1.0
        elif name.endswith("conv1d.weight"):
            x = x[:, 0, :]  # [C, 1, K] → [C, K] (GGUF ne = [K, C])
        x = np.ascontiguousarray(_tiled_rows(m, name, x), dtype=np.float32)
        tensors.append((gname, x.shape, GGML_F32, x.tobytes()))
    by_name = {gname: (shape, tid, data) for gname, shape, tid, data in tensors}
    for gname, hf in (copies or {}).items():
        tensors.append((gname, *by_name[gguf_name(hf, m.num_layers)]))
    for gname, shape, tid, data in tensors:
        w.add_tensor_info(gname, list(shape), np.float32, len(data), raw_dtype=tid)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, data in tensors:
        w.write_tensor_data(np.frombuffer(data, dtype=np.uint8))
    w.close()
    return Path(path)


def _hf_order(m: Bonsai2Tiny) -> list[str]:
    names = list(m.stored) + list(m.dense)

    def key(n):
        parts = n.split(".")
        if parts[0] == "mtp":
            return (10**6 + (int(parts[2]) if parts[1] == "layers" else -1), n)
        return (int(parts[2]) if parts[1] == "layers" else (-1 if "embed" in n else 10**7), n)

    return sorted(names, key=key)


def prism_metadata(m: Bonsai2Tiny) -> dict:
    """``prism.hadamard.*`` as PrismML writes it: key → (value, GGUF type, array subtype). A tied model
    gets version 2 with ``tied_output = true`` (no ``output.weight``; ``token_embd`` is also the head)."""
    import gguf

    V = gguf.GGUFValueType
    widths = sorted(m.signs)
    tied = bool(m.config.get("tie_word_embeddings"))
    kv = {
        "prism.hadamard.version": (2 if tied else 1, V.UINT32, None),
        "prism.hadamard.transform": ("normalized-sylvester-walsh-hadamard", V.STRING, None),
        "prism.hadamard.axis": ("input-last-dimension", V.STRING, None),
        "prism.hadamard.sign_mode": (m.sign_mode, V.STRING, None),
        "prism.hadamard.block_size": (m.block_size, V.UINT32, None),
        "prism.hadamard.sign_widths": (widths, V.ARRAY, V.UINT32),
        "prism.hadamard.sign_values": ([int(v) for w_ in widths for v in m.signs[w_]], V.ARRAY, V.INT8),
        "prism.hadamard.weight_names": ([gguf_name(n, m.num_layers) for n in m.rotated_names], V.ARRAY, V.STRING),
        "prism.hadamard.inverse_weight_names": ([gguf_name(n, m.num_layers) for n in m.inverse_names], V.ARRAY,
                                                V.STRING),
        "prism.hadamard.gdn_v_grouped": (True, V.BOOL, None),
    }
    if tied:
        kv["prism.hadamard.tied_output"] = (True, V.BOOL, None)
    if m.sign_mode == "identity":  # no sign arrays at all
        kv["prism.hadamard.sign_widths"] = kv["prism.hadamard.sign_values"] = (None, None, None)
    return kv


def _add_tokenizer(w, hf_dir: Path) -> None:
    tj = json.loads((Path(hf_dir) / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    special = {a["content"]: a["id"] for a in tj.get("added_tokens", [])}
    merges = [" ".join(mm) if isinstance(mm, list) else mm for mm in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(special["<|im_end|>"])
    w.add_pad_token_id(special["<|endoftext|>"])
    w.add_add_bos_token(False)


# ------------------------------------------------------------------------------------------------------
# MLX Bonsai 2 pack (reference, §1.4(c))
# ------------------------------------------------------------------------------------------------------


def write_mlx_pack(m: Bonsai2Tiny, out_dir: Path) -> Path:
    """``model_type: prism_hadamard_qwen35`` pack: affine 2-bit (scale = d, bias = -d), grouped GDN layout."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, modules = {}, []
    for name in _hf_order(m):
        mlx = "language_model." + name  # mlx-vlm qwen3_5 namespace: language_model.model.layers.…
        if name in m.stored:
            t, d = m.stored[name]
            n, k = t.shape
            codes = (t.astype(np.uint32) + 1).reshape(n, k // 16, 16)
            words = np.zeros((n, k // 16), dtype=np.uint32)
            for j in range(16):
                words |= codes[..., j] << np.uint32(2 * j)
            base = mlx[: -len(".weight")]
            tensors[base + ".weight"] = words
            tensors[base + ".scales"] = d.astype(np.float16)
            tensors[base + ".biases"] = (-d).astype(np.float16)
            tensors[base + ".signs"] = m.signs[k].astype(np.float16)
            is_emb = name.endswith("embed_tokens.weight")
            modules.append({"path": base[len("language_model."):], "block": m.block_size,
                            "embedding": is_emb, "dtype": "float16"})
        else:
            x = m.dense[name]
            if name.endswith("conv1d.weight"):
                x = np.transpose(x, (0, 2, 1))  # MLX conv1d weight is [C, K, 1]
            elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                x = x + 1.0  # mlx-lm's Qwen3.5 sanitize stores the (1 + w) norms shifted [guess, as llama.cpp]
            tensors[mlx] = np.ascontiguousarray(x.astype(np.float16))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "mlx"})
    text = {k: v for k, v in m.config.items() if k not in ("architectures", "transformers_version", "dtype")}
    text["model_type"] = "qwen3_5_text"
    cfg = {
        "schema_version": 2,
        "model_type": "prism_hadamard_qwen35",
        "base_model_type": "qwen3_5",
        "requires_runtime": "runtime/artifact.py",
        "hadamard_config": "hadamard.json",
        "tensor_namespace": "mlx-vlm-qwen3_5",
        "gdn_activation_layout": "grouped",
        "quantization": {"bits": 2, "group_size": m.group_size, "mode": "affine"},
        "modules": modules,
        "text_config": text,
    }
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    widths = sorted(m.signs)
    had = {
        "version": 1,
        "transform": "normalized-sylvester-walsh-hadamard",
        "axis": "input-last-dimension",
        "sign_mode": "explicit",
        "block_size": m.block_size,
        "sign_widths": widths,
        "sign_values": [int(v) for w_ in widths for v in m.signs[w_]],
        "weight_names": ["language_model." + n for n in m.rotated_names],
        "inverse_weight_names": ["language_model." + n for n in m.inverse_names],
        "gdn_v_grouped": True,
    }
    (out_dir / "hadamard.json").write_text(json.dumps(had))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (m.hf_dir / f).exists():
            (out_dir / f).write_bytes((m.hf_dir / f).read_bytes())
    return out_dir


if __name__ == "__main__":
    import sys
    import tempfile

    d = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    tiny = build_bonsai2_tiny(d / "hf")
    write_prism_gguf(tiny, d / "tiny-PQ2_0.gguf", "PQ2_0")
    write_prism_gguf(tiny, d / "tiny-PTQ1_0.gguf", "PTQ1_0")
    write_mlx_pack(tiny, d / "mlx")
    print(d, sorted(p.name for p in d.iterdir()))
