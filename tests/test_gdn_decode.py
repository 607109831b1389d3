"""The Gated DeltaNet decode step (ternary_rs.serving.gdn, rust/ternary-core/src/gdn.rs) against a float64
torch recurrence and vLLM's own CPU kernels, and the plugin's wrapper of vLLM's GDN decode
(ternary_rs.vllm.gdn_decode): what it takes, what it leaves to vLLM, the mixed batch split."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ternary_rs.serving.gdn import GdnLayer, decode_


@dataclasses.dataclass
class Step:
    hk: int
    hv: int
    kd: int
    vd: int
    width: int
    layer: GdnLayer
    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    slots: torch.Tensor
    conv: torch.Tensor  # [slots, width - 1, channels] (vLLM's SD) or [slots, channels, width - 1]
    channel_first: bool
    state: torch.Tensor  # [slots, hv, kd, vd] f32


def make_step(hk=2, group=2, kd=32, vd=32, width=4, n=3, channel_first=False, bias=False, seed=0,
              strided=False) -> Step:
    g = torch.Generator().manual_seed(seed)
    hv = hk * group
    channels = 2 * hk * kd + hv * vd
    slots = n + 3

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    weight = rnd(channels, 1, width, scale=0.5).bfloat16()  # as vLLM holds conv1d.weight
    layer = GdnLayer.build(hk, hv, kd, vd, weight, rnd(channels, scale=0.2).bfloat16() if bias else None,
                           rnd(hv), rnd(hv).bfloat16())
    if strided:  # q, k, v as a view of wider rows (Qwen3.5's split of the qkvz projection), b / a of ba
        x = rnd(n, channels + hv * vd, scale=2).bfloat16()[:, :channels]
        b, a = rnd(n, 2 * hv, scale=2).bfloat16().chunk(2, dim=-1)
    else:
        x = rnd(n, channels, scale=2).bfloat16()
        a, b = rnd(n, hv, scale=2).bfloat16(), rnd(n, hv, scale=2).bfloat16()
    conv = rnd(slots, channels, width - 1).bfloat16() if channel_first else rnd(slots, width - 1, channels).bfloat16()
    order = torch.randperm(slots, generator=g)[:n].to(torch.int32)
    return Step(hk, hv, kd, vd, width, layer, x, a, b, order, conv, channel_first,
                rnd(slots, hv, kd, vd, scale=0.5))


def run_ours(s: Step):
    conv, state = s.conv.clone(), s.state.clone()
    out = torch.zeros(s.slots.numel(), s.hv, s.vd, dtype=torch.bfloat16)
    assert decode_(s.layer, s.x, s.a, s.b, s.slots, conv, s.channel_first, state, out)
    return out, conv, state


def reference(s: Step):
    """The step in float64 torch, written from the formulas (FLA's fused_sigmoid_gating_delta_rule_update
    with l2-normalized q / k, vLLM's causal_conv1d_update with SiLU; the convolution's output rounded to
    bf16 as vLLM stores it)."""
    conv = s.conv.double().clone()
    if s.channel_first:
        conv = conv.transpose(1, 2)
    state, layer = s.state.double().clone(), s.layer
    w = layer.conv_weight.double()
    outs = []
    for t in range(s.slots.numel()):
        slot = int(s.slots[t])
        win = torch.cat([conv[slot], s.x[t].double()[None]], 0)  # [width, channels], oldest first
        acc = (win * w.T).sum(0) + (0 if layer.conv_bias is None else layer.conv_bias.double())
        y = (acc * torch.sigmoid(acc)).bfloat16().double()
        conv[slot] = win[1:]
        kw = s.hk * s.kd
        q, k, v = y[:kw].view(s.hk, s.kd), y[kw:2 * kw].view(s.hk, s.kd), y[2 * kw:].view(s.hv, s.vd)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / s.kd ** 0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        o = torch.zeros(s.hv, s.vd, dtype=torch.float64)
        for h in range(s.hv):
            kh = h // (s.hv // s.hk)
            z = s.a[t, h].double() + layer.dt_bias[h].double()
            decay = torch.exp(-torch.exp(layer.a_log[h].double()) * (z if z > 20 else torch.log1p(torch.exp(z))))
            beta = torch.sigmoid(s.b[t, h].double())
            st_ = state[slot, h] * decay
            delta = (v[h] - st_.T @ k[kh]) * beta
            st_ = st_ + torch.outer(k[kh], delta)
            o[h] = st_.T @ q[kh]
            state[slot, h] = st_
        outs.append(o)
    if s.channel_first:
        conv = conv.transpose(1, 2)
    return torch.stack(outs), conv.bfloat16(), state


def check(s: Step):
    out, conv, state = run_ours(s)
    want_out, want_conv, want_state = reference(s)
    assert torch.equal(conv, want_conv)
    # outputs: bf16 rounding of values within a few f32 roundings of float64
    assert torch.allclose(out.double(), want_out, rtol=8e-3, atol=1e-3 * max(want_out.abs().max().item(), 1e-3))
    scale = max(want_state.abs().max().item(), 1e-3)
    assert (state.double() - want_state).abs().max().item() <= 1e-5 * scale + 1e-3 * scale * _rounding_flips(s)
    untouched = [i for i in range(s.state.shape[0]) if i not in s.slots.tolist()]
    assert torch.equal(state[untouched], s.state[untouched])


def _rounding_flips(s: Step) -> int:
    """1 where the f32 and f64 convolution sums may round to different bf16 values (then a state entry moves
    by up to ~2⁻⁸ of its term), else 0: allowed only for wide random layers."""
    return 1 if s.kd * s.hk > 64 else 0


def test_bonsai_2_widths_both_conv_layouts():
    for channel_first in (False, True):
        check(make_step(hk=16, group=3, kd=128, vd=128, n=2, channel_first=channel_first, seed=1))


@settings(max_examples=40, deadline=None)
@given(hk=st.integers(1, 3), group=st.integers(1, 3), kd=st.integers(1, 40), vd=st.sampled_from([16, 32, 48]),
       width=st.integers(2, 5), n=st.integers(1, 5), channel_first=st.booleans(), bias=st.booleans(),
       strided=st.booleans(), seed=st.integers(0, 2**31))
def test_matches_the_float64_recurrence(hk, group, kd, vd, width, n, channel_first, bias, strided, seed):
    check(make_step(hk, group, kd, vd, width, n, channel_first, bias, seed, strided))


def test_declines_what_it_does_not_read_and_touches_nothing():
    s = make_step()
    out = torch.zeros(3, s.hv, s.vd, dtype=torch.bfloat16)
    conv, state = s.conv.clone(), s.state.clone()
    assert not decode_(s.layer, s.x.float(), s.a, s.b, s.slots, conv, False, state, out)  # x not bf16
    assert not decode_(s.layer, s.x, s.a, s.b, s.slots, conv, False, state.bfloat16(), out)  # bf16 state
    assert not decode_(s.layer, s.x, s.a, s.b, s.slots, conv, True, state, out)  # wrong conv layout
    assert not decode_(s.layer, s.x, s.a, s.b, s.slots, conv, False, state.transpose(2, 3), out)
    assert not decode_(s.layer, s.x, s.a, s.b, s.slots[:, None], conv, False, state, out)  # 2-D slots
    dup = s.slots.clone()
    dup[1] = dup[0]
    assert not decode_(s.layer, s.x, s.a, s.b, dup, conv, False, state, out)  # one slot twice
    assert torch.equal(conv, s.conv) and torch.equal(state, s.state) and not out.any()


def test_close_to_vllm_s_own_kernels():
    """vLLM CPU's convolution update and fused delta rule on the same tensors: the same windows, outputs
    within a bf16 rounding; states within vLLM's own error (its state is ~10⁻² off float64 at these widths,
    this kernel ~10⁻⁶)."""
    pytest.importorskip("vllm")
    import vllm._custom_ops as ops

    if not hasattr(torch.ops._C, "fused_sigmoid_gating_delta_rule_update_cpu"):
        pytest.skip("this vLLM build has no CPU GDN kernels")
    s = make_step(hk=16, group=3, kd=128, vd=128, n=3, seed=5)
    out, conv, state = run_ours(s)
    n, channels = s.slots.numel(), s.x.shape[1]
    conv_v, state_v = s.conv.clone(), s.state.clone()
    y = ops.causal_conv1d_update_cpu(x=s.x.clone(), conv_states=conv_v.transpose(1, 2),
                                     weight=s.layer.conv_weight.bfloat16(), bias=None, silu_activation=True,
                                     conv_state_indices=s.slots, is_weight_packed=False)
    kw = s.hk * s.kd
    q, k, v = (part.contiguous().view(1, n, -1, d) for part, d in
               zip(y.split([kw, kw, channels - 2 * kw], -1), (s.kd, s.kd, s.vd)))
    o = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=s.layer.a_log, dt_bias=s.layer.dt_bias.bfloat16(), q=q, k=k, v=v, a=s.a, b=s.b,
        initial_state_source=state_v, initial_state_indices=s.slots,
        cu_seqlens=torch.arange(n + 1, dtype=torch.int32), use_qk_l2norm_in_kernel=True)
    assert torch.equal(conv, conv_v)
    o = o.reshape(n, s.hv, s.vd).float()
    assert (o - out.float()).abs().max().item() <= 2 * 2 ** -8 * o.abs().max().item()
    want_state = reference(s)[2]
    ours_err = (state.double() - want_state).abs().max().item()
    vllm_err = (state_v.double() - want_state).abs().max().item()
    assert ours_err <= vllm_err and ours_err < 1e-4, (ours_err, vllm_err)


# --- the plugin's wrapper of vLLM's _cpu_gdn_attention_nonspec ---------------------------------------


@dataclasses.dataclass
class FakeMeta:
    """The fields of vLLM's GDNAttentionMetadata the non-speculative path reads."""

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    non_spec_state_indices_tensor: torch.Tensor
    non_spec_query_start_loc: torch.Tensor
    has_initial_state: torch.Tensor | None = None


