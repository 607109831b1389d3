"""The GDN prefill convolution the plugin puts in place on CPUs without native bf16
(``ternary_rs.vllm.gdn_prefill``) against vLLM's own ``causal_conv1d_fn_cpu``: same outputs bit for bit
(bf16, fp16 and float32), same conv-state updates, same skipped sequences."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("vllm")
reference_module = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d")

from ternary_rs.vllm import gdn_prefill as gdn_conv  # noqa: E402

PAD = -1


def _case(lens, dim, width, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    # (tokens, dim) transposed, as the GDN layer passes it: a non-contiguous (dim, tokens) view.
    x = torch.randn(total, dim, generator=g).to(dtype).transpose(0, 1)
    w = (torch.randn(dim, width, generator=g) * 0.5).to(dtype)
    b = torch.randn(dim, generator=g).to(dtype) if bias else None
    states = torch.randn(len(lens) + 3, dim, width - 1 + 2, generator=g).to(dtype)  # wider than width - 1
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([(3 * i + 1) % (len(lens) + 3) for i in range(len(lens))], dtype=torch.int32)
    initial = torch.tensor([i % 2 == 0 for i in range(len(lens))])
    return x, w, b, states, qsl, slots, initial


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lens", [[1], [37], [16, 16, 16], [1, 5, 0, 33, 2]])
@pytest.mark.parametrize("activation", ["silu", None, True])
def test_matches_vllm_bit_for_bit(dtype, lens, activation):
    x, w, b, states, qsl, slots, initial = _case(lens, 96, 4, dtype, seed=len(lens) * 7 + sum(lens))
    s_ref, s_ours = states.clone(), states.clone()
    ref = reference_module.causal_conv1d_fn_cpu(x, w, b, s_ref, qsl, slots, initial, activation=activation,
                                                 pad_slot_id=PAD)
    ours = gdn_conv.causal_conv1d_fn_cpu(x, w, b, s_ours, qsl, slots, initial, activation=activation,
                                         pad_slot_id=PAD)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    assert torch.equal(ours, ref)
    assert torch.equal(s_ours, s_ref)


def test_no_bias_no_state_indices_and_padded_slots():
    x, w, _, states, qsl, slots, initial = _case([3, 4, 5], 64, 4, torch.bfloat16, seed=3, bias=False)
    slots[1] = PAD  # a padded sequence: skipped, its state untouched
    for args in ((None, None), (slots, initial)):
        s_ref, s_ours = states.clone(), states.clone()
        ref = reference_module.causal_conv1d_fn_cpu(x, w, None, s_ref, qsl, *args, pad_slot_id=PAD)
        ours = gdn_conv.causal_conv1d_fn_cpu(x, w, None, s_ours, qsl, *args, pad_slot_id=PAD)
        # The padded sequence's output rows are never written by either (torch.empty_like): compare the rest.
        keep = torch.ones(x.shape[1], dtype=torch.bool)
        if args[0] is not None:
            keep[3:7] = False
        assert torch.equal(ours[:, keep], ref[:, keep])
        assert torch.equal(s_ours, s_ref)


def test_refuses_unknown_activation_and_bad_shapes():
    x, w, b, states, qsl, slots, initial = _case([4], 8, 4, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="activation"):
        gdn_conv.causal_conv1d_fn_cpu(x, w, b, states, qsl, slots, initial, activation="gelu")
    with pytest.raises(ValueError, match="dim, width"):
        gdn_conv.causal_conv1d_fn_cpu(x[:4], w, b, states, qsl, slots, initial)


def test_install_replaces_the_module_global_once(monkeypatch):
    import types

    fake = types.ModuleType(gdn_conv.GDN_ATTENTION_MODULE)
    monkeypatch.delitem(sys.modules, gdn_conv.GDN_ATTENTION_MODULE, raising=False)
    assert gdn_conv.install_cpu_gdn_prefill() is False  # not imported yet: nothing to patch
    fake.causal_conv1d_torch = reference_module.causal_conv1d_fn_cpu
    monkeypatch.setitem(sys.modules, gdn_conv.GDN_ATTENTION_MODULE, fake)
    assert gdn_conv.install_cpu_gdn_prefill() is True
    assert fake.causal_conv1d_torch is gdn_conv.causal_conv1d_fn_cpu
    assert gdn_conv.install_cpu_gdn_prefill() is True
    assert fake.causal_conv1d_torch is gdn_conv.causal_conv1d_fn_cpu


# ------------------------------------------------------------------------------------------ delta rule
def _recurrence64(q, k, v, g, beta, state, eps):
    """The gated delta rule token by token in float64 (one sequence; heads first): the definition the
    chunked forms compute. state: Hv x K x V; returns (T x Hv x V outputs, final state)."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, state))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q = q * q.shape[-1] ** -0.5
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + torch.einsum("hk,hv->hkv", k[t], delta)
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(outs), s


