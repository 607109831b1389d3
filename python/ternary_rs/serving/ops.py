"""Torch custom ops of ternary_rs — the one place the op is defined.

Contract (stable; the vLLM backend codes against it):

* ``prepare_weight(qweight, scales, group_size) -> (qweight_k, scales_k)`` — called once per layer from
  ``process_weights_after_loading``. Takes the canonical tensors (``uint8 [N, K/4]``, ``float16 [N, K/g]``)
  on the target device and returns them in the layout of that device's kernel (opaque to callers).
  ``prepare_stacked(qweight [E, N, K/4], scales [E, N, K/g], group_size)`` does it for MoE experts, stacked
  along E as ``ternary_moe`` takes them (on the CPU in place, without per-expert copies).
* ``torch.ops.ternary_rs.ternary_linear(x, qweight_k, scales_k, out_features, in_features, group_size,
  bias=None, activations=0)`` — ``y[..., N] = x[..., K] @ W.T (+ bias)`` for bf16/fp16/fp32 ``x``; output
  dtype = ``x.dtype``. ``activations`` picks the activation numerics: 0 auto (the device default), 1 exact
  (f32 sums), 2 int8 per token and weight group, 3 int8 per token (BitNet b1.58's ``activation_quant``);
  see ``_ops_cpu`` for the error bounds.

* ``torch.ops.ternary_rs.ternary_moe(x, topk_weights, topk_ids, w13_qweight, w13_scales, w2_qweight, w2_scales,
  intermediate_size, w13_group_size, w2_group_size, activations=0, apply_router_weight_on_input=False)`` —
  routed ternary experts (Mixture-of-Experts): ``x [M, H]``, the router's ``topk_weights`` / ``topk_ids``
  ``[M, k]``, every expert's fused gate/up ``[2I, H]`` and down ``[H, I]`` weight prepared by
  ``prepare_stacked`` (``prepare_weight`` per expert, stacked along a leading expert dimension:
  ``w13_qweight[e]``); returns ``[M, H]``
  in ``x.dtype``: ``Σ_j w[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t))``. One opaque op, because which
  experts run depends on the data (``torch.compile`` sees its fake implementation). CPU: native
  (bindings ``torch/moe_op.rs`` → core ``kernels/cpu/moe.rs``: the (token, expert) pairs sorted by expert,
  activations quantized once per projection, the experts with few tokens in one parallel region);
  :mod:`ternary_rs.serving._ops_moe` is the same composition through ``ternary_linear`` calls, for a torch
  without the stable C ABI (``NATIVE_MOE_UNAVAILABLE`` says why it runs).

  CUDA is **designed, not built** (the vLLM method refuses a CUDA device, naming the layer): the same
  schema, so the vLLM side does not change, with ``prepare_weight``'s CUDA layout per expert stacked the
  same way (expert e at a fixed stride). A CUDA-graph-safe implementation needs no host sync: (1) an
  align kernel sorts the ``M·k`` (token, slot) pairs by expert into tiles of ``BLOCK_M`` rows, padded per
  expert, and writes a tile -> expert map and the pair order on the device (vLLM's
  ``moe_align_block_size`` does exactly this); (2) a grouped GEMM over those tiles — each CTA takes one
  tile, reads its expert id, streams that expert's 2-bit ``w13`` and runs the ``mma.sync`` main loop of
  ``cuda/`` on the gathered rows, with SiLU-and-mul fused into the epilogue (gate and up rows of a block
  interleaved at prepare time so one CTA holds both); (3) the same grouped GEMM for ``w2``, whose epilogue
  multiplies by the pair's router weight and adds into ``y[token]`` (fp32 atomics, or a per-pair buffer
  reduced by a last small kernel when determinism is wanted). Decode (``M·k`` ≤ 8 pairs) would use the
  GEMV instead, one warp group per (pair, row block). The grid is sized for the worst case
  (``M·k / BLOCK_M + E`` tiles) so it is fixed under graph capture.

* ``torch.ops.ternary_rs.dense_linear(x, weight, bias=None)`` — a dense bf16 / f16 layer of a ternary model
  on the CPU (the Rust core's half-precision kernel where torch's bf16 GEMM is not native).
* ``torch.ops.ternary_rs.fwht(x, block_size, signs=None, inverse=False, gather=None)`` — Bonsai 2's Hadamard
  rotation of the activation (:func:`fwht`; implementations in :mod:`ternary_rs.core.hadamard`). CPU: native
  (bindings ``torch/fwht_op.rs``), else ``_core.fwht`` through Python (``NATIVE_FWHT_UNAVAILABLE``); CUDA:
  ``cuda/fwht.cu`` through Python.

* ``torch.ops.ternary_rs.decode_attention(out, query, kv_cache, seq_lens, block_table, scale, sliding_window=-1,
  softcap=0.0)`` — one decode step's attention over vLLM's paged CPU KV cache (:func:`decode_attention`),
  written into ``out``. CPU: native (bindings ``torch/attention_op.rs`` → core ``attention.rs``), else the same
  result through torch (``NATIVE_ATTENTION_UNAVAILABLE``; the vLLM backend then keeps vLLM's own kernel).

The schemas and the fake implementations (for ``torch.compile(fullgraph=True)``) are defined here. Both
device kernels are registered natively with the dispatcher from Rust, so a call runs no Python: the CPU
one by ``_ops_cpu.register_native`` (on torch's intra-op thread pool), the CUDA one by
``_ops_cuda.register_native`` (on the current stream). Where that cannot be done (a torch without the
stable C ABI, a build without CUDA kernels) the same kernels run through Python
(``NATIVE_CPU_UNAVAILABLE`` / ``NATIVE_CUDA_UNAVAILABLE`` say why).
"""