def fake_layer(s: Step, activation="silu"):
    conv1d = types.SimpleNamespace(weight=s.layer.conv_weight.bfloat16().unsqueeze(1), bias=None)
    return types.SimpleNamespace(
        tp_size=1, num_k_heads=s.hk, num_v_heads=s.hv, head_k_dim=s.kd, head_v_dim=s.vd, activation=activation,
        conv1d=conv1d, A_log=s.layer.a_log, dt_bias=s.layer.dt_bias.bfloat16(),
        # vLLM CPU keeps the state [slots, H, V, K] and reads it as [K, V]: hand it over that way
        kv_cache=[s.conv.clone(), s.state.clone().view(s.state.shape[0], s.hv, s.vd, s.kd)])


@pytest.fixture
def vllm_conv_layout(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: False)


def test_wrapper_takes_decodes_and_hands_the_prefill_part_to_vllm(vllm_conv_layout):
    from ternary_rs.vllm.gdn_decode import fast_nonspec

    s = make_step(n=3, seed=11)
    calls = []
    wrapped = fast_nonspec(lambda *args: calls.append(args))
    layer = fake_layer(s)
    prefill_tokens = 5
    tokens = 2 + prefill_tokens  # 2 decodes, then one prefill of 5 tokens
    x = torch.cat([s.x[:2], torch.randn(prefill_tokens, s.x.shape[1]).bfloat16()])
    a = torch.cat([s.a[:2], torch.randn(prefill_tokens, s.hv).bfloat16()])
    b = torch.cat([s.b[:2], torch.randn(prefill_tokens, s.hv).bfloat16()])
    meta = FakeMeta(1, prefill_tokens, 2, 2, s.slots.clone(), torch.tensor([0, 1, 2, tokens], dtype=torch.int32),
                    torch.tensor([True, True, False]))
    out = torch.zeros(tokens, s.hv, s.vd, dtype=torch.bfloat16)
    wrapped(layer, meta, x, b, a, out)
    # the decodes: exactly decode_ on the same tensors
    two = dataclasses.replace(s, x=s.x[:2], a=s.a[:2], b=s.b[:2], slots=s.slots[:2])
    want_out, want_conv, want_state = run_ours(two)
    assert torch.equal(out[:2], want_out)
    assert torch.equal(layer.kv_cache[0], want_conv)
    assert torch.equal(layer.kv_cache[1].view_as(want_state), want_state)
    # the prefill: vLLM's own function, as if the batch had been that sequence alone
    (args,) = calls
    assert args[0] is layer
    pm = args[1]
    assert (pm.num_decodes, pm.num_decode_tokens, pm.num_prefills) == (0, 0, 1)
    assert pm.non_spec_state_indices_tensor.tolist() == s.slots[2:].tolist()
    assert pm.non_spec_query_start_loc.tolist() == [0, prefill_tokens]
    assert pm.has_initial_state.tolist() == [False]
    assert torch.equal(args[2], x[2:]) and torch.equal(args[3], b[2:]) and torch.equal(args[4], a[2:])
    assert args[5].data_ptr() == out[2:].data_ptr()