def _delta_case(lens, hk, hv, d, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(1, total, hk, d, generator=g).bfloat16()
    k = torch.randn(1, total, hk, d, generator=g).bfloat16()
    v = torch.randn(1, total, hv, d, generator=g).bfloat16()
    decay = -torch.rand(1, total, hv, generator=g) * 0.5
    beta = torch.rand(1, total, hv, generator=g).bfloat16()
    state = (torch.randn(len(lens) + 2, hv, d, d, generator=g) * 0.1).bfloat16()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([(2 * i + 1) % (len(lens) + 2) for i in range(len(lens))], dtype=torch.int32)
    return q, k, v, decay, beta, state, cu, slots


@pytest.mark.parametrize("lens", [[1], [63, 64, 65], [130], [16] * 5, [3, 0, 9]])
def test_delta_rule_matches_the_float64_recurrence_and_vllm(lens):
    from vllm import _custom_ops

    q, k, v, decay, beta, state, cu, slots = _delta_case(lens, 2, 6, 128, seed=sum(lens) + len(lens))
    s_ours, s_vllm = state.clone(), state.clone()
    ours, _ = gdn_conv.chunk_gated_delta_rule_cpu(q, k, v, decay, beta, s_ours, True, cu, False, True, slots)
    theirs, _ = _custom_ops.chunk_gated_delta_rule_cpu(q, k, v, decay, beta, s_vllm, True, cu, False, True, slots)
    assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape
    touched = set(slots.tolist())
    for i in range(state.shape[0]):  # states of other slots untouched
        if i not in touched:
            assert torch.equal(s_ours[i], state[i])
    starts = cu.tolist()
    for i, (bos, eos) in enumerate(zip(starts[:-1], starts[1:])):
        if bos == eos:
            continue
        slot = int(slots[i])
        ref_out, ref_state = _recurrence64(q[0, bos:eos], k[0, bos:eos], v[0, bos:eos], decay[0, bos:eos],
                                           beta[0, bos:eos], state[slot], 1e-5)
        err_ours = (ours[0, bos:eos].double() - ref_out).abs().max().item()
        err_vllm = (theirs[0, bos:eos].double() - ref_out).abs().max().item()
        scale = ref_out.abs().max().item()
        # bf16 output rounding is 2^-9 of the value; ours rounds once from float32, vLLM's more often.
        assert err_ours <= scale * 2 ** -8 + 1e-6, (err_ours, scale)
        assert err_ours <= err_vllm + scale * 2 ** -9
        state_err = (s_ours[slot].double() - ref_state).abs().max().item()
        assert state_err <= ref_state.abs().max().item() * 2 ** -8 + 1e-6


def test_delta_rule_refuses_head_first_and_uneven_heads():
    q, k, v, decay, beta, state, cu, slots = _delta_case([4], 2, 6, 16, seed=2)
    with pytest.raises(ValueError, match="head_first"):
        gdn_conv.chunk_gated_delta_rule_cpu(q, k, v, decay, beta, state, True, cu, True, True, slots)
    with pytest.raises(ValueError, match="multiple"):
        gdn_conv.chunk_gated_delta_rule_cpu(q, k, v[..., :5, :], decay[..., :5], beta[..., :5], state[:, :5], True,
                                            cu, False, True, slots)


def test_install_wraps_the_ops_only_without_a_native_bf16_gemm(monkeypatch):
    import types

    from vllm import _custom_ops

    for native in (False, True):
        fake = types.ModuleType(gdn_conv.GDN_ATTENTION_MODULE)
        fake.causal_conv1d_torch = reference_module.causal_conv1d_fn_cpu
        fake.ops = _custom_ops
        monkeypatch.setitem(sys.modules, gdn_conv.GDN_ATTENTION_MODULE, fake)
        monkeypatch.setattr(gdn_conv, "bf16_gemm_is_native", lambda native=native: native)
        assert gdn_conv.install_cpu_gdn_prefill() and gdn_conv.install_cpu_gdn_prefill()  # idempotent
        assert fake.causal_conv1d_torch is gdn_conv.causal_conv1d_fn_cpu
        if native:
            assert fake.ops is _custom_ops
        else:
            assert fake.ops.chunk_gated_delta_rule_cpu is gdn_conv.chunk_gated_delta_rule_cpu
            assert fake.ops.fused_gdn_gating_cpu is _custom_ops.fused_gdn_gating_cpu  # the rest is vLLM's
            assert fake.ops._inner is _custom_ops  # not wrapped twice
    assert _custom_ops.chunk_gated_delta_rule_cpu is not gdn_conv.chunk_gated_delta_rule_cpu  # vLLM's module as it was


# ------------------------------------------------------------------------------------------ spec-decode conv
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [4, 5, 7, 40])
def test_depthwise_conv1d_is_torch_s_bit_for_bit(dtype, length):
    g = torch.Generator().manual_seed(length)
    x = torch.randn(1, 96, length, generator=g).to(dtype)
    w = torch.randn(96, 1, 4, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    for bias in (b, None):
        ref = torch.nn.functional.conv1d(x, w, bias, groups=96)
        ours = gdn_conv.depthwise_conv1d(x, w, bias)
        assert ours.dtype == ref.dtype and torch.equal(ours, ref)
        fast = gdn_conv._FunctionalWithFastDepthwise(torch.nn.functional)
        assert torch.equal(fast.conv1d(x, w, bias, groups=96), ref)


def test_functional_proxy_leaves_other_convolutions_and_names_to_torch():
    fast = gdn_conv._FunctionalWithFastDepthwise(torch.nn.functional)
    x = torch.randn(1, 8, 10)
    w = torch.randn(8, 1, 3)
    assert torch.equal(fast.conv1d(x, w, None, groups=8), torch.nn.functional.conv1d(x, w, None, groups=8))  # f32
    w2 = torch.randn(4, 8, 3).bfloat16()
    assert torch.equal(fast.conv1d(x.bfloat16(), w2), torch.nn.functional.conv1d(x.bfloat16(), w2))  # not depthwise
    assert torch.equal(fast.conv1d(x.bfloat16(), w.bfloat16(), None, 1, 1, 1, 8),  # padded
                       torch.nn.functional.conv1d(x.bfloat16(), w.bfloat16(), None, 1, 1, 1, 8))
    assert fast.silu is torch.nn.functional.silu


def test_install_wraps_the_module_s_functional_once(monkeypatch):
    import types

    fake = types.ModuleType(gdn_conv.GDN_ATTENTION_MODULE)
    fake.causal_conv1d_torch = reference_module.causal_conv1d_fn_cpu
    fake.F = torch.nn.functional
    monkeypatch.setitem(sys.modules, gdn_conv.GDN_ATTENTION_MODULE, fake)
    assert gdn_conv.install_cpu_gdn_prefill() and gdn_conv.install_cpu_gdn_prefill()
    assert isinstance(fake.F, gdn_conv._FunctionalWithFastDepthwise) and fake.F._inner is torch.nn.functional
    assert torch.nn.functional.conv1d is not fake.F.conv1d  # torch itself untouched
