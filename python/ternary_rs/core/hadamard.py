"""Bonsai 2's Hadamard activation rotation: the ``ternary_rs::fwht`` torch op and the rotation description.

PrismML folds a rotation into Bonsai 2's ternary weights (docs/formats.md#bonsai2-rotation): ``W' = W·D·H`` with
``D = diag(s)`` (one ±1 sign vector per input width) and ``H`` block-diagonal normalized Sylvester–Hadamard
(block 1024 in the real model). ``W'`` stays exactly ternary, so instead of un-rotating it the activation is
rotated before the ternary GEMM: ``y = W'·(H·D·x)`` — optionally after a gather (the GDN head permutation).
Embedding rows are stored inverse-rotated and are recovered as ``e = H·row`` then ``·s``.

This module holds

* the implementations behind the op ``torch.ops.ternary_rs.fwht(x, block_size, signs, inverse, gather)``
  (defined with the other ops in :mod:`ternary_rs.serving.ops`; its CPU kernel is registered natively from
  Rust, ``fwht_op.rs`` of the bindings): :func:`fwht_cpu` (the same Rust transform through ``_core.fwht``,
  for a torch without the stable C ABI), :func:`fwht_cuda` (``cuda/fwht.cu`` when the extension was built
  with CUDA, else :func:`fwht_torch`, a torch butterfly),
* :class:`HadamardSpec` — the validated rotation description, read from GGUF ``prism.hadamard.*`` metadata or
  MLX ``hadamard.json`` (versions 1 and 2 — 2 adds ``tied_output``, see :func:`tied_output`; ``axis`` and
  ``sign_mode`` required as upstream requires them; ``sign_mode`` ``explicit`` or ``identity``) and written to / read from ``quantization_config["hadamard"]`` of a converted
  checkpoint. Anything it does not understand is refused: serving rotated weights without the rotation
  gives garbage, never an error, so the error has to come from here.
* :func:`reference_transform` — a plain NumPy (float64, dense matrix) reference used by tests.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import _core
from .._core import ValidationError

# What PrismML writes (and the only thing this version understands).
PRISM_VERSIONS = (1, 2)  # 2 adds ``tied_output`` (token_embd is also the output head)
PRISM_TRANSFORM = "normalized-sylvester-walsh-hadamard"
PRISM_AXIS = "input-last-dimension"
PRISM_SIGN_MODES = ("explicit", "identity")  # identity: no sign arrays, s = 1
PRISM_PREFIX = "prism.hadamard."
# Version of the ``quantization_config["hadamard"]`` entry written by ternary_rs.
CHECKPOINT_VERSION = 1
MAX_BLOCK_SIZE = int(getattr(_core, "HADAMARD_MAX_BLOCK_SIZE", 1 << 16))
CUDA_MAX_BLOCK_SIZE = 8192  # cuda/fwht.h TERNARY_FWHT_MAX_BLOCK (one block in shared memory)

_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# --------------------------------------------------------------------------------------------------------
# The op's implementations (the op itself: ternary_rs.serving.ops)
# --------------------------------------------------------------------------------------------------------


def _np_signs(signs: torch.Tensor | None) -> np.ndarray | None:
    if signs is None:
        return None
    return signs.detach().to("cpu", torch.float32).contiguous().numpy()


def _np_gather(gather: torch.Tensor | None) -> np.ndarray | None:
    if gather is None:
        return None
    g = gather.detach().to("cpu")
    if g.dtype != torch.int32:
        g = g.to(torch.int32)
    return g.contiguous().numpy().view(np.uint32)


def fwht_cpu(x, block_size, signs=None, inverse=False, gather=None):
    """The CPU kernel through Python (``_core.fwht``): the op's CPU implementation where the native
    registration is unavailable."""
    kind = _KERNEL_DTYPES.get(x.dtype)
    if kind is None:  # e.g. float64: compute in float32
        return fwht_cpu(x.to(torch.float32), block_size, signs, inverse, gather).to(x.dtype)
    src = x.contiguous()
    out = torch.empty_like(src)
    if src.numel() == 0:
        return out
    if kind == "float32":
        a, b = src.numpy(), out.numpy()
    else:
        a, b = src.view(torch.int16).numpy().view(np.uint16), out.view(torch.int16).numpy().view(np.uint16)
    # Many rows run on torch's intra-op pool: its threads are awake after the previous op.
    _core.fwht(a, b, int(block_size), kind, bool(inverse), _np_signs(signs), _np_gather(gather), torch_pool=True)
    return out


def fwht_cuda(x, block_size, signs=None, inverse=False, gather=None):
    """The op's CUDA implementation: ``cuda/fwht.cu`` when the extension was built with CUDA, else
    :func:`fwht_torch`."""
    launch = getattr(_core, "fwht_cuda", None)
    kind = _KERNEL_DTYPES.get(x.dtype)
    if launch is None or kind is None or x.numel() == 0 or block_size > CUDA_MAX_BLOCK_SIZE:
        return fwht_torch(x, block_size, signs, inverse, gather)
    _check_args(x.shape[-1], block_size, signs, gather)
    src = x.contiguous()
    out = torch.empty_like(src)
    s = None if signs is None else signs.to(device=x.device, dtype=torch.float32).contiguous()
    g = None if gather is None else gather.to(device=x.device, dtype=torch.int32).contiguous()
    width = src.shape[-1]
    launch(
        src.data_ptr(),
        out.data_ptr(),
        src.numel() // width,
        width,
        int(block_size),
        kind,
        bool(inverse),
        0 if s is None else s.data_ptr(),
        0 if g is None else g.data_ptr(),
        torch.cuda.current_stream(x.device).cuda_stream,
    )
    return out


def _check_args(width, block_size, signs, gather):
    if block_size <= 0 or block_size & (block_size - 1) or block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"hadamard block size {block_size} must be a power of two in 1..={MAX_BLOCK_SIZE}")
    if width % block_size:
        raise ValueError(f"hadamard row width {width} is not a multiple of the block size {block_size}")
    if signs is not None and signs.numel() != width:
        raise ValueError(f"hadamard sign vector has {signs.numel()} entries, row width is {width}")
    if gather is not None and gather.numel() != width:
        raise ValueError(f"hadamard gather permutation has {gather.numel()} entries, row width is {width}")


def fwht_torch(x, block_size, signs=None, inverse=False, gather=None):
    """Plain torch butterfly (any device): the CUDA fallback when the extension has no CUDA kernels."""
    _check_args(x.shape[-1], block_size, signs, gather)
    y = x.to(torch.float32)
    if gather is not None:
        y = y.index_select(-1, gather.to(device=x.device, dtype=torch.long))
    if signs is not None and not inverse:
        y = y * signs.to(device=x.device, dtype=torch.float32)
    shape = y.shape
    y = y.reshape(-1, shape[-1] // block_size, block_size)
    h = 1
    while h < block_size:
        y = y.view(y.shape[0], y.shape[1], block_size // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=3).reshape(y.shape[0], y.shape[1], block_size)
        h *= 2
    y = y.reshape(shape) * (1.0 / math.sqrt(block_size))
    if signs is not None and inverse:
        y = y * signs.to(device=x.device, dtype=torch.float32)
    return y.to(x.dtype)


def gdn_tiled_to_grouped(num_v_heads: int, num_k_heads: int, head_dim: int) -> np.ndarray:
    """Gather ``grouped[i] = tiled[perm[i]]`` turning llama.cpp's tiled V-head order into HF's grouped one."""
    return np.asarray(_core.gdn_tiled_to_grouped(num_v_heads, num_k_heads, head_dim), dtype=np.int64)


# --------------------------------------------------------------------------------------------------------
# NumPy reference (tests only; float64, dense Sylvester matrix)
# --------------------------------------------------------------------------------------------------------


def sylvester(n: int) -> np.ndarray:
    """Unnormalized Sylvester–Hadamard matrix of order ``n`` (a power of two): ``H[i, j] = (-1)^popcount(i&j)``."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def reference_transform(x, block_size, signs=None, inverse=False, gather=None) -> np.ndarray:
    """Dense float64 reference of :func:`fwht` (rows along the last axis)."""
    x = np.asarray(x, dtype=np.float64)
    if gather is not None:
        x = x[..., np.asarray(gather)]
    if signs is not None and not inverse:
        x = x * np.asarray(signs, dtype=np.float64)
    h = sylvester(block_size) / math.sqrt(block_size)
    y = (x.reshape(*x.shape[:-1], -1, block_size) @ h.T).reshape(x.shape)
    if signs is not None and inverse:
        y = y * np.asarray(signs, dtype=np.float64)
    return y


