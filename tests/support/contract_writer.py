"""Independent writer of the ternary checkpoint contract (docs/checkpoint.md#checkpoint-contract).

Plain NumPy + ``safetensors.numpy``; shares no code with ``ternary_rs``. Used by the vLLM tests to build
checkpoints, and to cross-check ``ternary_rs.convert``'s output.

From an HF directory whose selected 2-D weights are already ternary per group (``w = t · a``, a the group
absmax, as ``tests/support/models.py`` builds them) it writes, for each such ``<prefix>.weight [N, K]``:

* ``<prefix>.qweight``: ``uint8 [N, K/4]``, code ``t + 1`` of ``W[n, k]`` at bits ``2·(k % 4)`` of byte
  ``k // 4`` (least significant first);
* ``<prefix>.scales``: ``float16 [N, K/g]``, ``a = max |w|`` over the group (0 for an all-zero group);

and copies every other tensor unchanged, split over ``num_shards`` files with a
``model.safetensors.index.json``. ``config.json`` gets the ``quantization_config`` block.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

DEFAULT_TERNARY_SUFFIXES = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
    "gate_proj.weight", "up_proj.weight", "down_proj.weight",
    "lm_head.weight", "embed_tokens.weight",
)
COPIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "vocab.json", "merges.txt",
)


def ternarize_groups(w: np.ndarray, group_size: int, exact: bool = True):
    """Group absmax ternarization of ``w [N, K]`` -> (codes uint8 [N, K] in {0,1,2}, scales fp16 [N, K/g])."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K = {k} is not a multiple of group_size = {group_size}")
    groups = w.astype(np.float32).reshape(n, k // group_size, group_size)
    a16 = np.abs(groups).max(axis=-1).astype(np.float16)
    divisor = np.where(a16 == 0, 1.0, a16.astype(np.float32))[..., None]  # all-zero group: t = 0, scale 0
    t = np.clip(np.rint(groups / divisor), -1, 1)
    if exact and not np.array_equal(t * a16.astype(np.float32)[..., None], groups):
        raise ValueError("weight is not ternary per group (w != t * fp16(absmax)); pass exact=False to requantize")
    return (t + 1).astype(np.uint8).reshape(n, k), a16


def pack_codes_lsb_first(codes: np.ndarray) -> np.ndarray:
    """``[N, K]`` codes -> ``[N, K/4]`` bytes, code of column 4j+i at bits 2i."""
    n, k = codes.shape
    c = codes.reshape(n, k // 4, 4).astype(np.uint8)
    return (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).astype(np.uint8)


def unpack_codes_lsb_first(qweight: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_codes_lsb_first`."""
    n, kb = qweight.shape
    out = np.empty((n, kb, 4), dtype=np.uint8)
    for i in range(4):
        out[..., i] = (qweight >> (2 * i)) & 3
    return out.reshape(n, kb * 4)


def dequantize(qweight: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """Canonical tensors -> float32 ``W [N, K]`` (``(c - 1) · scale``)."""
    t = unpack_codes_lsb_first(qweight).astype(np.float32) - 1.0
    n, k = t.shape
    return (t.reshape(n, k // group_size, group_size) * scales.astype(np.float32)[..., None]).reshape(n, k)


def _read_hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    return tensors


def write_contract(
    hf_dir,
    out_dir,
    group_size: int = 128,
    modules_not_converted: tuple[str, ...] = (),
    ternary_suffixes: tuple[str, ...] = DEFAULT_TERNARY_SUFFIXES,
    num_shards: int = 2,
    extra_quant_config: dict | None = None,
) -> Path:
    """Write the contract checkpoint of ``hf_dir`` to ``out_dir``; returns ``out_dir``."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = _read_hf_tensors(hf_dir)

    out: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        skipped = prefix is not None and any(
            prefix == m or prefix.endswith("." + m) for m in modules_not_converted
        )
        if prefix is not None and w.ndim == 2 and name.endswith(ternary_suffixes) and not skipped:
            codes, scales = ternarize_groups(w, group_size)
            out[f"{prefix}.qweight"] = pack_codes_lsb_first(codes)
            out[f"{prefix}.scales"] = scales
        else:
            out[name] = w

    names = sorted(out)
    shards = [names[i::num_shards] for i in range(num_shards)]
    shards = [s for s in shards if s]
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: np.ascontiguousarray(out[n]) for n in shard}, str(out_dir / fname), metadata={"format": "pt"})
        for n in shard:
            weight_map[n] = fname
            total += out[n].nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    config["quantization_config"] = {
        "quant_method": "ternary",
        "format_version": 1,
        "group_size": group_size,
        "scale_dtype": "float16",
        "modules_not_converted": list(modules_not_converted),
        **(extra_quant_config or {}),
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in COPIED_FILES:
        if (hf_dir / f).exists():
            shutil.copy2(hf_dir / f, out_dir / f)
    return out_dir


def read_contract(ckpt_dir) -> tuple[dict, dict[str, np.ndarray]]:
    """(quantization_config, all tensors) of a contract checkpoint, for cross-checks."""
    ckpt_dir = Path(ckpt_dir)
    qc = json.loads((ckpt_dir / "config.json").read_text())["quantization_config"]
    return qc, _read_hf_tensors(ckpt_dir)


if __name__ == "__main__":
    import sys

    write_contract(sys.argv[1], sys.argv[2], group_size=int(sys.argv[3]) if len(sys.argv) > 3 else 128)
