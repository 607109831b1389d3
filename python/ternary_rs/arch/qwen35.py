"""``qwen35`` — Ternary-Bonsai-2 ("Bonsai 2"): PrismML's Qwen3.5 hybrid GGUF and its MLX pack → vLLM.

Sources (docs/formats.md#ptq1_0, docs/formats.md#bonsai2-rotation, docs/formats.md#prism-qwen35-conventions, docs/formats.md#bonsai2-mlx-pack):

* a GGUF with ``general.architecture = qwen35``, ternary PQ2_0 / PTQ1_0 tensors and ``prism.hadamard.*``;
* an MLX directory with ``model_type: prism_hadamard_qwen35`` + ``hadamard.json``.

Also the way back: a ternary_rs Bonsai 2 checkpoint (``model_type qwen3_5_text``) or the MLX pack → a qwen35
GGUF (PQ2_0 / PTQ1_0 + ``prism.hadamard.*``, PrismML's tensor conventions restored), see :func:`_write_gguf`.

Output: a checkpoint for vLLM's text-only ``Qwen3_5ForCausalLM`` (``model_type: qwen3_5_text``) in
Hugging Face names (``model.layers.N.linear_attn.in_proj_qkv`` …; vLLM fuses q/k/v, gate/up, qkv/z and
b/a itself through its ``packed_modules_mapping``). What the GGUF stores differently is undone here:

* norms are stored as ``w + 1`` (except ``ssm_norm``): ``w = stored − 1``;
* ``ssm_a`` is ``A = −exp(A_log)``: ``A_log = log(−A)``;
* the GDN value heads of ``attn_qkv`` (V rows), ``attn_gate``, ``ssm_alpha/beta``, ``ssm_dt``, ``ssm_a`` and the
  conv1d V channels are in llama.cpp's *tiled* order: rows are gathered back into HF's *grouped* order;
* ``ssm_conv1d`` ``[C, K]`` becomes ``[C, 1, K]``.

The rotation stays in the weights (they are exactly ternary only in the rotated basis) and is described in
``quantization_config["hadamard"]`` (:class:`ternary_rs.core.hadamard.HadamardSpec`): the vLLM backend applies
``x → [GDN permutation] → ·s → FWHT`` before each listed layer and ``FWHT → ·s`` to the looked-up rows of the
inverse-rotated ternary embedding (which stays ternary: the plugin's Qwen3.5 model class builds
``embed_tokens`` with the quant config, :mod:`ternary_rs.vllm.qwen3_5`). A listed weight that the source
stores dense is un-rotated here instead (``W = W'·H·D``, float32) and dropped from the list.

Everything written dense is lossless: float tensors are written as float32 — the source's value exactly,
or the float32 result of the transform above (norm ``− 1``, ``log(−A)``, un-rotation) — never rounded to a
narrower type.
``ssm_out`` was rotated in the *grouped* head basis (``gdn_v_grouped = true``), which is the activation order
vLLM uses, so it needs no permutation in vLLM; a file saying ``false`` — or nothing: upstream's loader reads an
absent key as false — gets the grouped → tiled gather. Rotation version 2 with ``tied_output`` (no
``output.weight``) becomes ``tie_word_embeddings``.

MTP layers (``qwen35.nextn_predict_layers`` = n; ``block_count`` counts them; blocks L … L+n−1 after the L
decoder blocks, and the head's own ``blk.L.nextn.*``) become vLLM's ``qwen3_5_mtp`` names (``mtp.fc``,
``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.norm``, ``mtp.layers.j.*``; ``mtp_num_hidden_layers`` in the
config), ternary where the file is ternary and rotated where it lists them, so
``--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'`` serves them.

Ternary tensor types: PQ2_0, PTQ1_0, first-generation id-42 "Q2_0" (g128, reported as ``Q2_0_G128``),
upstream / ``*-Q2_g64`` Q2_0 (g64), TQ2_0, TQ1_0, STQ1_0; the checkpoint keeps the smallest native group.

A ``qwen35`` GGUF without ``prism.hadamard.*`` is taken as an ordinary (unrotated) model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from .._core import FormatError, UnsupportedTypeError, ValidationError
from ..core import hadamard as H
from ..core.formats import GGUF_TERNARY_GROUPS as ALL_GGUF_TERNARY_GROUPS
from ..core.formats import LLAMA_FILE_TYPES, gguf_output_types

# GGUF tensor kind → HF module (inside ``model.layers.N.``), the suffixes PrismML's qwen35 files use.
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
}
_BLOCK_KINDS = {v: k for k, v in BLOCK_TENSORS.items()}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Multi-token prediction (``<arch>.nextn_predict_layers`` = n; ``block_count`` counts them; docs/formats.md#mtp-layers):
# the MTP head's own tensors in block L = decoder blocks, as llama.cpp names them (gguf-py MODEL_TENSOR.NEXTN_*;
# convert_hf_to_gguf maps Qwen3.5's mtp.fc → eh_proj, pre_fc_norm_embedding → enorm, pre_fc_norm_hidden →
# hnorm, norm → shared_head.norm), → the names vLLM's qwen3_5_mtp loads. Its decoder layers are ordinary
# (full-attention) blocks L … L+n−1 → ``mtp.layers.0 … n−1``. Norms are stored ``w + 1`` like the others.
NEXTN_TENSORS = {
    "eh_proj": "mtp.fc",
    "enorm": "mtp.pre_fc_norm_embedding",
    "hnorm": "mtp.pre_fc_norm_hidden",
    "shared_head_norm": "mtp.norm",
}
DEDICATED_NEXTN = {"embed_tokens": "embedding", "shared_head_head": "output head"}
LINEAR_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "fc",
)
# Ternary GGUF types a qwen35 file may hold → native group size (docs/formats.md#prism-gguf-types). Id 42 is two formats, told
# apart by byte span in the container layer: the first-generation fork "Q2_0" (g128, 34-byte blocks) is
# reported as Q2_0_G128, upstream Q2_0 and PrismML's ``*-Q2_g64.gguf`` (g64, 18-byte blocks) as Q2_0.
GGUF_TERNARY_GROUPS = {name: ALL_GGUF_TERNARY_GROUPS[name]
                       for name in ("PQ2_0", "PTQ1_0", "Q2_0_G128", "Q2_0", "TQ2_0", "TQ1_0", "STQ1_0")}
GGUF_TERNARY_TYPES = tuple(GGUF_TERNARY_GROUPS)
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bfloat16"}
HF_ARCHITECTURE = "Qwen3_5ForCausalLM"
HF_MODEL_TYPE = "qwen3_5_text"
MLX_MODEL_TYPE = "prism_hadamard_qwen35"
MLX_PREFIX = "language_model."
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_NEXTN_RE = re.compile(r"^blk\.(\d+)\.nextn\.([a-z0-9_]+)\.weight$")


class Qwen35Arch:
    """Registry entry (see :mod:`ternary_rs.arch`); conversion goes through the whole-checkpoint hooks
    :meth:`write_vllm_checkpoint` and :meth:`write_gguf` (sources: PrismML GGUF, MLX pack, ternary_rs checkpoint)."""

    gguf_arch = "qwen35"
    hf_model_types = (MLX_MODEL_TYPE, HF_MODEL_TYPE)
    hf_architectures = ()
    default_tokenizer_pre = "qwen2"
    gguf_vocab = "qwen2"  # Qwen2-style byte-level BPE (tokenizer.model if present)

    # ---- names (also used by the generic tools, e.g. `inspect`) -----------------------------------------
    def hf_name(self, gguf_name: str, n_blocks: int | None = None) -> str | None:
        return gguf_to_hf(gguf_name, n_blocks)

    def gguf_name(self, hf_name: str, n_blocks: int | None = None) -> str | None:
        try:
            return hf_to_gguf(hf_name, n_blocks)
        except KeyError:
            return None

    def ternary_candidate(self, hf_name: str, shape) -> bool:
        return len(shape) == 2 and (
            hf_name.endswith(tuple(f"{m}.weight" for m in LINEAR_MODULES))
            or hf_name in ("model.embed_tokens.weight", "lm_head.weight")
        )

    def rows_from_gguf(self, hf_name, config, n_rows):
        return None  # the qwen35 hook applies its own (GDN) permutations

    def rows_to_gguf(self, hf_name, config, n_rows):
        return None

    def n_blocks_from_gguf(self, metadata: dict, arch: str) -> int:
        """Decoder blocks: ``block_count`` counts the MTP layers (``nextn_predict_layers``) appended after them."""
        return int(metadata.get(f"{arch}.block_count", 0)) - int(metadata.get(f"{arch}.nextn_predict_layers", 0) or 0)

    def config_fixups_from_gguf(self, config: dict, metadata: dict) -> None:
        return None

    def gguf_hparams(self, writer, config: dict) -> None:
        """``qwen35.*`` hyper-parameters of a Qwen3.5-text config on a ``gguf.GGUFWriter`` (inverse of
        :func:`_config_from_gguf`; the keys PrismML's files carry, docs/formats.md#prism-qwen35-conventions)."""
        n_layers = int(config["num_hidden_layers"])
        n_mtp = int(config.get("mtp_num_hidden_layers") or 0)
        head_dim = int(config["head_dim"])
        nv, dv = int(config["linear_num_value_heads"]), int(config["linear_value_head_dim"])
        rope = dict(config.get("rope_parameters") or {})
        writer.add_block_count(n_layers + n_mtp)
        if n_mtp:
            writer.add_nextn_predict_layers(n_mtp)
        writer.add_context_length(int(config["max_position_embeddings"]))
        writer.add_embedding_length(int(config["hidden_size"]))
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_head_count(int(config["num_attention_heads"]))
        writer.add_head_count_kv(int(config["num_key_value_heads"]))
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
        writer.add_rope_dimension_count(int(round(head_dim * float(rope.get("partial_rotary_factor", 1.0)))))
        if rope.get("mrope_section"):
            sections = [int(x) for x in rope["mrope_section"]]
            writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
        writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
        writer.add_ssm_conv_kernel(int(config["linear_conv_kernel_dim"]))
        writer.add_ssm_state_size(int(config["linear_key_head_dim"]))
        writer.add_ssm_group_count(int(config["linear_num_key_heads"]))
        writer.add_ssm_time_step_rank(nv)
        writer.add_ssm_inner_size(nv * dv)
        interval = _full_attention_interval(config.get("layer_types") or [])
        if interval:
            writer.add_full_attention_interval(interval)

    # ---- the conversions --------------------------------------------------------------------------------
    def write_vllm_checkpoint(self, src, out_dir: Path, options) -> None:
        _write(_plan_for(src, options), Path(out_dir), options)

    def write_gguf(self, src, out_path: Path, options) -> None:
        """A qwen35 GGUF (PQ2_0 / PTQ1_0 + ``prism.hadamard.*``) from a ternary_rs checkpoint or an MLX pack."""
        _write_gguf(_plan_for(src, options), Path(out_path), options)


def _plan_for(src, options) -> _Plan:
    if getattr(src, "format", None) == "gguf":
        return _plan_from_gguf(src, options)
    root = Path(getattr(src, "path", src))
    root = root if root.is_dir() else root.parent
    if json.loads((root / "config.json").read_text()).get("model_type") == MLX_MODEL_TYPE:
        return _plan_from_mlx(src, options)
    return _plan_from_checkpoint(src, options)


def _full_attention_interval(layer_types: list[str]) -> int | None:
    """``n`` when every n-th layer (and only those) is full attention, as ``full_attention_interval`` says."""
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    if not full:
        return None
    n = full[0] + 1
    return n if full == list(range(n - 1, len(layer_types), n)) else None


def gguf_to_hf(name: str, n_layers: int | None = None) -> str:
    """HF name of a Prism qwen35 GGUF tensor (``KeyError`` for an unknown name).

    ``n_layers`` = decoder blocks: blocks from ``n_layers`` on are MTP layers (``mtp.layers.{i − n_layers}``),
    and block ``n_layers`` holds the MTP head's own tensors ``blk.L.nextn.*`` (:data:`NEXTN_TENSORS`)."""
    for g, h in GLOBAL_TENSORS.items():
        if name == g + ".weight":
            return h + ".weight"
    m = _NEXTN_RE.match(name)
    if m:
        layer, kind = int(m.group(1)), m.group(2)
        if kind in DEDICATED_NEXTN:
            raise KeyError(
                f"qwen35 GGUF tensor {name!r}: a dedicated MTP {DEDICATED_NEXTN[kind]} is not supported (vLLM's "
                "qwen3_5_mtp shares the main model's embedding and head)"
            )
        if kind not in NEXTN_TENSORS or n_layers is None or layer != n_layers:
            raise KeyError(f"qwen35 GGUF tensor {name!r}: not an MTP tensor of block {n_layers} this converter knows")
        return f"{NEXTN_TENSORS[kind]}.weight"
    m = _BLOCK_RE.match(name)
    if m:
        layer, kind, suffix = m.groups()
        prefix = f"model.layers.{layer}"
        if n_layers is not None and int(layer) >= n_layers:
            prefix = f"mtp.layers.{int(layer) - n_layers}"
        if kind == "ssm_a" and suffix == "weight":
            return f"{prefix}.linear_attn.A_log"
        if kind == "ssm_dt" and suffix == "bias":
            return f"{prefix}.linear_attn.dt_bias"
        if kind in BLOCK_TENSORS:
            return f"{prefix}.{BLOCK_TENSORS[kind]}.{suffix}"
    if re.match(r"^blk\.\d+\.ssm_a$", name):
        return f"model.layers.{name.split('.')[1]}.linear_attn.A_log"
    raise KeyError(f"qwen35 GGUF tensor {name!r} has no Hugging Face counterpart this converter knows")


def hf_to_gguf(hf: str, n_layers: int | None) -> str:
    """The qwen35 GGUF name of a checkpoint tensor (inverse of :func:`gguf_to_hf`; ``KeyError`` if none)."""
    for g, h in GLOBAL_TENSORS.items():
        if hf == h + ".weight":
            return g + ".weight"
    for kind, module in NEXTN_TENSORS.items():
        if hf == module + ".weight":
            if n_layers is None:
                raise KeyError(f"{hf!r}: the MTP block index needs the decoder layer count")
            return f"blk.{n_layers}.nextn.{kind}.weight"
    m = re.match(r"^(model|mtp)\.layers\.(\d+)\.(.+)$", hf)
    if m:
        where, layer, rest = m.group(1), int(m.group(2)), m.group(3)
        if where == "mtp":
            if n_layers is None:
                raise KeyError(f"{hf!r}: the MTP block index needs the decoder layer count")
            layer += n_layers
        if rest == "linear_attn.A_log":
            return f"blk.{layer}.ssm_a"
        if rest == "linear_attn.dt_bias":
            return f"blk.{layer}.ssm_dt.bias"
        module, _, suffix = rest.rpartition(".")
        if suffix in ("weight", "bias") and module in _BLOCK_KINDS:
            return f"blk.{layer}.{_BLOCK_KINDS[module]}.{suffix}"
    raise KeyError(f"checkpoint tensor {hf!r} has no qwen35 GGUF name")


def vperm(num_v_heads: int, num_k_heads: int, unit: int) -> np.ndarray:
    """Row gather turning llama.cpp's tiled V-head order into HF's grouped one (docs/formats.md#gdn-head-order)."""
    return H.gdn_tiled_to_grouped(num_v_heads, num_k_heads, unit)


# --------------------------------------------------------------------------------------------------------
# A conversion plan: config + one entry per output tensor
# --------------------------------------------------------------------------------------------------------


class _Plan:
    def __init__(self, source: str):
        self.source = source
        self.config: dict[str, Any] = {}
        self.group_size = 128
        self.ternary: dict[str, Any] = {}  # HF module → callable() -> (qweight u8 [N,K/4], scales f16 [N,K/g])
        self.ternary_shape: dict[str, tuple[int, int]] = {}
        self.dense: dict[str, tuple[Any, str, tuple[int, ...]]] = {}  # HF tensor → (callable, dtype, shape)
        self.spec: H.HadamardSpec | None = None
        self.tokenizer_writer = None
        self.generation_config: dict[str, Any] = {}
        self.hf_dir: Path | None = None  # tokenizer files (Hugging Face layout), for GGUF output


def _float_array(src, info) -> np.ndarray:
    raw = np.asarray(src.raw(info.name))
    if info.type == "F32":
        a = raw.view("<f4")
    elif info.type == "F16":
        a = raw.view("<f2").astype(np.float32)
    elif info.type == "BF16":
        a = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        raise UnsupportedTypeError(
            f"{info.file}: tensor '{info.name}': type {info.type} is neither ternary nor float "
            f"(supported: {sorted(GGUF_TERNARY_TYPES)} and {sorted(FLOAT_TYPES)})"
        )
    return a.reshape(tuple(int(d) for d in info.shape)).astype(np.float32, copy=False)


def _unrotate_rows(x: np.ndarray, signs: np.ndarray, block: int) -> np.ndarray:
    """``W'·H·D`` row by row (WHT then ·s) with the Rust FWHT; float32 in, float32 out."""
    from .. import _core

    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _core.fwht(x, out, int(block), "float32", True, np.ascontiguousarray(signs, dtype=np.float32), None)
    return out


def _v_rows(hf: str, cfg: dict) -> np.ndarray | None:
    """Row gather (tiled → grouped) for GDN V-side tensors, ``None`` for everything else."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if hf.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
        qk = 2 * nk * dk
        return np.concatenate([np.arange(qk), qk + vperm(nv, nk, dv)])
    if hf.endswith("linear_attn.in_proj_z.weight"):
        return vperm(nv, nk, dv)
    if hf.endswith(("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight",
                    "linear_attn.A_log", "linear_attn.dt_bias")):
        return vperm(nv, nk, 1)
    return None


def _config_from_gguf(md: dict, tensors: dict, path: str) -> dict:
    a = "qwen35"

    def get(key, default=None):
        v = md.get(f"{a}.{key}", default)
        if v is None:
            raise FormatError(f"{path}: GGUF metadata key '{a}.{key}' is missing (needed for config.json)")
        return v

    n_mtp = int(md.get(f"{a}.nextn_predict_layers", 0) or 0)
    n_layers = int(get("block_count")) - n_mtp
    if n_mtp < 0 or n_layers <= 0:
        raise FormatError(f"{path}: {a}.block_count {get('block_count')} and {a}.nextn_predict_layers {n_mtp} "
                          "leave no decoder blocks")
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length"))
    nv = int(get("ssm.time_step_rank"))
    nk = int(get("ssm.group_count"))
    inner = int(get("ssm.inner_size"))
    if nv <= 0 or nk <= 0 or inner % nv or nv % nk:
        raise FormatError(f"{path}: inconsistent GDN sizes: inner {inner}, value heads {nv}, key heads {nk}")
    layer_types = [
        "full_attention" if f"blk.{i}.attn_q.weight" in tensors else "linear_attention" for i in range(n_layers)
    ]
    rope_dims = int(get("rope.dimension_count", head_dim))
    sections = [int(s) for s in md.get(f"{a}.rope.dimension_sections", [])][:3]
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "partial_rotary_factor": rope_dims / head_dim,
    }
    if sections and any(sections):
        rope["mrope_section"] = sections
        rope["mrope_interleaved"] = True
    vocab = int(tensors["token_embd.weight"].shape[0])
    md_eos = md.get("tokenizer.ggml.eos_token_id")
    config = {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(get("attention.head_count")),
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_parameters": rope,
        "attention_bias": False,
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_value_head_dim": inner // nv,
        "linear_num_key_heads": nk,
        "linear_num_value_heads": nv,
        "layer_types": layer_types,
        "eos_token_id": None if md_eos is None else int(md_eos),
        "pad_token_id": None if md.get("tokenizer.ggml.padding_token_id") is None
        else int(md["tokenizer.ggml.padding_token_id"]),
        "bos_token_id": None,
        "dtype": "bfloat16",
    }
    if n_mtp:
        for j in range(n_mtp):
            if f"blk.{n_layers + j}.attn_q.weight" not in tensors:
                raise FormatError(f"{path}: MTP block {n_layers + j} has no attn_q.weight (a full-attention layer)")
        config["mtp_num_hidden_layers"] = n_mtp
    return config


def _group_size(requested: int | None, native: set[int], where: str) -> int:
    """The checkpoint's group size: the requested one, or the source's smallest native group.

    A requested group larger than a native one is accepted here: :func:`ternary_rs.core.tensor.repack` merges
    groups only where every merged scale agrees (lossless, e.g. PrismML's g64 files repeat each g128 scale)
    and raises ``ValidationError`` naming the tensor otherwise."""
    if requested is None:
        return min(native) if native else 128
    return requested


def _gdn_permute_for(cfg: dict, grouped: bool):
    def f(module: str) -> H.GdnPermute | None:
        if grouped or not module.endswith("linear_attn.out_proj"):
            return None
        return H.GdnPermute("grouped", "tiled", cfg["linear_num_value_heads"], cfg["linear_num_key_heads"],
                            cfg["linear_value_head_dim"])
    return f


def _plan_from_gguf(src, options) -> _Plan:
    from ..core.tensor import repack
    from ..sources.decode import decode

    path = str(getattr(src, "path", "") or "qwen35 GGUF")
    md = dict(src.metadata)
    tensors = dict(src.tensors)
    plan = _Plan(path)
    cfg = plan.config = _config_from_gguf(md, tensors, path)
    native = set()
    kinds = {}
    n_layers = int(cfg["num_hidden_layers"])
    for name, info in tensors.items():
        try:
            hf = gguf_to_hf(name, n_layers)
        except KeyError as e:
            raise UnsupportedTypeError(f"{path}: {e.args[0]}") from None
        kinds[name] = hf
        if info.type in GGUF_TERNARY_TYPES:
            native.add(GGUF_TERNARY_GROUPS[info.type])
    g = plan.group_size = _group_size(options.group_size, native, path)

    for name, info in tensors.items():
        hf = kinds[name]
        shape = tuple(int(d) for d in info.shape)
        rows = _v_rows(hf, cfg)
        if info.type in GGUF_TERNARY_TYPES:
            if len(shape) != 2 or shape[1] % g:
                raise ValidationError(f"{path}: tensor '{name}' {shape}: K is not a multiple of group size {g}")

            def produce(name=name, rows=rows):
                t = decode(src, name)
                if t.group_size != g:
                    t = repack(t, g)
                q, s = np.asarray(t.qweight), np.asarray(t.scales)
                if rows is not None:
                    q, s = q[rows], s[rows]
                return np.ascontiguousarray(q), np.ascontiguousarray(s).view(np.float16)

            module = hf[: -len(".weight")]
            plan.ternary[module] = produce
            plan.ternary_shape[module] = shape
            continue

        def dense(name=name, info=info, hf=hf, rows=rows):
            x = _float_array(src, info)
            if hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
                x = x - 1.0
            elif hf.endswith("linear_attn.A_log"):
                if np.any(x >= 0):
                    raise ValidationError(f"{path}: tensor '{name}': ssm_a must be negative (A = -exp(A_log))")
                x = np.log(-x)
            if rows is not None:
                x = x[rows]
            if hf.endswith("conv1d.weight"):
                x = x.reshape(x.shape[0], 1, -1)
            return x

        out_shape = shape if not hf.endswith("conv1d.weight") else (shape[0], 1, shape[1])
        plan.dense[hf] = (dense, "F32", out_shape)

    prism = H.prism_keys(md)
    if prism:
        width_of = {}
        for name, hf in kinds.items():
            if hf.endswith(".weight") and len(tensors[name].shape) == 2:
                width_of[name] = (hf[: -len(".weight")], int(tensors[name].shape[1]))
        if H.tied_output(prism, path) and "output.weight" in tensors:
            raise ValidationError(
                f"{path}: prism.hadamard.tied_output says token_embd is also the output head, but the file has an "
                "output.weight; refusing rather than guessing which head to serve"
            )
        # Upstream's loader reads an absent gdn_v_grouped as false (ssm_out rotated in the tiled basis).
        grouped = bool(prism.get("gdn_v_grouped", False))
        plan.spec = H.HadamardSpec.from_prism(prism, width_of.get, _gdn_permute_for(cfg, grouped), path)
    plan.spec = _fold_dense_rotations(plan)

    def tokenizer(out_dir: Path):
        from ..sources.hf_gguf import generation_config_from_gguf, tokenizer_from_gguf

        tokenizer_from_gguf(None, md, out_dir)
        gen = generation_config_from_gguf(md)
        gen.setdefault("do_sample", False)
        (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    plan.tokenizer_writer = tokenizer
    return plan


def _fold_dense_rotations(plan: _Plan) -> H.HadamardSpec | None:
    """Un-rotate listed weights that are stored dense (no ternary structure to keep) and drop them."""
    spec = plan.spec
    if spec is None:
        return None
    layers = dict(spec.layers)
    inverse = list(spec.inverse_embeddings)
    for module in list(layers) + inverse:
        w = module + ".weight"
        if w not in plan.dense:
            if module not in plan.ternary:
                raise ValidationError(f"{plan.source}: rotated weight '{module}' is missing from the file")
            continue
        produce, dtype, shape = plan.dense[w]
        width = shape[-1]
        signs = spec.signs.get(width)
        if signs is None:
            raise ValidationError(f"{plan.source}: '{module}' has width {width}, no sign vector of that width")
        if module in layers and layers[module][1] is not None:
            raise ValidationError(f"{plan.source}: '{module}' needs a GDN permutation but is stored dense")

        def unrotated(produce=produce, signs=signs, block=spec.block_size):
            return _unrotate_rows(produce(), signs, block)

        plan.dense[w] = (unrotated, dtype, shape)
        layers.pop(module, None)
        if module in inverse:
            inverse.remove(module)
    if not layers and not inverse:
        return None
    return H.HadamardSpec(spec.block_size, dict(spec.signs), layers, tuple(inverse), source=spec.source)


def _plan_from_mlx(src, options) -> _Plan:
    root = Path(getattr(src, "path", src))
    root = root if root.is_dir() else root.parent
    where = str(root)
    cfg_all = json.loads((root / "config.json").read_text())
    if cfg_all.get("model_type") != MLX_MODEL_TYPE:
        raise UnsupportedTypeError(f"{where}/config.json: model_type {cfg_all.get('model_type')!r} is not "
                                   f"{MLX_MODEL_TYPE!r}")
    quant = cfg_all.get("quantization") or {}
    if quant.get("bits") != 2 or quant.get("mode", "affine") != "affine":
        raise UnsupportedTypeError(f"{where}: MLX quantization {quant} is not 2-bit affine")
    if cfg_all.get("gdn_activation_layout", "grouped") != "grouped":
        raise UnsupportedTypeError(f"{where}: gdn_activation_layout {cfg_all.get('gdn_activation_layout')!r}")
    native = int(quant.get("group_size", 128))
    plan = _Plan(where)
    plan.hf_dir = root
    text = dict(cfg_all.get("text_config") or {})
    if not text:
        raise FormatError(f"{where}/config.json: no text_config")
    text.pop("transformers_version", None)
    text["model_type"] = HF_MODEL_TYPE
    text["architectures"] = [HF_ARCHITECTURE]
    text.setdefault("dtype", "bfloat16")
    plan.config = text
    g = plan.group_size = _group_size(options.group_size, {native}, where)
    if g != native:
        raise ValidationError(f"{where}: MLX packs convert at their native group size {native}, not {g}")
    tensors = dict(src.tensors)
    had_name = cfg_all.get("hadamard_config", "hadamard.json")
    had = json.loads((root / had_name).read_text())

    def hf_of(name: str) -> str:
        if not name.startswith(MLX_PREFIX):
            raise FormatError(f"{where}: tensor '{name}' is outside the '{MLX_PREFIX}' namespace")
        return name[len(MLX_PREFIX):]

    pack_signs: dict[str, str] = {}
    for name, info in tensors.items():
        if name.endswith(".signs"):
            pack_signs[hf_of(name)[: -len(".signs")]] = name
            continue
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and f"{base}.weight" in tensors and \
                tensors[f"{base}.weight"].type == "U32":
            continue
        hf = hf_of(name)
        if name.endswith(".weight") and info.type == "U32":
            n, k = int(info.shape[0]), int(info.shape[1]) * 16

            def produce(name=name, base=base, n=n, k=k):
                words = np.ascontiguousarray(np.asarray(src.raw(name))).view("<u4").reshape(n, k // 16)
                scales = np.asarray(src.raw(base + ".scales")).view("<f2").reshape(n, k // native)
                biases = np.asarray(src.raw(base + ".biases")).view("<f2").reshape(n, k // native)
                bad = np.flatnonzero((scales.astype(np.float32) + biases.astype(np.float32)).ravel() != 0)
                if bad.size:
                    raise ValidationError(
                        f"{where}: tensor '{base}': bias != -scale at group {bad[0]} ({bad.size} groups): "
                        "not a ternary pack"
                    )
                # 16 codes per little-endian uint32, LSB first == 4 canonical bytes of 4 codes each.
                return np.ascontiguousarray(words.view(np.uint8)), np.ascontiguousarray(scales)

            module = hf[: -len(".weight")]
            plan.ternary[module] = produce
            plan.ternary_shape[module] = (n, k)
            continue
        shape = tuple(int(d) for d in info.shape)

        def dense(name=name, info=info, hf=hf, shape=shape):
            raw = np.asarray(src.raw(name))
            x = _float_array(src, info) if info.type in FLOAT_TYPES else raw
            if hf.endswith("conv1d.weight") and x.ndim == 3 and x.shape[2] == 1:
                x = np.transpose(x, (0, 2, 1))  # MLX [C, K, 1] → HF [C, 1, K]
            if hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
                x = x - 1.0  # mlx-lm's sanitize stores Qwen3.5 norms shifted by +1 (like llama.cpp)
            return np.ascontiguousarray(x, dtype=np.float32)

        out_shape = shape if not (hf.endswith("conv1d.weight") and len(shape) == 3 and shape[2] == 1) \
            else (shape[0], 1, shape[1])
        plan.dense[hf] = (dense, "F32", out_shape)

    def resolve(name: str):
        hf = name[len(MLX_PREFIX):] if name.startswith(MLX_PREFIX) else name
        module = hf[: -len(".weight")] if hf.endswith(".weight") else hf
        if module in plan.ternary:
            return module, plan.ternary_shape[module][1]
        if module + ".weight" in plan.dense:
            return module, plan.dense[module + ".weight"][2][-1]
        return None

    grouped = had.get("gdn_v_grouped", False)  # absent means false, as in a GGUF (upstream loader)
    plan.spec = H.HadamardSpec.from_prism(had, resolve, _gdn_permute_for(plan.config, bool(grouped)),
                                          f"{where}/{had_name}")
    # The pack's own module list must agree with hadamard.json (a rotated module it does not list would be
    # served without its transform).
    listed = set(plan.spec.layers) | set(plan.spec.inverse_embeddings)
    for entry in cfg_all.get("modules") or []:
        path, block = str(entry.get("path", "")), int(entry.get("block", 0) or 0)
        if block and (block != plan.spec.block_size or path not in listed):
            raise ValidationError(
                f"{where}/config.json: module '{path}' is marked rotated (block {block}) but "
                f"{had_name} does not list it with block {plan.spec.block_size}"
            )
    # Each module's own sign vector must be the one of its width in hadamard.json.
    for sname in pack_signs.values():
        s = _float_array(src, tensors[sname]).ravel()
        want = plan.spec.signs.get(s.size)
        if want is None or not np.array_equal(s, want.astype(np.float32)):
            raise ValidationError(f"{where}: '{sname}' differs from hadamard.json's sign vector of width {s.size}")
    plan.spec = _fold_dense_rotations(plan)

    def side_files(out_dir: Path):
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                  "merges.txt", "chat_template.jinja", "generation_config.json"):
            if (root / f).is_file():
                (out_dir / f).write_bytes((root / f).read_bytes())

    plan.tokenizer_writer = side_files
    return plan


def _plan_from_checkpoint(src, options) -> _Plan:
    """A ternary_rs Bonsai 2 checkpoint (``model_type qwen3_5_text``, canonical ``qweight``/``scales``,
    float32 dense tensors, ``quantization_config.hadamard``) — to GGUF, or re-grouped into a new checkpoint."""
    from ..core.tensor import TernaryTensor, repack
    from ..sinks.checkpoint import SUPPORTED_GROUP_SIZES
    from ..sources.hf_gguf import copy_hf_side_files

    root = Path(getattr(src, "path", src))
    root = root if root.is_dir() else root.parent
    where = str(root)
    config = json.loads((root / "config.json").read_text())
    qc = config.pop("quantization_config", None) or {}
    if qc.get("quant_method") != "ternary":
        raise UnsupportedTypeError(
            f"{where}/config.json: model_type {HF_MODEL_TYPE!r} without quantization_config.quant_method "
            "'ternary': not a ternary_rs checkpoint (dense Qwen3.5 weights are not ternarized implicitly)"
        )
    native = int(qc.get("group_size", 0))
    if native not in SUPPORTED_GROUP_SIZES:
        raise ValidationError(f"{where}/config.json: quantization_config.group_size {native!r} is not one of "
                              f"{SUPPORTED_GROUP_SIZES}")
    plan = _Plan(where)
    plan.hf_dir = root
    config.pop("transformers_version", None)
    plan.config = config
    g = plan.group_size = _group_size(options.group_size, {native}, where)
    tensors = dict(src.tensors)
    for name, info in tensors.items():
        if name.endswith(".scales") and name[: -len(".scales")] + ".qweight" in tensors:
            continue
        shape = tuple(int(d) for d in info.shape)
        if name.endswith(".qweight"):
            module = name[: -len(".qweight")]
            if module + ".scales" not in tensors or len(shape) != 2:
                raise FormatError(f"{where}: tensor '{name}' has no '{module}.scales' beside it")
            n, k = shape[0], shape[1] * 4

            def produce(name=name, module=module, n=n, k=k):
                q = np.asarray(src.raw(name)).reshape(n, k // 4)
                sc = np.asarray(src.raw(module + ".scales")).view("<f2").reshape(n, k // native)
                t = TernaryTensor(q, sc, native, name=module)  # validates codes and scales
                if g != native:
                    t = repack(t, g)
                return np.ascontiguousarray(t.qweight), np.ascontiguousarray(t.scales).view(np.float16)

            plan.ternary[module] = produce
            plan.ternary_shape[module] = (n, k)
            continue

        def dense(info=info):
            return _float_array(src, info)  # float32: the stored value exactly

        plan.dense[name] = (dense, "F32", shape)
    if qc.get("hadamard") is not None:
        plan.spec = H.HadamardSpec.from_config(qc["hadamard"], source=f"{where}/config.json: hadamard")
        missing = sorted(m for m in list(plan.spec.layers) + list(plan.spec.inverse_embeddings)
                         if m not in plan.ternary)
        if missing:
            raise ValidationError(f"{where}: rotated modules {missing[:4]} are not stored ternary")

    def side_files(out_dir: Path):
        copy_hf_side_files(root, out_dir)

    plan.tokenizer_writer = side_files
    return plan


# Ternary GGUF types a qwen35 file is written in: (ggml type id, values per block, bytes per block). PrismML's
# PQ2_0 / PTQ1_0 by default (the fork runs them, rotation included); upstream llama.cpp runs TQ2_0 / TQ1_0
# (one scale per 256 weights: from a g128 checkpoint only with --requantize, and without a rotation), as
# llama.cpp PR #22836 runs STQ1_0 (also only where its codebook holds the weights, else --requantize).
QWEN35_GGUF_OUTPUT = gguf_output_types("PQ2_0", "PTQ1_0", "TQ2_0", "TQ1_0", "STQ1_0")
GGUF_F32 = 0
# The llama ftypes a qwen35 file sets, the fork's PQ2_0 one included (docs/formats.md#gguf-file-type).
GGUF_FILE_TYPES = {name: LLAMA_FILE_TYPES[name] for name in ("PQ2_0", "TQ1_0", "TQ2_0")}


def _tiled_rows(hf: str, cfg: dict) -> np.ndarray | None:
    """Row gather turning HF's grouped GDN V-head order back into llama.cpp's tiled one (inverse of _v_rows)."""
    rows = _v_rows(hf, cfg)
    return None if rows is None else np.argsort(rows)


def _prism_metadata(plan: _Plan) -> list[tuple[str, Any, str]]:
    """``prism.hadamard.*`` for the plan's rotation (docs/formats.md#bonsai2-rotation), GGUF names, as PrismML writes them."""
    spec = plan.spec
    n_layers = int(plan.config["num_hidden_layers"])
    perms = {(p.source, p.target) for _, p in spec.layers.values() if p is not None}
    if perms - {("grouped", "tiled")} or (perms and any(
            p is None for m, (_, p) in spec.layers.items() if m.endswith("linear_attn.out_proj"))):
        raise ValidationError(f"{plan.source}: GDN permutations {sorted(perms)} do not match one "
                              "prism.hadamard.gdn_v_grouped value; cannot write them to GGUF")
    tied = bool(plan.config.get("tie_word_embeddings")) and "model.embed_tokens" in spec.inverse_embeddings
    widths = sorted(spec.signs)
    kv: list[tuple[str, Any, str]] = [
        ("prism.hadamard.version", 2 if tied else 1, "u32"),
        ("prism.hadamard.transform", H.PRISM_TRANSFORM, "string"),
        ("prism.hadamard.axis", H.PRISM_AXIS, "string"),
        ("prism.hadamard.sign_mode", "explicit", "string"),
        ("prism.hadamard.block_size", spec.block_size, "u32"),
        ("prism.hadamard.sign_widths", widths, "array[u32]"),
        ("prism.hadamard.sign_values", [int(v) for w in widths for v in spec.signs[w]], "array[i32]"),
        ("prism.hadamard.weight_names", [hf_to_gguf(m + ".weight", n_layers) for m in sorted(spec.layers, key=_natural)],
         "array[string]"),
        ("prism.hadamard.inverse_weight_names",
         [hf_to_gguf(m + ".weight", n_layers) for m in spec.inverse_embeddings], "array[string]"),
        ("prism.hadamard.gdn_v_grouped", not perms, "bool"),
    ]
    if tied:
        kv.append(("prism.hadamard.tied_output", True, "bool"))
    return kv


def _write_gguf(plan: _Plan, out_path: Path, options) -> None:
    """Write the plan as a qwen35 GGUF: ternary tensors re-encoded (group 128, llama.cpp row order), dense
    tensors float32 with PrismML's conventions restored (norms ``w + 1``, ``ssm_a = −exp(A_log)``, tiled GDN
    rows, 2-D conv1d), hyper-parameters, tokenizer and ``prism.hadamard.*``. Streams tensor by tensor."""
    from .._core import __version__
    from ..core.tensor import TernaryTensor, encode, repack
    from ..sinks.checkpoint import GGUF_MARK_KEY, Job, OutTensor, run_jobs
    from ..sinks.gguf_metadata import metadata_for_gguf_output
    from ..sinks.writers import GGUFWriter

    gtype = (options.gguf_type or "PQ2_0").upper()
    if gtype not in QWEN35_GGUF_OUTPUT:
        raise UnsupportedTypeError(f"--gguf-type {gtype}: a qwen35 GGUF is written as {sorted(QWEN35_GGUF_OUTPUT)}")
    if plan.spec is not None and gtype in ("TQ2_0", "TQ1_0", "STQ1_0"):
        # Upstream llama.cpp knows no prism.hadamard.*: it would run the weights without their rotation.
        raise UnsupportedTypeError(f"{plan.source}: --gguf-type {gtype}: this model carries a Hadamard rotation, "
                                   f"which only PrismML's types keep (PQ2_0, PTQ1_0)")
    type_id, block, block_bytes = QWEN35_GGUF_OUTPUT[gtype]
    cfg = plan.config
    n_layers = int(cfg["num_hidden_layers"])
    if plan.hf_dir is None:
        raise UnsupportedTypeError(f"{plan.source}: no tokenizer directory to take GGUF tokenizer metadata from")
    shapes = list(plan.ternary_shape.values()) + [shape for _, _, shape in plan.dense.values()]
    metadata = metadata_for_gguf_output(plan.hf_dir, cfg, ARCH, GGUF_FILE_TYPES.get(gtype), shapes)
    # The rotation is described from the plan (what this file holds), replacing the keys of a stored
    # source GGUF; the mark lets a later ``--force`` tell this file from a user's own GGUF.
    prism = _prism_metadata(plan) if plan.spec is not None else []
    ours = {k for k, _, _ in prism} | {GGUF_MARK_KEY}
    metadata = [e for e in metadata if e[0] not in ours and not e[0].startswith("prism.")] + prism
    metadata.append((GGUF_MARK_KEY, __version__, "string"))

    jobs = []
    g = plan.group_size
    order = sorted(set(plan.ternary) | {k.rsplit(".", 1)[0] for k in plan.dense}, key=_natural)
    for module in order:
        if module in plan.ternary:
            n, k = plan.ternary_shape[module]
            if k % block:
                raise ValidationError(f"{plan.source}: '{module}' has K = {k}, not a multiple of the {gtype} "
                                      f"block of {block}")
            gname = hf_to_gguf(module + ".weight", n_layers)

            def produce(module=module, rows=_tiled_rows(module + ".weight", cfg)):  # noqa: B008 - bound per module
                q, sc = plan.ternary[module]()
                t = TernaryTensor(q, sc, g, name=module, validate=False)
                # To a divisor: scales repeat; to a multiple: lossless or --requantize (else raises). STQ1_0
                # regroups inside encode, where --requantize maps onto its codebook instead.
                if g != block and gtype != "STQ1_0":
                    t = repack(t, block, requantize=options.requantize)
                if rows is not None:
                    t = TernaryTensor(np.ascontiguousarray(t.qweight[rows]), np.ascontiguousarray(t.scales[rows]),
                                      t.group_size, name=module, validate=False)
                data = encode(t, gtype, requantize=options.requantize and gtype == "STQ1_0")
                return (np.frombuffer(memoryview(data), dtype=np.uint8),)

            jobs.append(Job([OutTensor(gname, gtype, (n, k), n * (k // block) * block_bytes)], produce,
                            f"{plan.source}: {module}", meta={"type_id": type_id}))
        for hf in sorted(t for t in plan.dense if t.rsplit(".", 1)[0] == module):
            produce_dense, _, shape = plan.dense[hf]
            gname = hf_to_gguf(hf, n_layers)
            out_shape = (shape[0], shape[2]) if hf.endswith("conv1d.weight") and len(shape) == 3 else tuple(shape)

            def produce(hf=hf, produce_dense=produce_dense, rows=_tiled_rows(hf, cfg),  # noqa: B008 - bound per tensor
                        out_shape=out_shape):
                x = np.asarray(produce_dense(), dtype=np.float32)
                if hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
                    x = x + np.float32(1.0)  # llama.cpp's Qwen3.5 norms are x·w with w = 1 + HF's weight
                elif hf.endswith("linear_attn.A_log"):
                    x = -np.exp(x)
                x = x.reshape(out_shape)
                if rows is not None:
                    x = x[rows]
                return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint8).reshape(-1),)

            jobs.append(Job([OutTensor(gname, "F32", out_shape, int(np.prod(out_shape)) * 4)], produce,
                            f"{plan.source}: {hf}", meta={"type_id": GGUF_F32}))
    writer = GGUFWriter(out_path)
    try:
        for key, value, vtype in metadata:
            writer.add_metadata(key, value, vtype)
        for job in jobs:
            o = job.outputs[0]
            writer.add_tensor_info(o.name, tuple(o.shape), job.meta["type_id"], o.nbytes)
        run_jobs(jobs, lambda i, job, buffers: writer.write_tensor_data(job.outputs[0].name, buffers[0]))
    except BaseException:
        writer.abort()  # deletes the partial file
        raise
    writer.close()


def _write(plan: _Plan, out_dir: Path, options) -> None:
    from ..sinks.checkpoint import Job, OutTensor, quantization_config, write_shards

    g = plan.group_size
    jobs = []
    order = sorted(set(plan.ternary) | {k.rsplit(".", 1)[0] for k in plan.dense}, key=_natural)
    for module in order:
        if module in plan.ternary:
            n, k = plan.ternary_shape[module]
            jobs.append(Job(
                outputs=[OutTensor(module + ".qweight", "U8", (n, k // 4), n * k // 4),
                         OutTensor(module + ".scales", "F16", (n, k // g), n * (k // g) * 2)],
                produce=plan.ternary[module],
                source=f"{plan.source}: {module}",
            ))
        for hf in sorted(t for t in plan.dense if t.rsplit(".", 1)[0] == module):
            produce, dtype, shape = plan.dense[hf]
            nbytes = int(np.prod(shape)) * (2 if dtype == "F16" else 4)

            def job(produce=produce, shape=shape, hf=hf, dtype=dtype):
                x = produce()
                if x.shape != tuple(shape):
                    raise ValidationError(f"{plan.source}: '{hf}' has shape {x.shape}, expected {tuple(shape)}")
                np_dtype = {"F16": np.float16, "F32": np.float32}[dtype]
                return [np.ascontiguousarray(x, dtype=np_dtype)]

            jobs.append(Job(outputs=[OutTensor(hf, dtype, tuple(shape), nbytes)], produce=job,
                            source=f"{plan.source}: {hf}"))
    write_shards(out_dir, jobs, options.shard_size)
    dense_linears = sorted(
        t[: -len(".weight")] for t in plan.dense
        if t.endswith(".weight") and t.rsplit(".", 2)[-2] in LINEAR_MODULES
    )
    qc = quantization_config(g, dense_linears)
    if plan.spec is not None:
        qc["hadamard"] = plan.spec.to_config()
    config = dict(plan.config)
    config["quantization_config"] = qc
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if plan.tokenizer_writer is not None:
        plan.tokenizer_writer(out_dir)


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


ARCH = Qwen35Arch()