def test_wrapper_leaves_what_it_does_not_run_to_vllm(vllm_conv_layout):
    from ternary_rs.vllm.gdn_decode import fast_nonspec

    s = make_step(n=2, seed=3)
    calls = []
    wrapped = fast_nonspec(lambda *args: calls.append(args))
    meta = FakeMeta(0, 0, 2, 2, s.slots.clone(), torch.tensor([0, 1, 2], dtype=torch.int32))
    out = torch.zeros(2, s.hv, s.vd, dtype=torch.bfloat16)
    for layer in (fake_layer(s, activation="gelu"), fake_layer(s)):
        if layer.activation == "silu":  # a bf16 state: vLLM's
            layer.kv_cache[1] = layer.kv_cache[1].bfloat16()
        wrapped(layer, meta, s.x, s.b, s.a, out)
    assert len(calls) == 2 and not out.any()
    prefill_only = FakeMeta(1, 4, 0, 0, s.slots[:1].clone(), torch.tensor([0, 4], dtype=torch.int32))
    wrapped(fake_layer(s), prefill_only, s.x, s.b, s.a, out)
    assert len(calls) == 3 and calls[-1][1] is prefill_only


def test_wrapper_binds_the_caches_once_and_again_when_vllm_replaces_them(vllm_conv_layout):
    """The caches are checked once per layer and kept; new cache tensors (a new engine's) are bound anew,
    and each step lands in the caches the layer holds at that step."""
    from ternary_rs.vllm.gdn_decode import fast_nonspec

    s = make_step(n=2, seed=7)
    calls = []
    wrapped = fast_nonspec(lambda *args: calls.append(args))
    layer = fake_layer(s)
    meta = FakeMeta(0, 0, 2, 2, s.slots.clone(), torch.tensor([0, 1, 2], dtype=torch.int32))
    out = torch.zeros(2, s.hv, s.vd, dtype=torch.bfloat16)
    wrapped(layer, meta, s.x, s.b, s.a, out)
    want_out, want_conv, want_state = run_ours(s)
    assert not calls and torch.equal(out, want_out) and torch.equal(layer.kv_cache[0], want_conv)
    first = layer._ternary_rs_gdn_caches
    wrapped(layer, meta, s.x, s.b, s.a, out)
    assert layer._ternary_rs_gdn_caches is first  # not bound again
    fresh = fake_layer(s).kv_cache
    layer.kv_cache = fresh
    out.zero_()
    wrapped(layer, meta, s.x, s.b, s.a, out)
    assert not calls and torch.equal(out, want_out)
    assert torch.equal(fresh[0], want_conv) and torch.equal(fresh[1].view_as(want_state), want_state)
    # a state the kernel cannot read as [K, V] per slot (not contiguous): vLLM's function, caches untouched
    layer.kv_cache = [s.conv.clone(), s.state.clone().transpose(2, 3)]
    before = [t.clone() for t in layer.kv_cache]
    wrapped(layer, meta, s.x, s.b, s.a, out)
    assert len(calls) == 1 and all(torch.equal(t, u) for t, u in zip(layer.kv_cache, before))


