"""The Gated-DeltaNet prefill on CPUs without native bf16 (docs/cli.md#serve, "Gated DeltaNet prefill").

vLLM CPU runs two parts of a GDN layer's prefill, and one of its speculative decode, with bf16 arithmetic
that torch only does fast where the CPU has AVX512_BF16 or AMX; elsewhere (every AVX2 CPU, AVX-512 CPUs
before Cooper Lake) they are scalar fallbacks. Measured on a 2-core EPYC Zen 2 at Bonsai 2's widths
(10 240 conv channels, 16 key / 48 value heads of 128), per layer:

* the causal depthwise convolution (width 4) is ``F.conv1d(groups=dim)`` on bf16 tensors, once per
  sequence: torch unfolds it into a GEMM per channel — 73 ms for a 1-token chunk, 92 ms for 128 tokens
  (float32: 0.2 and 4 ms). A 27B prefill of 16 sequences of 16 tokens spent ~57 s in it (48 GDN layers).
  :func:`causal_conv1d_fn_cpu` is vLLM's ``causal_conv1d_fn_cpu`` with the four taps as float32
  multiply-adds: the same outputs bit for bit (bf16, fp16; float32 weights keep ``F.conv1d``).
* the chunked delta rule (vLLM's C++ ``chunk_gated_delta_rule_cpu``) multiplies its chunks with torch's
  bf16 GEMM: 207 ms for 128 tokens, 436 ms for 16 sequences of 16. :func:`chunk_gated_delta_rule_cpu` is
  the same algorithm in float32 torch (21 and 70 ms), within bf16 rounding of vLLM's and closer to a
  float64 recurrence (tests/test_gdn_prefill.py).
* with an MTP drafter, the module's speculative-decoding path convolves each sequence's draft tokens with
  the same bf16 ``F.conv1d`` at every decode step (95 ms per sequence and layer; 0.2-0.3 ms through
  :func:`depthwise_conv1d`, bit for bit): the module's ``F`` becomes :class:`_FunctionalWithFastDepthwise`.

With the first two, a 128-token prefill of the 27B shape there went from 45.4 s to 27.9 s (39.0 s with the
convolution alone), most of what is left being the ternary products. All three are installed
by :func:`install_cpu_gdn_prefill` into vLLM's GDN attention module only (its own names), in processes that
load a ternary model.
"""

from __future__ import annotations

import sys

import torch

from ..serving.cpu import bf16_gemm_is_native

# vLLM CPU's GDN attention module: its globals ``causal_conv1d_torch``, ``F`` and ``ops`` are what is replaced.
GDN_ATTENTION_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"


def depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, groups=C)`` for ``x`` ``B × C × L`` and ``weight`` ``C × 1 × W`` (stride 1, no
    padding) as ``W`` float32 multiply-adds, in ``x``'s dtype: products of bf16/fp16 values are exact in float32
    and torch accumulates its half-precision convolution in float32 too, so the result is the same bit for bit
    (tests/test_gdn_prefill.py) — at a fraction of the time where that convolution is torch's per-channel GEMM."""
    width = weight.shape[-1]
    n = x.shape[-1] - width + 1
    wide = x.float()
    taps = weight[:, 0].float()
    acc = wide[..., 0:n] * taps[:, 0:1]
    for j in range(1, width):
        acc.addcmul_(wide[..., j:j + n], taps[:, j:j + 1])
    if bias is not None:
        acc += bias.to(torch.float32).unsqueeze(-1)
    return acc.to(x.dtype)