# --------------------------------------------------------------------------------------------------------
# The rotation description
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GdnPermute:
    """The activation reaching a layer is in ``source`` V-head order but its weight expects ``target`` order."""

    source: str  # "grouped" | "tiled"
    target: str
    num_v_heads: int
    num_k_heads: int
    head_dim: int

    def gather(self) -> np.ndarray:
        t2g = gdn_tiled_to_grouped(self.num_v_heads, self.num_k_heads, self.head_dim)
        if (self.source, self.target) == ("tiled", "grouped"):
            return t2g
        inv = np.empty_like(t2g)  # grouped → tiled is the inverse permutation
        inv[t2g] = np.arange(t2g.size)
        return inv

    def to_json(self) -> dict:
        return {
            "from": self.source,
            "to": self.target,
            "num_v_heads": self.num_v_heads,
            "num_k_heads": self.num_k_heads,
            "head_dim": self.head_dim,
        }


@dataclass(frozen=True)
class HadamardSpec:
    """Validated rotation: block size, one ±1 sign vector per input width, rotated layers, inverse embeddings.

    Layer and embedding names are checkpoint (Hugging Face) module names without ``.weight``, e.g.
    ``model.layers.0.mlp.down_proj``; ``layers`` maps each to its input width and optional GDN permutation.
    """

    block_size: int
    signs: Mapping[int, np.ndarray]
    layers: Mapping[str, tuple[int, GdnPermute | None]]
    inverse_embeddings: tuple[str, ...] = ()
    source: str = field(default="", compare=False)

    # ---- checks shared by every reader ------------------------------------------------------------------
    def __post_init__(self):
        where = self.source or "hadamard config"
        b = self.block_size
        if not isinstance(b, int) or b <= 0 or b & (b - 1) or b > MAX_BLOCK_SIZE:
            raise ValidationError(f"{where}: block size {b!r} must be a power of two in 1..={MAX_BLOCK_SIZE}")
        for width, s in self.signs.items():
            if width <= 0 or width % b:
                raise ValidationError(f"{where}: sign width {width} is not a positive multiple of block {b}")
            if s.shape != (width,):
                raise ValidationError(f"{where}: sign vector for width {width} has shape {s.shape}")
            bad = np.flatnonzero((s != 1) & (s != -1))
            if bad.size:
                raise ValidationError(
                    f"{where}: sign vector for width {width} holds {s[bad[0]]} at index {bad[0]} "
                    f"({bad.size} entries not ±1)"
                )
            if s.dtype != np.int8:
                self.signs[width] = s.astype(np.int8)  # type: ignore[index]
        for name, (width, perm) in self.layers.items():
            if width not in self.signs:
                raise ValidationError(
                    f"{where}: layer '{name}' has input width {width} but no sign vector of that width "
                    f"(widths: {sorted(self.signs)})"
                )
            if perm is not None and perm.num_v_heads * perm.head_dim != width:
                raise ValidationError(f"{where}: GDN permutation of '{name}' does not cover its width {width}")
        for name in self.inverse_embeddings:
            if name in self.layers:
                raise ValidationError(f"{where}: '{name}' is listed as both rotated layer and inverse embedding")

    def signs_for(self, width: int) -> np.ndarray:
        return self.signs[width]

    # ---- GGUF / MLX (PrismML's own description) ---------------------------------------------------------
    @classmethod
    def from_prism(
        cls,
        kv: Mapping[str, Any],
        resolve: Callable[[str], tuple[str, int] | None],
        gdn_permute_for: Callable[[str], GdnPermute | None] = lambda name: None,
        source: str = "",
    ) -> HadamardSpec:
        """Read PrismML's keys (``kv`` without the ``prism.hadamard.`` prefix).

        ``resolve(weight_name)`` maps a listed source tensor name to ``(checkpoint module, input width)``, or
        ``None`` if the file has no such tensor (an error: the rotation would silently not be applied);
        ``gdn_permute_for(module)`` says which layers need the GDN permutation at run time.
        """
        where = source or "prism.hadamard"

        def need(key):
            if key not in kv:
                raise ValidationError(f"{where}: required key 'prism.hadamard.{key}' is missing")
            return kv[key]

        version = _as_int(need("version"), where, "version")
        if version not in PRISM_VERSIONS:
            raise ValidationError(
                f"{where}: prism.hadamard.version {version} is not supported (this ternary_rs knows versions "
                f"{list(PRISM_VERSIONS)}); refusing rather than serving wrongly rotated weights"
            )
        tied_output(kv, where)  # validates version / tied_output agreement
        # Upstream requires all three strings; a missing one is an error, not a default.
        for key, allowed in (("transform", (PRISM_TRANSFORM,)), ("axis", (PRISM_AXIS,)),
                             ("sign_mode", PRISM_SIGN_MODES)):
            got = need(key)
            if got not in allowed:
                raise ValidationError(
                    f"{where}: prism.hadamard.{key} = {got!r} is not supported (expected one of {list(allowed)})"
                )
        block = _as_int(need("block_size"), where, "block_size")
        layers: dict[str, tuple[int, GdnPermute | None]] = {}
        names = _as_list(need("weight_names"), where, "weight_names")
        hits = []
        for name in names:
            hit = resolve(str(name))
            if hit is None:
                raise ValidationError(f"{where}: rotated weight '{name}' is not a tensor of this model")
            hits.append(hit)
        inverse_hits = []
        for name in _as_list(kv.get("inverse_weight_names", []), where, "inverse_weight_names"):
            hit = resolve(str(name))
            if hit is None:
                raise ValidationError(f"{where}: inverse-rotated weight '{name}' is not a tensor of this model")
            inverse_hits.append(hit)
        if kv["sign_mode"] == "identity":
            signs = _identity_signs(kv, [w for _, w in hits + inverse_hits], where)
        else:
            signs = _explicit_signs(kv, need, where)
        for module, width in hits:
            layers[module] = (width, gdn_permute_for(module))
        return cls(block, signs, layers, tuple(m for m, _ in inverse_hits), source=where)

    # ---- quantization_config["hadamard"] ----------------------------------------------------------------
    def to_config(self) -> dict:
        widths = sorted(self.signs)
        return {
            "version": CHECKPOINT_VERSION,
            "transform": PRISM_TRANSFORM,
            "block_size": self.block_size,
            "sign_widths": widths,
            "sign_values": [int(v) for w in widths for v in self.signs[w]],
            "layers": {
                name: ({"width": w} | ({"gdn_permute": p.to_json()} if p else {}))
                for name, (w, p) in sorted(self.layers.items())
            },
            "inverse_embeddings": list(self.inverse_embeddings),
        }

    @classmethod
    def from_config(cls, cfg: Any, source: str = "quantization_config.hadamard") -> HadamardSpec:
        """Parse and validate the checkpoint entry; anything unknown or malformed raises ValidationError."""
        where = source
        if not isinstance(cfg, Mapping):
            raise ValidationError(f"{where}: expected an object, got {type(cfg).__name__}")
        known = {"version", "transform", "block_size", "sign_widths", "sign_values", "layers", "inverse_embeddings"}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValidationError(f"{where}: unknown keys {unknown}; refusing a rotation this version cannot honour")
        if cfg.get("version") != CHECKPOINT_VERSION:
            raise ValidationError(
                f"{where}: version {cfg.get('version')!r} is not supported (expected {CHECKPOINT_VERSION})"
            )
        if cfg.get("transform") != PRISM_TRANSFORM:
            raise ValidationError(f"{where}: transform {cfg.get('transform')!r} is not supported")
        block = _as_int(cfg.get("block_size"), where, "block_size")
        widths = [_as_int(w, where, "sign_widths") for w in _as_list(cfg.get("sign_widths"), where, "sign_widths")]
        values = _as_signs(cfg.get("sign_values"), where)
        if values.size != sum(widths) or len(set(widths)) != len(widths):
            raise ValidationError(f"{where}: {values.size} sign values do not match sign_widths {widths}")
        signs, at = {}, 0
        for w in widths:
            signs[w] = values[at : at + w]
            at += w
        layers_cfg = cfg.get("layers")
        if not isinstance(layers_cfg, Mapping) or not layers_cfg:
            raise ValidationError(f"{where}: 'layers' must be a non-empty object")
        layers = {}
        for name, entry in layers_cfg.items():
            if not isinstance(entry, Mapping) or set(entry) - {"width", "gdn_permute"}:
                raise ValidationError(f"{where}: layer '{name}': malformed entry {entry!r}")
            perm = None
            if "gdn_permute" in entry:
                p = entry["gdn_permute"]
                what = f"layers.{name}.gdn_permute"
                if not isinstance(p, Mapping) or set(p) != {"from", "to", "num_v_heads", "num_k_heads", "head_dim"}:
                    raise ValidationError(f"{where}: layer '{name}': malformed gdn_permute {p!r}")
                perm = GdnPermute(p["from"], p["to"], _as_int(p["num_v_heads"], where, f"{what}.num_v_heads"),
                                  _as_int(p["num_k_heads"], where, f"{what}.num_k_heads"),
                                  _as_int(p["head_dim"], where, f"{what}.head_dim"))
                if not (isinstance(perm.source, str) and isinstance(perm.target, str)) or \
                        {perm.source, perm.target} != {"tiled", "grouped"}:
                    raise ValidationError(f"{where}: layer '{name}': unknown GDN layouts {p!r}")
                if min(perm.num_k_heads, perm.num_v_heads, perm.head_dim) <= 0 or perm.num_v_heads % perm.num_k_heads:
                    raise ValidationError(f"{where}: layer '{name}': bad GDN head counts {p!r}")
            layers[str(name)] = (_as_int(entry.get("width"), where, f"layers.{name}.width"), perm)
        inverse = tuple(str(n) for n in _as_list(cfg.get("inverse_embeddings", []), where, "inverse_embeddings"))
        return cls(block, signs, layers, inverse, source=where)