from __future__ import annotations

import logging

import torch

from ..core import hadamard as _hadamard
from . import _ops_cpu, _ops_cuda, _ops_moe

LIB = "ternary_rs"
OP_NAME = f"{LIB}::ternary_linear"
SCHEMA = (
    "ternary_linear(Tensor x, Tensor qweight, Tensor scales, int out_features, int in_features, "
    "int group_size, Tensor? bias=None, int activations=0) -> Tensor"
)
MOE_OP_NAME = f"{LIB}::ternary_moe"
MOE_SCHEMA = (
    "ternary_moe(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13_qweight, Tensor w13_scales, "
    "Tensor w2_qweight, Tensor w2_scales, int intermediate_size, int w13_group_size, int w2_group_size, "
    "int activations=0, bool apply_router_weight_on_input=False) -> Tensor"
)
DENSE_OP_NAME = f"{LIB}::dense_linear"
DENSE_SCHEMA = "dense_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor"
FWHT_OP_NAME = f"{LIB}::fwht"
FWHT_SCHEMA = "fwht(Tensor x, int block_size, Tensor? signs=None, bool inverse=False, Tensor? gather=None) -> Tensor"
ATTENTION_OP_NAME = f"{LIB}::decode_attention"
ATTENTION_SCHEMA = ("decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor seq_lens, Tensor block_table, "
                    "float scale, int sliding_window=-1, float softcap=0.0) -> ()")
AUTO, EXACT, INT8_GROUP, INT8_TOKEN = _ops_cpu.AUTO, _ops_cpu.EXACT, _ops_cpu.INT8_GROUP, _ops_cpu.INT8_TOKEN

log = logging.getLogger("ternary_rs.ops")


def prepare_weight(qweight: torch.Tensor, scales: torch.Tensor, group_size: int, *, int8_only: bool = False):
    """Permute canonical tensors once into the layout of the kernel for their device. ``int8_only``: the
    weight will only meet the int8 activation modes (bf16 / fp16 activations, or BitNet's per-token mode),
    so on the CPU it may take the layout those modes run fastest on (``_ops_cpu.int8_layout``)."""
    if qweight.device.type == "cuda":
        return _ops_cuda.prepare_weight(qweight, scales, group_size)
    layout = _ops_cpu.int8_layout() if int8_only else "rows4"
    return _ops_cpu.prepare_weight(qweight, scales, group_size, layout)


def prepare_stacked(qweight: torch.Tensor, scales: torch.Tensor, group_size: int):
    """MoE experts ``(uint8 [E, N, K/4], float16 [E, N, K/g])`` → every expert's kernel layout stacked along
    E (``ternary_moe``'s weights). On the CPU written in place into one huge-page tensor."""
    if qweight.device.type == "cuda":
        prepared = [_ops_cuda.prepare_weight(qweight[e], scales[e], group_size) for e in range(qweight.shape[0])]
        return torch.stack([p[0] for p in prepared]), torch.stack([p[1] for p in prepared])
    return _ops_cpu.prepare_stacked(qweight, scales, group_size)


