"""Python implementation of ``ternary_rs::ternary_moe`` on the CPU: routed ternary experts through ``ternary_linear``.

The op runs natively (bindings ``torch/moe_op.rs``, core ``kernels/cpu/moe.rs``: one dispatch and two
parallel regions per layer); this composition serves a torch without the stable C ABI, and is the
reference the native kernel is tested against (same numerics: ``tests/test_moe.py``).

``ternary_moe(x [M, H], topk_weights [M, k], topk_ids [M, k], w13_qweight, w13_scales, w2_qweight, w2_scales,
intermediate_size I, w13_group_size, w2_group_size, activations, apply_router_weight_on_input) -> [M, H]``

* ``w13_*`` are the experts' fused gate/up weights ``[2I, H]`` (gate rows first) and ``w2_*`` their down
  weights ``[H, I]``, each expert prepared once by ``ops.prepare_weight`` and stacked along a leading expert
  dimension (``w13_qweight[e]`` is expert e's kernel layout, opaque here);
* ``y[t] = Σ_j topk_weights[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t))`` with ``e = topk_ids[t, j]`` (with
  ``apply_router_weight_on_input`` the weight scales ``x_t`` instead — Llama-4 style top-1 routing).

On CPU the (token, expert) pairs are sorted by expert and each expert that has tokens runs two calls of
the op's GEMM on its contiguous block of rows — the weights stay 2 bits each; only the active experts'
bytes are read. One token (decode at batch 1) skips the sorting: its k experts run in slot order. Sums over the k experts of a token are kept in float32 and rounded once to ``x.dtype``;
SiLU-and-mul is computed in float32 and rounded once, as vLLM's own activation kernel does. The loop is
data dependent (host-side counts), which is why it lives behind an opaque op: ``torch.compile`` sees one
call with the fake implementation of ``ops.py``.

A CUDA implementation of the same schema is designed, not built (see ``ops.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _per_expert(stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``stacked.unbind(0)``, made once per weight tensor and kept on it: selecting expert e anew on every
    call is a dispatched op, and there are four per active expert."""
    views = getattr(stacked, "_ternary_rs_experts", None)
    if views is None or len(views) != stacked.shape[0] or views[0].data_ptr() != stacked.data_ptr():
        views = stacked.unbind(0)
        try:
            stacked._ternary_rs_experts = views
        except AttributeError:  # not a Python-side tensor (e.g. under a tracing mode): just do not cache
            pass
    return views


def ternary_moe(x, topk_weights, topk_ids, w13_qweight, w13_scales, w2_qweight, w2_scales, intermediate_size,
                w13_group_size, w2_group_size, activations=0, apply_router_weight_on_input=False):
    m, hidden = x.shape
    inter = int(intermediate_size)
    top_k = topk_ids.shape[1]
    n_expert = w13_qweight.shape[0]
    if m == 0 or top_k == 0:
        return x.new_zeros((m, hidden))
    # At decode the weights are small and every tensor op's dispatch (~5-10 us) counts: per active expert
    # only its two GEMMs run; SiLU-and-mul, the weighting and the sum run once over all (token, expert) pairs.
    if m == 1:  # one token: its k experts in slot order, no sorting or gathering
        experts = topk_ids[0].tolist()
        if min(experts) < 0 or max(experts) >= n_expert:
            raise ValueError(f"ternary_moe: expert ids must lie in [0, {n_expert}), got {experts}")
        weights = topk_weights.reshape(-1, 1).to(torch.float32)
        xs, spans = x.expand(top_k, hidden), [(e, slice(j, j + 1)) for j, e in enumerate(experts)]
    else:
        flat = topk_ids.reshape(-1).to(torch.int64)
        counts = torch.bincount(flat, minlength=n_expert).tolist()  # also refuses a negative id
        if len(counts) > n_expert:
            raise ValueError(f"ternary_moe: expert ids must lie in [0, {n_expert}), got up to {len(counts) - 1}")
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // top_k
        weights = topk_weights.reshape(-1).index_select(0, order).to(torch.float32).unsqueeze(1)
        xs, spans, end = x.index_select(0, tokens), [], 0
        for e, count in enumerate(counts):
            if count:
                spans.append((e, slice(end, end + count)))
                end += count
    if apply_router_weight_on_input:
        xs = (xs.float() * weights).to(x.dtype)
    linear = torch.ops.ternary_rs.ternary_linear
    q13, s13, q2, s2 = (_per_expert(t) for t in (w13_qweight, w13_scales, w2_qweight, w2_scales))
    one = m == 1 and not apply_router_weight_on_input  # every pair's input is x itself
    h = torch.cat([linear(x if one else xs[rows], q13[e], s13[e], 2 * inter, hidden, w13_group_size, None,
                          activations) for e, rows in spans])
    a = F.silu(h[:, :inter].float()).mul_(h[:, inter:]).to(x.dtype)
    y = torch.cat([linear(a[rows], q2[e], s2[e], hidden, inter, w2_group_size, None, activations)
                   for e, rows in spans]).float()
    if not apply_router_weight_on_input:
        y.mul_(weights)
    if m == 1:
        return y.sum(0, keepdim=True).to(x.dtype)
    out = torch.zeros((m, hidden), dtype=torch.float32)
    out.index_add_(0, tokens, y)
    return out.to(x.dtype)