def test_bound_step_reads_only_the_first_n_rows():
    """decode_bound on vLLM's padded step tensors (more rows than decodes, a / b views of one projection):
    the same as the one-shot decode_ on exactly those rows, the rest of out untouched."""
    from ternary_rs.serving.gdn import bind_caches, decode_bound

    s = make_step(n=3, seed=9, strided=True)
    n = 2
    conv, state = s.conv.clone(), s.state.clone()
    caches = bind_caches(s.layer, conv, False, state)
    out = torch.full((3, s.hv, s.vd), 7.0, dtype=torch.bfloat16)
    assert decode_bound(s.layer, caches, s.x, s.a, s.b, s.slots, n, out)
    want_out, want_conv, want_state = run_ours(dataclasses.replace(s, x=s.x[:n], a=s.a[:n], b=s.b[:n],
                                                                   slots=s.slots[:n]))
    assert torch.equal(out[:n], want_out) and (out[n:] == 7).all()
    assert torch.equal(conv, want_conv) and torch.equal(state, want_state)
    # refused, nothing touched: n beyond the rows, slots of another dtype that do not fit, wrong widths
    for args in ((s.x, s.a, s.b, s.slots, 4, out), (s.x[:, :-1], s.a, s.b, s.slots, n, out),
                 (s.x, s.a[:, :-1], s.b[:, :-1], s.slots, n, out), (s.x, s.a, s.b, s.slots, n, out[:, :, :-1]),
                 (s.x, s.a, s.b, s.slots[:1], n, out), (s.x.float(), s.a, s.b, s.slots, n, out)):
        assert not decode_bound(s.layer, caches, *args)
    assert torch.equal(conv, want_conv) and torch.equal(state, want_state)
    # int64 slots (converted) give the same as int32
    conv2, state2 = s.conv.clone(), s.state.clone()
    out2 = torch.zeros(n, s.hv, s.vd, dtype=torch.bfloat16)
    assert decode_bound(s.layer, bind_caches(s.layer, conv2, False, state2), s.x, s.a, s.b, s.slots.long(), n,
                        out2)
    assert torch.equal(out2, want_out) and torch.equal(state2, want_state)


def test_install_wraps_vllm_s_function_once_and_the_opt_out(monkeypatch):
    from ternary_rs.vllm import gdn_decode

    module = types.ModuleType(gdn_decode.GDN_ATTENTION_MODULE)

    def original(*args):
        return None

    module._cpu_gdn_attention_nonspec = original
    monkeypatch.setitem(sys.modules, gdn_decode.GDN_ATTENTION_MODULE, module)
    monkeypatch.setenv(gdn_decode.GDN_ENV, "vllm")
    assert not gdn_decode.install_cpu_gdn_decode() and module._cpu_gdn_attention_nonspec is original
    monkeypatch.setenv(gdn_decode.GDN_ENV, "auto")
    assert gdn_decode.install_cpu_gdn_decode()
    first = module._cpu_gdn_attention_nonspec
    assert first.__wrapped__ is original
    assert gdn_decode.install_cpu_gdn_decode() and module._cpu_gdn_attention_nonspec is first
    monkeypatch.setenv(gdn_decode.GDN_ENV, "fast")
    with pytest.raises(ValueError, match="expected auto or vllm"):
        gdn_decode.install_cpu_gdn_decode()
