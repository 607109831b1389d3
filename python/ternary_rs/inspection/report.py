"""``ternary-rs inspect`` and ``ternary-rs verify``.

How much of the file is read is a *level*:

* ``header`` (``inspect``'s default, like ``gguf-dump``): headers only — tensor table by type, parameter
  count, effective bits per weight, group sizes, the Hadamard rotation, consistency of tensor shapes with
  ``config.json`` / GGUF metadata. Packed ternary types are ternary by their type; whether *float* linear
  weights hold exactly ternary values needs the data, so it is left undecided (``is_ternary`` None).
* ``sample`` (``plan``): as ``header``, plus the first ``INSPECT_SAMPLE_ROWS`` rows of each float linear
  weight checked for exactly ternary values (``convert`` would store those as ternary).
* ``full`` (``inspect --scan`` and ``verify``): every byte — every float weight, every scale (NaN/Inf,
  all-zero, implausible), every code (code 3 is invalid), MLX biases. ``verify`` adds tensor bounds, the
  index, the manifest's SHA-256 sums and the tokenizer, and fails on any problem.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._core import InvalidArgumentError, TernaryError, ValidationError
from ..core.formats import (
    FLOAT_BYTES,
    GGUF_BLOCKS,
    GGUF_TERNARY_GROUPS,
    dense_ternary_group,
    describe_non_ternary_types,
    float_view,
    non_ternary_gguf_tensors,
    packed_safetensors,
)
from ..sinks.checkpoint import INDEX_NAME, MANIFEST_NAME, sha256_file
from ..sources.reader import not_found, ternary_errors

INSPECT_SAMPLE_ROWS = 256
SCAN_CHUNK_BYTES = 64 << 20
LEVELS = ("header", "sample", "full")
# A group scale is max|w| of its weights; trained layers stay far below this. A larger one means the
# bytes were read at a wrong offset or a converter broke, so verify calls it implausible.
MAX_PLAUSIBLE_SCALE = 1000.0
# Files a tokenizer lives in; a vLLM directory without any needs --tokenizer to be served.
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer.model", "vocab.json")
CLAIM_PATTERN = re.compile(r"ternary|bonsai|1\.58|b1_58|bitnet|tq[12]_0|pq2_0|ptq1_0|q2_0", re.IGNORECASE)
ROLE_PATTERNS = {
    # Fused projections (Phi-3's qkv_proj / gate_up_proj, llama.cpp's attn_qkv) first: their names end like
    # the single ones.
    "qkv": re.compile(r"(qkv_proj|attn_qkv)\.weight$"),
    "gate_up": re.compile(r"gate_up_proj\.weight$"),
    "embed": re.compile(r"(^|\.)(embed_tokens|token_embd)\.weight$"),
    "lm_head": re.compile(r"(^|\.)(lm_head|output)\.weight$"),
    "q": re.compile(r"(q_proj|attn_q)\.weight$"),
    "k": re.compile(r"(k_proj|attn_k)\.weight$"),
    "v": re.compile(r"(v_proj|attn_v)\.weight$"),
    "o": re.compile(r"(o_proj|attn_output)\.weight$"),
    "gate": re.compile(r"(gate_proj|ffn_gate)\.weight$"),
    "up": re.compile(r"(up_proj|ffn_up)\.weight$"),
    "down": re.compile(r"(down_proj|ffn_down)\.weight$"),
}
BLOCK_PATTERN = re.compile(r"(?:layers|blk)\.(\d+)\.")


def _role(name: str) -> str | None:
    for role, pat in ROLE_PATTERNS.items():
        if pat.search(name):
            return role
    return None


def _linear_candidate(name: str, shape) -> bool:
    return len(shape) == 2 and name.endswith(".weight") and "norm" not in name


def _dense_embeddings_by_design(architecture) -> bool:
    """Whether the architecture (GGUF ``general.architecture`` / config ``model_type``, looked up by that name
    in ``ternary_rs.arch``, which imports only its module) keeps embed_tokens / lm_head dense (BitNet)."""
    from ..arch import ARCHES

    try:
        return bool(getattr(ARCHES[str(architecture)], "dense_embeddings", False))
    except KeyError:
        return False


def _code3_count(raw: np.ndarray) -> int:
    """Number of 2-bit fields equal to 3 in a byte array (both bits of a field set)."""
    raw = np.asarray(raw).reshape(-1)
    count = 0
    for i in range(0, raw.size, SCAN_CHUNK_BYTES):
        b = raw[i:i + SCAN_CHUNK_BYTES]
        both = b & (b >> 1) & 0x55
        if both.any():
            count += int(np.unpackbits(both[both != 0]).sum())
    return count


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _scale_stats(scales: np.ndarray) -> dict[str, Any]:
    s = np.asarray(scales).astype(np.float32).reshape(-1)
    fin = np.isfinite(s)
    finite = s[fin]
    implausible = fin & (np.abs(s) > MAX_PLAUSIBLE_SCALE)
    return {
        "count": int(s.size),
        "nan": int(np.isnan(s).sum()),
        "inf": int(np.isinf(s).sum()),
        "zero": int((s == 0).sum()),
        "negative": int((finite < 0).sum()),
        "implausible": int(implausible.sum()),
        "first_nonfinite": _first(~fin),
        "first_negative": _first(fin & (s < 0)),
        "first_implausible": _first(implausible),
        "min": float(finite.min()) if finite.size else None,
        "max": float(finite.max()) if finite.size else None,
        "mean_abs": float(np.abs(finite).mean()) if finite.size else None,
    }


def _merge_stats(total: dict | None, s: dict) -> dict:
    if total is None:
        return dict(s)
    out = {k: total[k] + s[k] for k in ("count", "nan", "inf", "zero", "negative", "implausible")}
    mins = [v for v in (total["min"], s["min"]) if v is not None]
    maxs = [v for v in (total["max"], s["max"]) if v is not None]
    out["min"] = min(mins) if mins else None
    out["max"] = max(maxs) if maxs else None
    if total["mean_abs"] is None or s["mean_abs"] is None:
        out["mean_abs"] = total["mean_abs"] if s["mean_abs"] is None else s["mean_abs"]
    else:
        n1, n2 = total["count"], s["count"]
        out["mean_abs"] = (total["mean_abs"] * n1 + s["mean_abs"] * n2) / max(1, n1 + n2)
    return out


# ------------------------------------------------------------------------------------------ model shape
def shape_config(f, path: Path) -> dict[str, Any]:
    """Normalized model shape from GGUF metadata or config.json (``None`` where unknown)."""
    if f.format == "gguf":
        md = dict(f.metadata)
        a = md.get("general.architecture", "")
        g = lambda key: md.get(f"{a}.{key}")  # noqa: E731
        heads = g("attention.head_count")
        hidden = g("embedding_length")
        tokens = md.get("tokenizer.ggml.tokens")
        cfg = {
            "architecture": a, "name": md.get("general.name"),
            "hidden_size": hidden, "num_hidden_layers": g("block_count"),
            "num_attention_heads": heads, "num_key_value_heads": g("attention.head_count_kv") or heads,
            "head_dim": g("attention.key_length") or (hidden // heads if hidden and heads else None),
            "intermediate_size": g("feed_forward_length"),
            "vocab_size": g("vocab_size") or (len(tokens) if isinstance(tokens, list) else None),
            "max_position_embeddings": g("context_length"),
            "full_attention_interval": g("full_attention_interval"),
            "quantization_config": None,
        }
        if g("ssm.time_step_rank"):  # hybrid Gated-DeltaNet layers (qwen35): recurrent state dims
            nv = int(g("ssm.time_step_rank"))
            cfg.update(linear_num_key_heads=g("ssm.group_count"), linear_num_value_heads=nv,
                       linear_key_head_dim=g("ssm.state_size"),
                       linear_value_head_dim=int(g("ssm.inner_size") or 0) // nv,
                       linear_conv_kernel_dim=g("ssm.conv_kernel"))
        if isinstance(cfg["num_key_value_heads"], list):  # per-layer kv heads (hybrids): 0 = no attention
            per_layer = cfg["num_key_value_heads"]
            cfg["num_key_value_heads"] = max(per_layer)
            cfg["attention_layers"] = sum(1 for x in per_layer if x)
        return cfg
    config = dict(getattr(f, "config", None) or {})
    if not config:
        p = (path if path.is_dir() else path.parent) / "config.json"
        if p.is_file():
            config = json.loads(p.read_text())
    text = dict(config.get("text_config") or {})
    merged = {**config, **text}
    heads = merged.get("num_attention_heads")
    hidden = merged.get("hidden_size")
    layer_types = merged.get("layer_types")
    cfg = {
        "architecture": merged.get("model_type"), "name": (config.get("architectures") or [None])[0],
        "hidden_size": hidden, "num_hidden_layers": merged.get("num_hidden_layers"),
        "num_attention_heads": heads, "num_key_value_heads": merged.get("num_key_value_heads") or heads,
        "head_dim": merged.get("head_dim") or (hidden // heads if hidden and heads else None),
        "intermediate_size": merged.get("intermediate_size"),
        "vocab_size": merged.get("vocab_size"),
        "max_position_embeddings": merged.get("max_position_embeddings"),
        "full_attention_interval": merged.get("full_attention_interval"),
        "quantization_config": config.get("quantization_config") or config.get("quantization"),
        "tie_word_embeddings": merged.get("tie_word_embeddings"),
    }
    if isinstance(layer_types, list):
        cfg["attention_layers"] = sum(1 for t in layer_types if t in ("full_attention", "attention", "sliding_attention"))
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if merged.get(key) is not None:
            cfg[key] = merged[key]
    return cfg


# ------------------------------------------------------------------------------------------ scanning
def _scan_tensors(f, level: str, problems: list[str], warnings: list[str], path: Path) -> list[dict[str, Any]]:
    """One entry per logical weight: name, type, shape, params, bytes, kind, group; with data read (see
    the module doc for the levels), scale stats and the code-3 count."""
    full = level == "full"
    tensors = f.tensors
    packs = {} if f.format == "gguf" else packed_safetensors(tensors)
    consumed: set[str] = {a for _, aux in packs.values() for a in aux}
    entries = []
    is_gguf = f.format == "gguf"
    for name, info in tensors.items():
        if name in consumed:
            continue
        typ = info.type
        shape = tuple(int(d) for d in info.shape)
        base = name.rsplit(".", 1)[0]
        e: dict[str, Any] = {"name": name, "type": typ, "shape": list(shape), "bytes": int(info.nbytes),
                             "kind": "float" if typ in FLOAT_BYTES else "other", "group_size": None}
        scales = None
        codes = None
        try:
            if is_gguf and typ in GGUF_TERNARY_GROUPS:
                e["kind"], e["group_size"] = "ternary", GGUF_TERNARY_GROUPS[typ]
                if not full:
                    raise _Skip
                raw = np.asarray(f.raw(name)).reshape(-1)
                if typ in GGUF_BLOCKS:
                    _, bsize, soff, code_range = GGUF_BLOCKS[typ]
                    if raw.size % bsize:
                        problems.append(f"{name}: {raw.size} bytes is not a whole number of {typ} blocks")
                        raise _Skip
                    blocks = raw.reshape(-1, bsize)
                    scales = np.ascontiguousarray(blocks[:, soff:soff + 2]).view(np.float16).reshape(-1)
                    if code_range is not None:
                        codes = blocks[:, code_range[0]:code_range[1]]
                elif typ == "I2_S":
                    n = int(np.prod(shape))
                    scales = np.ascontiguousarray(raw[n // 4:n // 4 + 4]).view(np.float32)
                    codes = raw[: n // 4]
            elif packs.get(name, ("",))[0] == "canonical":
                sc = tensors[f"{base}.scales"]
                shape = (shape[0], shape[1] * 4)
                e.update(kind="ternary", type="ternary_rs", shape=list(shape), bytes=int(info.nbytes) + int(sc.nbytes),
                         group_size=shape[1] // max(1, int(sc.shape[1])))
                e["name"] = f"{base}.weight"
                if not full:
                    raise _Skip
                scales = np.asarray(f.raw(f"{base}.scales")).view(np.float16)
                e["scales_tensor"] = f"{base}.scales"
                codes = f.raw(name)
            elif packs.get(name, ("",))[0] == "MLX":
                sc, bi = tensors[f"{base}.scales"], tensors[f"{base}.biases"]
                shape = (shape[0], shape[1] * 16)
                e.update(kind="ternary", type="MLX", shape=list(shape),
                         bytes=int(info.nbytes) + int(sc.nbytes) + int(bi.nbytes),
                         group_size=shape[1] // max(1, int(sc.shape[1])))
                if not full:
                    raise _Skip
                scales = float_of(f, f"{base}.scales", sc.type)
                e["scales_tensor"] = f"{base}.scales"
                biases = float_of(f, f"{base}.biases", bi.type)
                if not np.array_equal(scales + biases, np.zeros_like(scales)):
                    bad = int(np.count_nonzero(scales + biases))
                    problems.append(f"{name}: {bad} MLX groups have bias != -scale (not a ternary pack)")
                codes = f.raw(name)
            elif packs.get(name, ("",))[0] == "BITNET":
                sc = tensors[f"{name}_scale"]
                shape = (shape[0] * 4, shape[1])
                e.update(kind="ternary", type="BITNET", shape=list(shape), bytes=int(info.nbytes) + int(sc.nbytes))
                if not full:
                    raise _Skip
                scales = float_of(f, f"{name}_scale", sc.type)
                e["scales_tensor"] = f"{name}_scale"
                codes = f.raw(name)
            elif typ in FLOAT_BYTES and _linear_candidate(name, shape) and shape[1] % 32 == 0:
                e["checked_rows"] = 0
                if level == "header":
                    raise _Skip
                raw = f.raw(name)
                rows = shape[0] if full else min(shape[0], INSPECT_SAMPLE_ROWS)
                sample = np.asarray(raw).reshape(shape[0], -1)[:rows]
                g = dense_ternary_group(sample, typ, (rows, shape[1]))
                e["checked_rows"] = rows
                if g is not None:
                    e.update(kind="dense-ternary", group_size=g)
        except _Skip:
            pass
        e["params"] = int(np.prod(shape)) if shape else 1
        if scales is not None:
            e["scales"] = _scale_stats(scales)
        if codes is not None and full:
            e["code3"] = _code3_count(codes)
        if full and e.get("code3"):  # where the code sits depends on the format: ask the decoder
            e["api_error"] = _api_error(f, name, packs.get(name, ("",))[0], base)
        e["role"] = _role(e["name"])
        m = BLOCK_PATTERN.search(e["name"])
        e["block"] = int(m.group(1)) if m else None
        e["linear"] = _linear_candidate(e["name"], shape)
        entries.append(e)
    return entries


class _Skip(Exception):
    pass


def _api_error(f, name: str, pack: str, base: str) -> dict[str, Any] | None:
    """What the decoding API reports for a tensor a scan found bad (message, first index, count), so
    verify names the same first index a user of ``ternary_rs.decode`` would see."""
    from ..core.tensor import TernaryTensor
    from ..sources.decode import decode

    try:
        if pack == "canonical":
            q = np.asarray(f.raw(name)).reshape(f.tensors[name].shape)
            s = np.asarray(f.raw(f"{base}.scales")).view(np.float16).reshape(f.tensors[f"{base}.scales"].shape)
            TernaryTensor(q, s, name=name)
        else:
            from .. import _core

            t = decode(f, name)
            _core.validate(*t._args(), tensor=name)
    except ValidationError as e:
        return {"message": str(e), "first_index": getattr(e, "first_index", None), "count": getattr(e, "count", None)}
    except (TernaryError, ValueError, KeyError):
        return None
    return None


def float_of(f, name: str, typ: str) -> np.ndarray:
    return float_view(f.raw(name), typ)


def _consistency(entries: list[dict], cfg: dict[str, Any], problems: list[str], is_gguf: bool) -> None:
    hidden, heads, kv = cfg.get("hidden_size"), cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    head_dim, inter, vocab = cfg.get("head_dim"), cfg.get("intermediate_size"), cfg.get("vocab_size")
    # Qwen3.5 / Qwen3-Next gated attention: q_proj holds the queries and their output gate (2x rows).
    q_mult = 2 if cfg.get("architecture") in ("qwen35", "qwen3_5_text", "qwen3_next") else 1
    expect = {  # role -> (rows, cols) in PyTorch order
        "embed": (vocab, hidden), "lm_head": (vocab, hidden),
        "q": (heads * head_dim * q_mult if heads and head_dim else None, hidden),
        "k": (kv * head_dim if kv and head_dim else None, hidden),
        "v": (kv * head_dim if kv and head_dim else None, hidden),
        "o": (hidden, heads * head_dim if heads and head_dim else None),
        "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter),
        "qkv": (None, hidden),  # rows differ by kind (Bonsai 2's Gated-DeltaNet attn_qkv is not q+k+v heads)
        "gate_up": (2 * inter if inter else None, hidden),
    }
    # llama.cpp stores Phi-3's fused gate+up projection as ffn_up (2 x intermediate rows, no ffn_gate).
    gated_blocks = {e["block"] for e in entries if e["role"] == "gate"}
    seen_blocks = set()
    for e in entries:
        if e["block"] is not None:
            seen_blocks.add(e["block"])
        role = e["role"]
        if role not in expect or len(e["shape"]) != 2:
            continue
        rows, cols = e["shape"]
        want_rows, want_cols = expect[role]
        if role == "up" and inter and rows == 2 * inter and e["block"] not in gated_blocks:
            want_rows = rows  # fused gate+up
        moe_inter = cfg.get("moe_intermediate_size")
        if moe_inter and ".experts." in e["name"] and role in ("gate", "up", "down"):  # one routed expert (MoE)
            want_rows, want_cols = (hidden, moe_inter) if role == "down" else (moe_inter, hidden)
        shared_inter = cfg.get("shared_expert_intermediate_size")
        if shared_inter and ".shared_expert." in e["name"] and role in ("gate", "up", "down"):  # Qwen2-MoE
            want_rows, want_cols = (hidden, shared_inter) if role == "down" else (shared_inter, hidden)
        if role == "embed" and vocab and rows != vocab:
            problems.append(f"{e['name']}: {rows} rows but vocab_size is {vocab}")
            continue
        for got, want, what in ((rows, want_rows, "rows"), (cols, want_cols, "columns")):
            if want is not None and got != want and not (role in ("embed", "lm_head") and what == "rows"):
                problems.append(f"{e['name']}: {got} {what}, config implies {want}")
    layers = cfg.get("num_hidden_layers")
    if layers is not None and seen_blocks and max(seen_blocks) + 1 != layers:
        problems.append(f"tensors cover {max(seen_blocks) + 1} layers, config says {layers}")


# ------------------------------------------------------------------------------------------ inspect
def _hadamard_summary(f, cfg_qc: Any) -> dict[str, Any] | None:
    """The activation rotation a checkpoint declares (GGUF ``prism.hadamard.*``, a converted checkpoint's
    ``quantization_config.hadamard``, an MLX Bonsai 2 ``hadamard.json``), from metadata only."""
    if f.format == "gguf":
        kv = {k[len("prism.hadamard."):]: v for k, v in f.metadata.items() if k.startswith("prism.hadamard.")}
        if not kv:
            return None
        return {"source": "prism.hadamard.*", "version": kv.get("version"), "transform": kv.get("transform"),
                "block_size": kv.get("block_size"), "rotated_weights": len(kv.get("weight_names") or []),
                "inverse_weights": len(kv.get("inverse_weight_names") or []),
                "tied_output": bool(kv.get("tied_output", False))}
    if isinstance(cfg_qc, dict) and isinstance(cfg_qc.get("hadamard"), dict):
        h = cfg_qc["hadamard"]
        return {"source": "quantization_config.hadamard", "version": h.get("version"),
                "transform": h.get("transform"), "block_size": h.get("block_size"),
                "rotated_weights": len(h.get("layers") or {}), "inverse_weights": len(h.get("inverse_embeddings") or [])}
    config = getattr(f, "config", None) or {}
    name = config.get("hadamard_config") if isinstance(config, dict) else None
    if name:
        p = Path(f.path if Path(f.path).is_dir() else Path(f.path).parent) / str(name)
        try:
            h = json.loads(p.read_text())
        except (OSError, ValueError):
            return {"source": str(name), "unreadable": True}
        return {"source": str(name), "version": h.get("version"), "transform": h.get("transform"),
                "block_size": h.get("block_size"), "rotated_weights": len(h.get("weight_names") or []),
                "inverse_weights": len(h.get("inverse_weight_names") or [])}
    return None


def build_report(path, level: str) -> tuple[dict[str, Any], list[str], list[str]]:
    from ..sources.reader import open as open_checkpoint

    if level not in LEVELS:
        raise InvalidArgumentError(f"level {level!r}: expected one of {LEVELS}")
    path = Path(path)
    f = open_checkpoint(path)
    problems: list[str] = []
    warnings: list[str] = []
    cfg = shape_config(f, path)
    entries = _scan_tensors(f, level, problems, warnings, path)
    if not cfg.get("vocab_size"):  # no vocab key in the metadata: the embedding's rows say it
        embed = next((e for e in entries if e["role"] == "embed" and len(e["shape"]) == 2), None)
        if embed is not None:
            cfg["vocab_size"] = embed["shape"][0]
            cfg["vocab_size_from"] = embed["name"]
    _consistency(entries, cfg, problems, f.format == "gguf")

    by_type: dict[str, dict[str, int]] = {}
    for e in entries:
        t = by_type.setdefault(e["type"], {"tensors": 0, "params": 0, "bytes": 0})
        t["tensors"] += 1
        t["params"] += e["params"]
        t["bytes"] += e["bytes"]
    linear = [e for e in entries if e["linear"] and e["role"] is not None]
    if _dense_embeddings_by_design(cfg.get("architecture")):
        linear = [e for e in linear if e["role"] not in ("embed", "lm_head")]
    ternary = [e for e in entries if e["kind"] in ("ternary", "dense-ternary")]
    float_linear = [e["name"] for e in linear if e["kind"] == "float"]
    unchecked = [e["name"] for e in linear if e["kind"] == "float" and not e.get("checked_rows")]
    groups = sorted({e["group_size"] for e in ternary if e["group_size"]})
    stats = None
    # The rule convert, verify, inspect and plan share (core.formats.non_ternary_gguf_tensors): a GGUF tensor of a
    # type that is neither ternary nor float makes the file not a ternary model.
    foreign = non_ternary_gguf_tensors(f.tensors) if f.format == "gguf" else []
    not_ternary = describe_non_ternary_types(foreign) if foreign else None
    if not_ternary:
        problems.append(not_ternary)
    invalid = set()  # ternary tensors whose bytes are not a valid ternary weight (code 3, NaN/Inf scales)
    for e in ternary:
        if "scales" in e:
            sc = e["scales"]
            stats = _merge_stats(stats, sc)
            where = e.get("scales_tensor", e["name"])  # a bad scale is blamed on the tensor that holds it
            if sc["nan"] or sc["inf"]:  # the index ternary_rs.decode's validation reports for a bad scale
                invalid.add(e["name"])
                problems.append(f"{where}: {sc['nan']} NaN and {sc['inf']} Inf scales "
                                f"(first at scale index {sc['first_nonfinite']})")
            if sc["count"] and sc["zero"] == sc["count"]:
                problems.append(f"{where}: all {sc['count']} scales are 0: the weight is all zeros")
            if sc["implausible"]:
                problems.append(f"{where}: {sc['implausible']} scales have |s| > {MAX_PLAUSIBLE_SCALE:g} "
                                f"(first at scale index {sc['first_implausible']}): not a trained layer's scale")
            if sc["negative"]:
                warnings.append(f"{where}: {sc['negative']} negative scales (first at scale index "
                                f"{sc['first_negative']}); converters keep the sign in the codes")
        if e.get("code3"):
            invalid.add(e["name"])
            api = e.get("api_error") or {}
            at = f" (first at index {api['first_index']}, as ternary_rs.decode reports it)" \
                if api.get("first_index") is not None else ""
            problems.append(f"{e['name']}: {e['code3']} codes equal 3 (invalid in a ternary tensor){at}")
    total_params = sum(e["params"] for e in entries)
    total_bytes = sum(e["bytes"] for e in entries)
    lin_params = sum(e["params"] for e in linear)
    lin_bytes = sum(e["bytes"] for e in linear)
    tern_params = sum(e["params"] for e in ternary)
    packed_bytes = sum(e["bytes"] for e in ternary if e["kind"] == "ternary")
    packed_params = sum(e["params"] for e in ternary if e["kind"] == "ternary")
    md_name = str(cfg.get("name") or "")
    qc = cfg.get("quantization_config") or {}
    claims = bool(
        (f.format == "gguf" and any(e["type"] in GGUF_TERNARY_GROUPS for e in entries))
        or (isinstance(qc, dict) and qc.get("quant_method") in ("ternary", "bitnet"))
        or CLAIM_PATTERN.search(str(path.name)) or CLAIM_PATTERN.search(md_name)
    )
    # None: float linear weights whose values were not read (header level) decide it.
    is_ternary: bool | None = bool(linear) and not float_linear
    if unchecked and len(unchecked) == len(float_linear):
        is_ternary = None
    # BitNet master weights (transformers' online AutoBitLinear): dense on disk, ternarized at every forward.
    bitnet_master = (isinstance(qc, dict) and qc.get("quant_method") == "bitnet"
                     and qc.get("quantization_mode") == "online" and qc.get("linear_class") == "autobitlinear")
    if bitnet_master and float_linear:
        for e in linear:
            e["ternarize"] = e["kind"] == "float"  # what `convert --ternarize` stores ternary (plan counts it so)
        warnings.append(f"BitNet master weights: {len(float_linear)} dense linear weights that transformers "
                        "ternarizes per tensor by absmean at every forward (quantization_mode 'online'); "
                        "`ternary-rs convert --ternarize` stores them ternary")
    elif linear and unchecked and len(unchecked) == len(float_linear) == len(linear):
        # Header level: the values were not read, so "not ternary" would be a guess.
        warnings.append(f"all {len(linear)} linear weights are dense float "
                        f"({', '.join(sorted({e['type'] for e in linear}))}); their values were not read "
                        "(inspect --scan tells whether they hold exactly ternary values)")
    elif linear and len(float_linear) == len(linear):
        # convert refuses it too (it holds nothing ternary): a problem whatever the file claims to be.
        msg = (f"not a ternary checkpoint: all {len(linear)} linear weights are dense float "
               f"({', '.join(sorted({by for by in (e['type'] for e in linear)}))}) with non-ternary values"
               + (f" (first {INSPECT_SAMPLE_ROWS} rows of each checked)" if level == "sample" else ""))
        not_ternary = not_ternary or msg
        problems.append(("fake ternary: " if claims else "") + msg)
    elif float_linear:
        warnings.append(f"{len(float_linear)} of {len(linear)} linear weights are float, not ternary: "
                        + ", ".join(float_linear[:8]) + (" …" if len(float_linear) > 8 else ""))
    if foreign or invalid:
        is_ternary = False
    if len(groups) > 1:
        warnings.append(f"mixed group sizes {groups}: conversion uses the smallest")
    report = {
        "path": str(path),
        "format": f.format,
        "architecture": cfg.get("architecture"),
        "level": level,
        "config": {k: v for k, v in cfg.items() if k != "quantization_config"},
        "quantization_config": qc or None,
        "hadamard": _hadamard_summary(f, qc),
        "tensors": len(entries),
        "by_type": by_type,
        "parameters": total_params,
        "bytes": total_bytes,
        "bits_per_weight": 8 * total_bytes / total_params if total_params else None,
        "linear_bits_per_weight": 8 * lin_bytes / lin_params if lin_params else None,
        "packed_ternary_bits_per_weight": 8 * packed_bytes / packed_params if packed_params else None,
        "ternary": {
            "tensors": len(ternary),
            "linear_weights": len(linear),
            "parameters": tern_params,
            "group_sizes": groups,
            "scales": stats,
            "float_linear_weights": float_linear,
            "unchecked_float_linear_weights": unchecked,
            "sampled_rows": INSPECT_SAMPLE_ROWS if level == "sample" else None,
        },
        "is_ternary": is_ternary,
        # Why this is not a ternary model at all (non-ternary GGUF types, or only dense non-ternary linear
        # weights): convert refuses it, verify fails, plan refuses. None otherwise.
        "not_ternary": not_ternary,
        "invalid_ternary_tensors": sorted(invalid),
        "claims_ternary": claims,
        "tensor_table": entries,
    }
    return report, problems, warnings


@ternary_errors()
def inspect(path, scan: bool = False) -> dict[str, Any]:
    """A summary of a checkpoint (see module doc): headers only, or with ``scan`` every byte (scale
    statistics, code 3, exactly-ternary float weights). ``problems`` / ``warnings`` list what looks wrong."""
    report, problems, warnings = build_report(path, "full" if scan else "header")
    report["problems"], report["warnings"] = problems, warnings
    return report


# ------------------------------------------------------------------------------------------ verify
@dataclass
class VerifyReport:
    path: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked_files: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    # Why file checksums were not compared (no manifest, or a GGUF, which carries none), else None.
    checksums_not_checked: str | None = None

    def __bool__(self) -> bool:
        return self.ok

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "problems": self.problems, "warnings": self.warnings,
                "checked_files": self.checked_files, "checksums_not_checked": self.checksums_not_checked}

    def __str__(self) -> str:
        if not self.ok:
            status = "FAILED"
        elif self.checksums_not_checked:
            status = f"OK, but SHA-256 not checked ({self.checksums_not_checked})"
        elif self.checked_files == 1:
            status = f"OK (its SHA-256 matches {MANIFEST_NAME})"
        else:
            status = f"OK ({self.checked_files} files match the SHA-256 sums of {MANIFEST_NAME})"
        head = f"{self.path}: {status}"
        lines = [head] + [f"  problem: {p}" for p in self.problems] + [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _check_manifest(root: Path, problems: list[str], warnings: list[str], missing: set[str] | None = None) -> int:
    manifest_path = root / MANIFEST_NAME
    if not manifest_path.is_file():
        return 0
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        problems.append(f"{manifest_path}: unreadable manifest ({e})")
        return 0
    checked = 0
    for rel, want in sorted(files.items()):
        p = root / rel
        if not p.is_file():
            problems.append(f"{rel}: listed in {MANIFEST_NAME} but missing")
            if missing is not None:
                missing.add(rel)
            continue
        size = p.stat().st_size
        if size != want.get("size"):
            problems.append(f"{rel}: size {size}, manifest says {want.get('size')} (truncated or replaced)")
            continue
        digest = sha256_file(p)
        checked += 1
        if digest != want.get("sha256"):
            problems.append(f"{rel}: SHA-256 {digest[:16]}… does not match the manifest ({str(want.get('sha256'))[:16]}…)")
    extra = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and p.name != MANIFEST_NAME and p.relative_to(root).as_posix() not in files)
    if extra:
        warnings.append(f"files not in the manifest: {', '.join(extra[:8])}")
    return checked


def _check_one_listed(path: Path, problems: list[str]) -> tuple[int, str | None]:
    """A single file next to a manifest: its own size and SHA-256 against its entry there. Returns (files
    checked, why not checked)."""
    manifest_path = path.parent / MANIFEST_NAME
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"{manifest_path}: unreadable manifest ({e})")
        return 0, None
    want = files.get(path.name) if isinstance(files, dict) else None
    if not isinstance(want, dict):
        return 0, f"{MANIFEST_NAME} next to it does not list {path.name}"
    size = path.stat().st_size
    if size != want.get("size"):
        problems.append(f"{path}: size {size}, {MANIFEST_NAME} says {want.get('size')} (truncated or replaced)")
        return 0, None
    digest = sha256_file(path)
    if digest != want.get("sha256"):
        problems.append(f"{path}: SHA-256 {digest[:16]}… does not match {MANIFEST_NAME} "
                        f"({str(want.get('sha256'))[:16]}…)")
    return 1, None


def _check_index(root: Path, problems: list[str], missing: set[str] | None = None) -> None:
    missing = set() if missing is None else missing
    index_path = root / INDEX_NAME
    if not index_path.is_file():
        return
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError) as e:
        problems.append(f"{index_path}: unreadable index ({e})")
        return
    for shard in sorted(set(weight_map.values())):
        if not (root / shard).is_file() and shard not in missing:
            problems.append(f"{INDEX_NAME}: shard {shard} is missing")
            missing.add(shard)
        elif not (root / shard).is_file():  # the manifest check reported it: one line naming both lists
            idx = next((i for i, p in enumerate(problems) if p.startswith(f"{shard}: listed in")), None)
            if idx is not None:
                problems[idx] = f"{shard}: missing (listed in {MANIFEST_NAME} and {INDEX_NAME})"


def _check_vllm_contract(root: Path, report: dict[str, Any], problems: list[str]) -> None:
    qc = report.get("quantization_config") or {}
    if not isinstance(qc, dict) or qc.get("quant_method") != "ternary":
        return
    g = qc.get("group_size")
    for key, want in (("format_version", 1), ("scale_dtype", "float16")):
        if qc.get(key) != want:
            problems.append(f"config.json quantization_config.{key} = {qc.get(key)!r}, expected {want!r}")
    for e in report["tensor_table"]:
        if e["type"] == "ternary_rs" and e["group_size"] != g:
            problems.append(f"{e['name']}: scales imply group size {e['group_size']}, config says {g}")


def _check_tokenizer(path: Path, details: dict[str, Any], warnings: list[str]) -> None:
    if details.get("format") == "gguf":
        if not any(k == "tokenizer.ggml.tokens" for k in _gguf_keys(path)):
            warnings.append("no tokenizer (tokenizer.ggml.tokens): llama.cpp and a converted checkpoint will lack one")
        return
    root = path if path.is_dir() else path.parent
    if not any((root / name).is_file() for name in TOKENIZER_FILE_NAMES):
        warnings.append(f"no tokenizer ({', '.join(TOKENIZER_FILE_NAMES)}) in {root}: vLLM needs --tokenizer "
                        "to serve this checkpoint")


def _gguf_keys(path: Path) -> list[str]:
    from ..sources.reader import open as open_checkpoint

    with open_checkpoint(path) as f:
        return list(f.metadata)


@ternary_errors()
def verify(path) -> VerifyReport:
    """Full check (see module doc); ``bool(report)`` is True only when nothing is wrong. A missing path
    raises ``FileNotFoundError`` (like ``inspect``), a damaged file is a problem in the report."""
    path = Path(path)
    if not path.exists():
        raise not_found(path)
    problems: list[str] = []
    warnings: list[str] = []
    details: dict[str, Any] = {}
    root = path if path.is_dir() else path.parent
    checked = 0
    not_checked = None
    missing: set[str] = set()  # files reported missing once (manifest or index), not again by the reader
    if path.is_dir():
        if (path / MANIFEST_NAME).is_file():
            checked = _check_manifest(path, problems, warnings, missing)
        else:
            not_checked = f"no {MANIFEST_NAME} manifest"
        _check_index(path, problems, missing)
    elif (path.parent / MANIFEST_NAME).is_file():  # a file of a ternary_rs output (one shard, say)
        checked, not_checked = _check_one_listed(path, problems)
    else:
        not_checked = f"a single file carries no manifest, and there is no {MANIFEST_NAME} next to it"
    try:
        details, p2, w2 = build_report(path, "full")
        problems += p2
        warnings += w2
        _check_vllm_contract(root, details, problems)
        _check_tokenizer(path, details, warnings)
    except (TernaryError, OSError, ValueError) as e:
        from ..sinks.checkpoint import describe_error

        text = describe_error(e)
        if not any(f"'{name}'" in text or f" {name} " in text for name in missing):  # said once already
            problems.append(text)
    return VerifyReport(str(path), not problems, problems, warnings, checked, details, not_checked)
