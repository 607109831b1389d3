"""Top-k / top-p masking of CPU logits (``ternary_rs.serving.sampling``, ``_core.top_k_top_p_mask_cpu``)
against a float64 sort-based reference written from vLLM's rules, against vLLM's own
``apply_top_k_top_p`` where vLLM is installed, and the plugin's install / opt-out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ternary_rs.serving import sampling


def reference(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's rules by a full sort, in float64: top-k keeps every logit >= the k-th largest; top-p then keeps
    each token whose strictly larger (kept) tokens hold less than p of the softmax mass (ties kept or
    dropped together)."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        x = logits[r].double()
        floor = -np.inf
        if k is not None and 0 < int(k[r]) < x.numel():
            floor = float(torch.sort(x, descending=True).values[int(k[r]) - 1])
        if p is not None and float(p[r]) < 1.0:
            kept = x[x >= floor]
            e = torch.exp((kept - kept.max()).float()).double()
            target = float(p[r]) * float(e.sum())
            values = torch.unique(kept, sorted=True).flip(0)  # descending distinct logits
            above = 0.0
            for v in values:
                if above >= target:
                    break
                floor = float(v)
                above += float(e[kept == v].sum())
        out[r][x < floor] = -float("inf")
    return out


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(1, 700),
    levels=st.sampled_from([5, 40, 10_000]),  # few distinct values (bf16-like ties) .. all distinct
    with_k=st.booleans(),
    with_p=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_the_reference(rows, vocab, levels, with_k, with_p, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(0, levels, (rows, vocab), generator=g).float() * (8.0 / levels)).contiguous()
    k = torch.randint(0, vocab + 3, (rows,), generator=g) if with_k else None
    p = (torch.rand(rows, generator=g) * 0.999 + 0.001) if with_p else None
    if p is None and k is None:
        p = torch.full((rows,), 0.9)
    got = logits.clone()
    assert sampling.mask_top_k_top_p_(got, k, p)
    assert torch.equal(got, reference(logits, k, p))


def test_declines_what_it_does_not_take_untouched():
    x = torch.randn(2, 50)
    for bad in (x.bfloat16(), x.t().contiguous().t(), x.double()):
        before = bad.clone()
        assert not sampling.mask_top_k_top_p_(bad, None, torch.full((2,), 0.5))
        assert torch.equal(bad, before)
    nan = x.clone()
    nan[1, 7] = float("nan")
    assert not sampling.mask_top_k_top_p_(nan, None, torch.full((2,), 0.5))
    assert torch.equal(nan[0], x[0])
    assert not sampling.mask_top_k_top_p_(x.clone(), None, torch.tensor([0.5, 0.0]))


def test_falls_back_to_the_original_path():
    calls = []

    def original(logits, k, p):
        calls.append((k is None, p is None))
        return logits

    apply = sampling.fast_apply_top_k_top_p(original)
    x = torch.randn(3, 100)
    apply(x.clone(), torch.full((3,), 5), None)  # top-k alone: vLLM's topk path
    apply(x.clone().bfloat16(), None, torch.full((3,), 0.5))  # a dtype the kernel does not take
    assert calls == [(False, True), (True, False)]
    out = apply(x.clone(), torch.full((3,), 5), torch.full((3,), 0.5))
    assert calls == [(False, True), (True, False)]
    assert torch.equal(out, reference(x, torch.full((3,), 5), torch.full((3,), 0.5)))


def test_env_switch(monkeypatch):
    monkeypatch.setenv(sampling.SAMPLER_ENV, "vllm")
    assert not sampling.enabled()
    monkeypatch.setenv(sampling.SAMPLER_ENV, "auto")
    assert sampling.enabled()
    monkeypatch.setenv(sampling.SAMPLER_ENV, "fast")
    with pytest.raises(ValueError, match="auto or vllm"):
        sampling.enabled()


@pytest.mark.parametrize("vocab,rows", [(151_936, 4), (248_320, 2), (3_000, 16)])
def test_same_kept_set_as_vllm(vocab, rows):
    """vLLM's own sort-based function on the same logits (continuous values: no ties), top-p alone and
    with top-k (Qwen3's defaults 0.95 / 20 among others)."""
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g) * 3
    for k, p in [(None, 0.95), (20, 0.95), (vocab // 3, 0.5), (1000, 0.999)]:
        kk = None if k is None else torch.full((rows,), k)
        pp = torch.full((rows,), p)
        theirs = topk_topp.apply_top_k_top_p_pytorch(logits.clone(), kk, pp, allow_cpu_sync=True)
        ours = logits.clone()
        assert sampling.mask_top_k_top_p_(ours, kk, pp)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), (k, p)
        assert torch.equal(ours[torch.isfinite(ours)], logits[torch.isfinite(ours)])


def test_plugin_installs_it_on_cpu(monkeypatch):
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    from ternary_rs.vllm import plugin

    original = getattr(topk_topp.apply_top_k_top_p, "__wrapped__", topk_topp.apply_top_k_top_p)
    monkeypatch.setattr(topk_topp, "apply_top_k_top_p", original)
    monkeypatch.setenv(sampling.SAMPLER_ENV, "vllm")
    plugin._install_cpu_sampler()
    assert topk_topp.apply_top_k_top_p is original
    monkeypatch.setenv(sampling.SAMPLER_ENV, "auto")
    plugin._install_cpu_sampler()
    plugin._install_cpu_sampler()  # idempotent
    assert topk_topp.apply_top_k_top_p._ternary_rs
    assert topk_topp.apply_top_k_top_p.__wrapped__ is original