def _as_int(v, where, key) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValidationError(f"{where}: '{key}' must be an integer, got {v!r}")
    return int(v)


def _as_signs(v, where) -> np.ndarray:
    """``sign_values`` as int8: a flat array of integers, each -1 or +1."""
    values = _as_list(v, where, "sign_values")
    for i, x in enumerate(values):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x not in (-1, 1):
            raise ValidationError(f"{where}: sign_values[{i}] = {x!r} is not -1 or +1")
    return np.asarray(values, dtype=np.int8)


def _as_list(v, where, key) -> list:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if not isinstance(v, (list, tuple)):
        raise ValidationError(f"{where}: '{key}' must be an array, got {type(v).__name__}")
    return list(v)


def _explicit_signs(kv: Mapping[str, Any], need, where: str) -> dict[int, np.ndarray]:
    """``sign_widths`` / ``sign_values`` (any integer element width) → one sign vector per width."""
    widths = [_as_int(w, where, "sign_widths") for w in _as_list(need("sign_widths"), where, "sign_widths")]
    values = _as_signs(need("sign_values"), where)
    if values.size != sum(widths):
        raise ValidationError(
            f"{where}: sign_values has {values.size} entries but sign_widths {widths} sum to {sum(widths)}"
        )
    if len(set(widths)) != len(widths):
        raise ValidationError(f"{where}: sign_widths {widths} repeats a width")
    signs, at = {}, 0
    for w in widths:
        signs[w] = values[at : at + w]
        at += w
    return signs