class _ModuleView:
    """A module as the GDN attention module sees it: the names a subclass defines are its own, every other
    name is the wrapped module's (which itself stays as it is)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _FunctionalWithFastDepthwise(_ModuleView):
    """``torch.nn.functional`` with half-precision depthwise ``conv1d`` (the speculative-decoding path's)
    through :func:`depthwise_conv1d`."""

    def conv1d(self, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if (input.dtype in (torch.bfloat16, torch.float16) and weight.dtype == input.dtype and input.dim() == 3
                and weight.dim() == 3 and weight.shape[1] == 1 and groups == input.shape[1] == weight.shape[0]
                and stride in (1, (1,)) and padding in (0, (0,)) and dilation in (1, (1,))
                and input.shape[-1] >= weight.shape[-1] and (bias is None or bias.dtype == input.dtype)):
            return depthwise_conv1d(input, weight, bias)
        return self._inner.conv1d(input, weight, bias, stride, padding, dilation, groups)


def causal_conv1d_fn_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, query_start_loc: torch.Tensor,
                         cache_indices: torch.Tensor | None = None, has_initial_state: torch.Tensor | None = None,
                         activation: str | bool | None = "silu", pad_slot_id: int | None = None,
                         **kwargs) -> torch.Tensor:
    """Causal depthwise convolution of each sequence of ``x`` (``dim × tokens``, sequences delimited by
    ``query_start_loc``) with ``weight`` (``dim × width``), continuing from and updating ``conv_states``
    (``slot × dim × ≥ width−1``); vLLM's ``causal_conv1d_fn_cpu`` contract."""
    if pad_slot_id is None:
        from vllm.v1.attention.backends.utils import PAD_SLOT_ID

        pad_slot_id = PAD_SLOT_ID
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d_fn_cpu: activation {activation!r} is not None, 'silu' or 'swish'")
    if weight.dim() != 2 or x.dim() != 2 or x.shape[0] != weight.shape[0]:
        raise ValueError(f"causal_conv1d_fn_cpu: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not "
                         "(dim, tokens) and (dim, width)")

    original_dtype = x.dtype
    x = x.to(conv_states.dtype)
    out = torch.empty_like(x)
    dim, width = weight.shape
    state_len = width - 1
    # One host transfer each instead of two scalar reads per sequence.
    starts = query_start_loc.tolist()
    slots = cache_indices.tolist() if cache_indices is not None else None
    initial = has_initial_state.tolist() if has_initial_state is not None else None
    for seq, (bos, eos) in enumerate(zip(starts[:-1], starts[1:])):
        if bos == eos:
            continue
        slot = slots[seq] if slots is not None else seq
        if slot == pad_slot_id:
            continue
        seq_x = x[:, bos:eos]
        if initial is not None and initial[seq]:
            prior = conv_states[slot, :, :state_len]
        else:
            prior = torch.zeros(dim, state_len, dtype=seq_x.dtype)
        # The input in the weight's dtype, as F.conv1d saw it; then exact float32 products.
        conv_input = torch.cat([prior, seq_x], dim=-1).to(weight.dtype)
        if weight.dtype == torch.float32:
            # torch's float32 depthwise path is fast: keep vLLM's arithmetic exactly.
            acc = torch.nn.functional.conv1d(conv_input.unsqueeze(0), weight.unsqueeze(1), bias, groups=dim)[0]
        else:
            acc = depthwise_conv1d(conv_input.unsqueeze(0), weight.unsqueeze(1), bias)[0]
        # Both give the weight's dtype, as F.conv1d does; vLLM then converts to x's.
        seq_out = acc.to(x.dtype)
        if activation is not None:
            seq_out = torch.nn.functional.silu(seq_out)
        out[:, bos:eos] = seq_out
        conv_states[slot, :, :state_len].copy_(conv_input[:, -state_len:])
    return out.to(original_dtype)


def chunk_gated_delta_rule_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor, output_final_state: bool,
                               cu_seqlens: torch.Tensor, head_first: bool, use_qk_l2norm_in_kernel: bool,
                               initial_state_indices: torch.Tensor, eps: float = 1e-5,
                               max_chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``chunk_gated_delta_rule_cpu`` (the GDN prefill: ``query``/``key`` ``1 × T × Hk × K``, ``value``
    ``1 × T × Hv × V``, log-decays ``g`` and ``beta`` ``1 × T × Hv``, sequences by ``cu_seqlens``, each one's
    state ``initial_state[initial_state_indices[i]]`` (``Hv × K × V``) read and overwritten in place) in
    float32 torch: vLLM's C++ kernel multiplies its chunks with torch's bf16 GEMM, which without native bf16
    is the scalar fallback (207 ms per layer for 128 tokens at Bonsai 2's widths, Zen 2: a quarter of a 27B
    prefill after the convolution above). The chunked form (UT transform per chunk of up to 64 tokens, then a
    scan over chunks) is the one FLA and transformers' ``torch_chunk_gated_delta_rule`` use."""
    if head_first:
        raise ValueError("chunk_gated_delta_rule_cpu: head_first=True is not what vLLM's GDN layer passes")
    out_dtype = query.dtype
    hk, hv = query.shape[2], value.shape[2]
    if hv % hk:
        raise ValueError(f"chunk_gated_delta_rule_cpu: {hv} value heads are not a multiple of {hk} key heads")
    out = torch.empty(value.shape, dtype=out_dtype)
    starts = cu_seqlens.tolist()
    slots = initial_state_indices.tolist()
    for seq, (bos, eos) in enumerate(zip(starts[:-1], starts[1:])):
        n = eos - bos
        if n == 0:
            continue
        # Any chunk length gives the same result: short sequences (continuous batching's 16-token prompts)
        # take the next power of two instead of padding to 64 (2.5x at 16 x 16 tokens).
        chunk = min(max_chunk, 1 << (n - 1).bit_length())
        causal = torch.ones(chunk, chunk, dtype=torch.bool).triu(1)
        # heads first, float32: (H, n, D)
        q = query[0, bos:eos].transpose(0, 1).float()
        k = key[0, bos:eos].transpose(0, 1).float()
        v = value[0, bos:eos].transpose(0, 1).float()
        if use_qk_l2norm_in_kernel:
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
        if hv != hk:  # value head h reads key head h // (Hv / Hk)
            q = q.repeat_interleave(hv // hk, dim=0)
            k = k.repeat_interleave(hv // hk, dim=0)
        q = q * q.shape[-1] ** -0.5
        decay = g[0, bos:eos].transpose(0, 1).float()  # (H, n)
        b = beta[0, bos:eos].transpose(0, 1).float()
        pad = (-n) % chunk
        if pad:
            q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            decay, b = (torch.nn.functional.pad(t, (0, pad)) for t in (decay, b))
        c = (n + pad) // chunk
        q, k, v = (t.reshape(hv, c, chunk, -1) for t in (q, k, v))
        decay = decay.reshape(hv, c, chunk).cumsum(-1)  # log-decay from the chunk's start to each position
        b = b.reshape(hv, c, chunk, 1)
        kb, vb = k * b, v * b
        within = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(causal, float("-inf")).exp()
        # I + strictly-lower(β k kᵀ ∘ decay) is solved (unit diagonal) for the chunk's corrected values
        # and for the decayed keys that read the state carried in.
        system = (kb @ k.transpose(-1, -2)) * within
        fresh = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
        gain = decay.exp().unsqueeze(-1)  # decay from the chunk's start to each position
        reads = torch.linalg.solve_triangular(system, kb * gain, upper=False, unitriangular=True)
        attn = (q @ k.transpose(-1, -2)) * within
        q_dec = q * gain
        k_dec = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
        chunk_decay = decay[..., -1].exp()[..., None, None]  # (H, c, 1, 1)
        slot = slots[seq]
        state = initial_state[slot].float()  # (H, K, V)
        o = torch.empty_like(v)
        for i in range(c):
            corrected = fresh[:, i] - reads[:, i] @ state
            o[:, i] = q_dec[:, i] @ state + attn[:, i] @ corrected
            state = state * chunk_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ corrected
        out[0, bos:eos] = o.reshape(hv, c * chunk, -1)[:, :n].transpose(0, 1).to(out_dtype)
        if output_final_state:
            initial_state[slot] = state.to(initial_state.dtype)
    return out, initial_state


class _OpsWithFloat32Prefill(_ModuleView):
    """vLLM's ``_custom_ops`` with :func:`chunk_gated_delta_rule_cpu` in place of the C++ one."""

    chunk_gated_delta_rule_cpu = staticmethod(chunk_gated_delta_rule_cpu)


def install_cpu_gdn_prefill() -> bool:
    """Put :func:`causal_conv1d_fn_cpu`, the half-precision depthwise ``F.conv1d`` of its speculative-decoding
    path (one per sequence and layer at every decode step with an MTP drafter) and, where torch's bf16 GEMM
    is not native, :func:`chunk_gated_delta_rule_cpu` in the GDN attention module (idempotent; only that
    module's names change); whether the module was there to patch. A no-op until vLLM CPU has imported it (its GDN layers
    import it when they are built, before their projections ask ``TernaryConfig.get_quant_method``, which
    calls this)."""
    module = sys.modules.get(GDN_ATTENTION_MODULE)
    if module is None or not hasattr(module, "causal_conv1d_torch"):
        return False
    module.causal_conv1d_torch = causal_conv1d_fn_cpu
    functional = getattr(module, "F", None)
    if functional is not None and not isinstance(functional, _FunctionalWithFastDepthwise):
        module.F = _FunctionalWithFastDepthwise(functional)
    ops = getattr(module, "ops", None)
    if ops is not None and not isinstance(ops, _OpsWithFloat32Prefill) and not bf16_gemm_is_native():
        module.ops = _OpsWithFloat32Prefill(ops)
    return True