def _fake(x, qweight, scales, out_features, in_features, group_size, bias=None, activations=0):
    return x.new_empty((*x.shape[:-1], out_features))


def _fake_moe(x, topk_weights, topk_ids, w13_qweight, w13_scales, w2_qweight, w2_scales, intermediate_size,
              w13_group_size, w2_group_size, activations=0, apply_router_weight_on_input=False):
    return torch.empty_like(x)


def _fake_dense(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_fwht(x, block_size, signs=None, inverse=False, gather=None):
    return torch.empty_like(x)


def _fake_attention(out, query, kv_cache, seq_lens, block_table, scale, sliding_window=-1, softcap=0.0):
    return None


def _decode_attention_torch(out, query, kv_cache, seq_lens, block_table, scale, sliding_window=-1, softcap=0.0):
    """The decode attention op where its native kernel is not registered: the same result in torch, one
    sequence at a time (gather its blocks, f32 softmax). Also the tests' independent reference."""
    blocks, kv_heads, block_size, two_d = kv_cache.shape
    n, heads, d = query.shape
    if two_d != 2 * d or heads % kv_heads or seq_lens.shape != (n,) or block_table.shape[0] < n:
        raise ValueError(f"decode_attention: query {tuple(query.shape)}, kv_cache {tuple(kv_cache.shape)}, "
                         f"seq_lens {tuple(seq_lens.shape)}, block_table {tuple(block_table.shape)} do not fit")
    # per block and KV head: the keys column-major [d, block_size], then the values row-major [block_size, d]
    flat = kv_cache.view(blocks, kv_heads, 2 * block_size * d)
    keys = flat[..., :block_size * d].view(blocks, kv_heads, d, block_size).transpose(2, 3)
    values = flat[..., block_size * d:].view(blocks, kv_heads, block_size, d)
    rows = out.view(n, heads, d)
    for i, length in enumerate(seq_lens.tolist()):
        start = max(0, length - sliding_window) if sliding_window > 0 else 0
        if length <= start:
            rows[i] = 0
            continue
        ids = block_table[i, :-(-length // block_size)].long()
        k, v = (c[ids].transpose(0, 1).reshape(kv_heads, -1, d)[:, start:length].float() for c in (keys, values))
        s = (query[i].float().view(kv_heads, heads // kv_heads, d) * scale) @ k.transpose(1, 2)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        rows[i] = (torch.softmax(s, dim=-1) @ v).reshape(heads, d).to(out.dtype)


def _dense_linear_torch(x, weight, bias=None):
    """The dense op where its native kernel is not registered: torch's own linear."""
    return torch.nn.functional.linear(x, weight, bias)


def _define_cpu(schema: str, name: str, fake, op: str, fallback, what: str) -> str | None:
    """Define one op with its fake and its native CPU kernel, or ``fallback`` where that cannot be
    registered; returns why not native (None where it is)."""
    _LIBRARY.define(schema)
    torch.library.register_fake(name, fake, lib=_LIBRARY)
    why = _ops_cpu.register_native(op)
    if why is not None:
        log.warning("ternary_rs: native CPU %s registration unavailable (%s); using %s", op, why, what)
        torch.library.impl(name, "cpu", fallback, lib=_LIBRARY)
    return why


def _define() -> tuple[str | None, str | None, str | None, str | None, str | None, str | None]:
    """Define the ops once per process; returns why the CPU linear, the CUDA linear, the CPU MoE kernel,
    the CPU dense linear, the CPU FWHT and the CPU decode attention are not native (None where they are)."""
    global _LIBRARY
    _LIBRARY = torch.library.Library(LIB, "FRAGMENT")  # kept alive: dropping it removes the op
    python_path = "the Python path"
    why_cpu = _define_cpu(SCHEMA, OP_NAME, _fake, "ternary_linear", _ops_cpu.ternary_linear, python_path)
    why_cuda = _ops_cuda.register_native()
    if why_cuda is not None:
        if torch.cuda.is_available():  # on a CPU-only machine the Python path only reports errors
            log.warning("ternary_rs: native CUDA op registration unavailable (%s); using the Python path", why_cuda)
        torch.library.impl(OP_NAME, "cuda", _ops_cuda.ternary_linear, lib=_LIBRARY)
    why_moe = _define_cpu(MOE_SCHEMA, MOE_OP_NAME, _fake_moe, "ternary_moe", _ops_moe.ternary_moe, python_path)
    why_dense = _define_cpu(DENSE_SCHEMA, DENSE_OP_NAME, _fake_dense, "dense_linear", _dense_linear_torch,
                            "torch's linear")
    why_fwht = _define_cpu(FWHT_SCHEMA, FWHT_OP_NAME, _fake_fwht, "fwht", _hadamard.fwht_cpu, python_path)
    torch.library.impl(FWHT_OP_NAME, "cuda", _hadamard.fwht_cuda, lib=_LIBRARY)
    why_attention = _define_cpu(ATTENTION_SCHEMA, ATTENTION_OP_NAME, _fake_attention, "decode_attention",
                                _decode_attention_torch, "torch")
    return why_cpu, why_cuda, why_moe, why_dense, why_fwht, why_attention


_LIBRARY: torch.library.Library | None = None
(NATIVE_CPU_UNAVAILABLE, NATIVE_CUDA_UNAVAILABLE, NATIVE_MOE_UNAVAILABLE, NATIVE_DENSE_UNAVAILABLE,
 NATIVE_FWHT_UNAVAILABLE, NATIVE_ATTENTION_UNAVAILABLE) = _define()
"""Why the CPU linear / the CUDA linear / the CPU MoE kernel / the CPU dense linear / the CPU FWHT / the CPU
decode attention runs through Python (None: registered natively)."""


def dense_linear(x, weight, bias=None):
    """``torch.ops.ternary_rs.dense_linear``: ``x · weightᵀ (+ bias)`` for a dense bf16 / f16 weight on the
    CPU, f32 sums (``ternary_core::kernels::cpu::half_linear``); x has the weight's dtype."""
    return torch.ops.ternary_rs.dense_linear(x, weight, bias)


def fwht(x, block_size, signs=None, inverse=False, gather=None):
    """``torch.ops.ternary_rs.fwht``: Bonsai 2's blockwise normalized Hadamard rotation along the last dim of
    ``x`` (same shape and dtype). ``inverse=False``: ``x[..., gather] · signs → H/√block`` (the input transform
    of a rotated linear); ``inverse=True``: ``H/√block → · signs`` (an inverse-rotated embedding row).
    ``signs``: float32 ±1 of length ``x.shape[-1]``; ``gather``: an int32 permutation of its indices. See
    :mod:`ternary_rs.core.hadamard`."""
    return torch.ops.ternary_rs.fwht(x, block_size, signs, inverse, gather)


def decode_attention(out, query, kv_cache, seq_lens, block_table, scale, sliding_window=-1, softcap=0.0):
    """``torch.ops.ternary_rs.decode_attention``: one query token per sequence attending to its cached keys.
    ``query [n, heads, d]``, ``kv_cache [blocks, kv_heads, block_size, 2·d]`` (as vLLM's ``CPU_ATTN`` writes
    it for its ``vec`` / ``vec16`` kernels: per block and KV head the keys column-major ``[d, block_size]``,
    then the values row-major ``[block_size, d]``), ``seq_lens`` int32 ``[n]`` (the new token included),
    ``block_table`` int32 ``[>= n, max blocks]``; ``out [n, heads, d]`` (or ``[n, heads·d]``) of the query's
    dtype receives ``softmax(scale·q·Kᵀ)·V`` over the last ``sliding_window`` keys (all where ≤ 0), scores
    soft-capped where ``softcap > 0``. f32 arithmetic throughout (see ``ternary_core::attention``)."""
    torch.ops.ternary_rs.decode_attention(out, query, kv_cache, seq_lens, block_table, scale, sliding_window, softcap)


def ternary_linear(x, qweight, scales, out_features, in_features, group_size, bias=None, activations=AUTO):
    """``torch.ops.ternary_rs.ternary_linear`` (a convenience alias)."""
    return torch.ops.ternary_rs.ternary_linear(x, qweight, scales, out_features, in_features, group_size, bias,
                                               activations)