def _identity_signs(kv: Mapping[str, Any], widths: list[int], where: str) -> dict[int, np.ndarray]:
    """``sign_mode = "identity"``: s = 1 for every width in use. Sign arrays, if present anyway, must be +1."""
    values = _as_signs(kv.get("sign_values", []), where)
    if values.size and not np.all(values == 1):
        raise ValidationError(
            f"{where}: prism.hadamard.sign_mode is 'identity' but sign_values holds "
            f"{int(np.count_nonzero(values != 1))} entries other than +1"
        )
    return {w: np.ones(w, dtype=np.int8) for w in sorted(set(widths))}


def tied_output(kv: Mapping[str, Any], source: str = "") -> bool:
    """Whether PrismML's keys (without the prefix) say ``token_embd`` is also the output head (version 2
    with ``tied_output = true``). ``tied_output`` with version 1 is refused: that version does not know it."""
    where = source or "prism.hadamard"
    tied = kv.get("tied_output", False)
    if not isinstance(tied, (bool, np.bool_)):
        raise ValidationError(f"{where}: prism.hadamard.tied_output must be a bool, got {tied!r}")
    if tied and _as_int(kv.get("version"), where, "version") < 2:
        raise ValidationError(
            f"{where}: prism.hadamard.tied_output is set but prism.hadamard.version is "
            f"{kv.get('version')}; tied_output needs version 2"
        )
    return bool(tied)


def prism_keys(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The ``prism.hadamard.*`` entries of GGUF metadata, without the prefix."""
    return {k[len(PRISM_PREFIX):]: v for k, v in metadata.items() if k.startswith(PRISM_PREFIX)}


def is_rotated(metadata: Mapping[str, Any]) -> bool:
    """Whether metadata asks for the Hadamard rotation: GGUF ``prism.hadamard.*`` keys, an MLX Bonsai 2
    ``config.json``, or a converted checkpoint's ``config.json`` with ``quantization_config.hadamard``."""
    qc = metadata.get("quantization_config")
    return (
        any(str(k).startswith(PRISM_PREFIX) for k in metadata)
        or metadata.get("model_type") == "prism_hadamard_qwen35"
        or (isinstance(qc, Mapping) and qc.get("hadamard") is not None)
    )


def unrotate_weight(w: np.ndarray, spec: HadamardSpec, module: str) -> np.ndarray:
    """The dense weight a rotated checkpoint module stands for, in the order its input arrives.

    ``W = W'·H·D`` per row (FWHT then signs; the Rust transform, float32), and for a layer with a GDN
    permutation (``T(x) = H·D·x[gather]``) column ``gather[i]`` of the result is column ``i`` of ``W'·H·D``.
    Modules the spec does not list are returned unchanged.
    """
    key = canonical_module_name(module)
    layers = {canonical_module_name(n): v for n, v in spec.layers.items()}
    inverse = {canonical_module_name(n) for n in spec.inverse_embeddings}
    if key not in layers and key not in inverse:
        return w
    x = np.ascontiguousarray(w, dtype=np.float32)
    signs = spec.signs.get(x.shape[-1])
    if signs is None:
        raise ValidationError(f"{spec.source}: '{module}' has width {x.shape[-1]}, no sign vector of that width")
    out = np.empty_like(x)
    _core.fwht(x, out, spec.block_size, "float32", True, signs.astype(np.float32), None)
    perm = layers[key][1] if key in layers else None
    if perm is not None:
        act = np.empty_like(out)
        act[:, perm.gather()] = out
        out = act
    return out


def refuse_if_rotated(metadata: Mapping[str, Any], what: str, source: str = "") -> None:
    """Raise if ``metadata`` asks for the rotation and the calling tool path (``what``) would drop it."""
    if is_rotated(metadata):
        raise ValidationError(
            f"{source or 'input'}: its weights are stored Hadamard-rotated (prism.hadamard.*), which {what} "
            "does not apply; the result would be garbage. Use `ternary-rs convert` to a vLLM checkpoint "
            "(the qwen35 path keeps the rotation)."
        )


def canonical_module_name(name: str) -> str:
    """Reduce a checkpoint or vLLM module name to a prefix-independent key: ``layers.N.…``, or the last part.

    ``model.layers.3.mlp.down_proj``, ``language_model.model.layers.3.mlp.down_proj`` and
    ``model.language_model.layers.3.mlp.down_proj`` all become ``layers.3.mlp.down_proj``;
    ``lm_head`` / ``model.embed_tokens`` become ``lm_head`` / ``embed_tokens``; MTP modules keep their
    ``mtp.`` prefix (``mtp.layers.0.self_attn.q_proj``, ``mtp.fc``) so they never alias decoder layer 0.
    """
    name = re.sub(r"\.(weight|qweight|scales)$", "", name)
    m = re.search(r"(?:^|\.)(mtp\..*)$", name)  # the MTP head: its own layers.N, not the decoder's
    if m:
        return m.group(1)
    m = re.search(r"(?:^|\.)(layers\.\d+\..*)$", name)
    if m:
        return m.group(1)
    return name.rsplit(".", 1)[-1]
