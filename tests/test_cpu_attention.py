"""The CPU attention backend the plugin picks for ternary models (``ternary_rs.vllm.cpu_attention``): vLLM's
``CPU_ATTN`` with the KV cache update inside its forward. Checked against vLLM's own impl driven as vLLM
drives it (``do_kv_cache_update``, then ``forward``): the same cache bytes, and the same outputs — bit for bit
where vLLM's kernel runs (prefill and mixed steps, fp8 caches, ``TERNARY_RS_CPU_ATTENTION=vllm``), to f32
rounding where ternary_rs's decode kernel runs (decode steps) — over prefill + decode batches, fp32 and bf16,
GQA, sliding window, soft-cap, fp8 cache, padded keys; and the selection rule (ternary only, never over a
user's backend or override). ``ternary_rs::decode_attention`` itself is checked against the torch reference
(its fallback) over dtypes, strides, padded pages and bad arguments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402

from ternary_rs.serving import ops  # noqa: E402
from ternary_rs.vllm import cpu_attention, plugin  # noqa: E402

BLOCK = 32


@pytest.fixture(autouse=True)
def _model_dtype(monkeypatch):
    # the impls ask the current vLLM config for the model dtype (zentorch's encoder gate) only
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16)))


def impls(heads, kv_heads, head, kv_dtype="auto", **kw):
    args = dict(num_heads=heads, head_size=head, scale=head ** -0.5, num_kv_heads=kv_heads, alibi_slopes=None,
                kv_cache_dtype=kv_dtype, sliding_window=None) | kw
    return cpu_attn.CPUAttentionBackendImpl(**args), cpu_attention.FusedUpdateCPUAttentionImpl(**args)


def batch(query_lens, context_lens, heads, kv_heads, head, dtype, kv_dtype, window, gen):
    """Metadata for sequences that already hold ``context_lens`` tokens and add ``query_lens`` now, each on
    its own blocks; q, k, v for the new tokens; a layer stand-in as vLLM's builder leaves it."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = max(-(-s // BLOCK) for s in seq_lens)
    table = torch.arange(len(seq_lens) * blocks_per_seq, dtype=torch.int32).view(len(seq_lens), blocks_per_seq)
    slots = [int(table[i, p // BLOCK]) * BLOCK + p % BLOCK
             for i, (c, s) in enumerate(zip(context_lens, seq_lens)) for p in range(c, s)]
    starts = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    isa = cpu_attn._get_attn_isa(dtype, BLOCK, head, kv_dtype)
    scheduler = cpu_attn.ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=head, seq_lens=seq_t,
        dtype=dtype, query_start_loc=starts, causal=True, sliding_window_size=window, isa=isa,
        enable_kv_split=False, dynamic_causal=None, kv_cache_dtype=kv_dtype)
    n = sum(query_lens)
    meta = cpu_attn.CPUAttentionMetadata(
        num_actual_tokens=n, max_query_len=max(query_lens), query_start_loc=starts, max_seq_len=max(seq_lens),
        seq_lens=seq_t, block_table=table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        scheduler_metadata=scheduler)
    q = torch.randn(n, heads, head, generator=gen).to(dtype)
    k = torch.randn(n, kv_heads, head, generator=gen).to(dtype)
    v = torch.randn(n, kv_heads, head, generator=gen).to(dtype)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, layer_name="model.layers.0.attn")
    cache = torch.randn(table.numel(), kv_heads, BLOCK, 2 * head, generator=gen) * 0.5
    # an fp8 cache is stored as bytes (vLLM's STR_DTYPE_TO_TORCH_DTYPE["fp8"] is uint8): finite e4m3 values
    cache = cache.to(torch.float8_e4m3fn).view(torch.uint8) if kv_dtype.startswith("fp8") else cache.to(dtype)
    return meta, q, k, v, layer, cache


CASES = [
    # heads, kv heads, head size, dtype, KV dtype, extra impl args
    (16, 8, 128, torch.bfloat16, "auto", {}),
    (4, 4, 64, torch.float32, "auto", {}),
    (8, 2, 128, torch.bfloat16, "auto", {"sliding_window": 40, "logits_soft_cap": 30.0}),
    pytest.param(8, 8, 64, torch.bfloat16, "fp8", {}, marks=pytest.mark.skipif(
        not torch.cpu._is_avx512_supported(), reason="vLLM's fp8 KV cache on CPU needs AVX-512 or AMX")),
]


def assert_decode_close(got, want):
    """ternary_rs's decode kernel against vLLM's: the same f32 softmax, other summation orders — one
    rounding of the output's dtype apart at most (and a few f32 ulps)."""
    ulp = {torch.float32: 2 ** -20, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[want.dtype]
    diff = (got.double() - want.double()).abs()
    assert (diff <= ulp * want.double().abs() + 1e-5).all(), diff.max()


@pytest.mark.parametrize("heads,kv_heads,head,dtype,kv_dtype,extra", CASES)
@pytest.mark.parametrize("query_lens,context_lens", [([1], [37]), ([1, 1, 1], [5, 64, 100]),
                                                     ([7, 1, 19], [0, 33, 60])])
@pytest.mark.parametrize("kernel", ["auto", "vllm"])
def test_fused_update_matches_vllm_update_then_forward(heads, kv_heads, head, dtype, kv_dtype, extra,
                                                       query_lens, context_lens, kernel, monkeypatch):
    monkeypatch.setenv("TERNARY_RS_CPU_ATTENTION", kernel)
    gen = torch.Generator().manual_seed(sum(query_lens) * 31 + heads)
    vllm_impl, fused = impls(heads, kv_heads, head, kv_dtype, **extra)
    window = extra.get("sliding_window", -1)
    meta, q, k, v, layer, cache = batch(query_lens, context_lens, heads, kv_heads, head, dtype, kv_dtype, window, gen)
    cache_vllm, cache_fused = cache.clone(), cache.clone()
    out_vllm = torch.full_like(q, float("nan"))
    out_fused = torch.full_like(q, float("nan"))
    vllm_impl.do_kv_cache_update(layer, k, v, cache_vllm, meta.slot_mapping)
    vllm_impl.forward(layer, q, k, v, cache_vllm, meta, out_vllm)
    assert fused.forward(layer, q, k, v, cache_fused, meta, out_fused) is out_fused
    assert torch.equal(cache_fused.view(torch.uint8), cache_vllm.view(torch.uint8))
    assert not torch.equal(cache_fused.view(torch.uint8), cache.view(torch.uint8)), "the update wrote nothing"
    # ternary_rs's decode kernel reads vLLM's vec / vec16 cache layouts (not AMX's packed one)
    takes = (kernel == "auto" and kv_dtype == "auto" and layer.isa in cpu_attention._DECODE_LAYOUTS
             and ops.NATIVE_ATTENTION_UNAVAILABLE is None)
    assert (fused._decode is not None) == takes
    ours = takes and max(query_lens) == 1
    assert not out_fused.isnan().any()
    if ours:
        assert_decode_close(out_fused, out_vllm)
    else:
        assert torch.equal(out_fused, out_vllm)
    # the next step reuses the layer's cache views; a cache bound anew gets its own
    views = fused._cache_views
    fused.forward(layer, q, k, v, cache_fused, meta, out_fused)
    assert fused._cache_views is views
    other = cache.clone()
    fused.forward(layer, q, k, v, other, meta, out_fused)
    assert fused._cache_views[0] is other
    assert torch.equal(other.view(torch.uint8), cache_vllm.view(torch.uint8))


def test_padded_keys_take_the_forward_context_s_slots_and_shared_caches_are_not_written(monkeypatch):
    """Keys past the metadata's slot mapping (padding) go through vLLM's update with the forward context's
    mapping for the layer, as vLLM's separate op would; a layer that shares another's cache writes none;
    warm-up (no metadata) leaves the output alone."""
    gen = torch.Generator().manual_seed(3)
    vllm_impl, fused = impls(8, 8, 64)
    meta, q, k, v, layer, cache = batch([1, 1], [9, 40], 8, 8, 64, torch.bfloat16, "auto", -1, gen)
    padded = [torch.cat([t, torch.zeros_like(t[:1])]) for t in (q, k, v)]
    context_slots = torch.cat([meta.slot_mapping, torch.tensor([-1])])  # -1: vLLM's padding slot, skipped
    import vllm.forward_context as fc

    monkeypatch.setattr(fc, "get_forward_context",
                        lambda: SimpleNamespace(slot_mapping={layer.layer_name: context_slots}))
    expect, got = cache.clone(), cache.clone()
    out_vllm, out_fused = torch.zeros_like(padded[0]), torch.zeros_like(padded[0])
    vllm_impl.do_kv_cache_update(layer, padded[1], padded[2], expect, context_slots)
    vllm_impl.forward(layer, *padded, expect, meta, out_vllm)
    fused.forward(layer, *padded, got, meta, out_fused)
    assert torch.equal(got, expect)
    assert_decode_close(out_fused[:2], out_vllm[:2])
    assert torch.equal(out_fused[2:], out_vllm[2:])  # the padded token's row is left alone

    _, sharing = impls(8, 8, 64, kv_sharing_target_layer_name="model.layers.0.attn")
    untouched = cache.clone()
    sharing.forward(layer, q, k, v, untouched, meta, torch.zeros_like(q))
    assert torch.equal(untouched, cache)
    out = torch.full_like(q, 7.0)
    assert fused.forward(layer, q, k, v, cache, None, out) is out and (out == 7.0).all()


def test_encoder_attention_keeps_vllm_s_path():
    """Encoder attention (no paged cache update) is vLLM's forward unchanged: the same call lands in
    ``CPUAttentionBackendImpl.forward`` with the same arguments."""
    _, fused = impls(4, 4, 64, attn_type=AttentionType.ENCODER_ONLY)
    calls = []
    orig = cpu_attn.CPUAttentionBackendImpl.forward
    try:
        cpu_attn.CPUAttentionBackendImpl.forward = lambda self, *a, **kw: calls.append(a) or "vllm"
        meta = SimpleNamespace(slot_mapping=torch.zeros(2, dtype=torch.int64))
        k = torch.zeros(2, 4, 64)
        assert fused.forward(None, k, k, k, None, meta, k) == "vllm" and len(calls) == 1
    finally:
        cpu_attn.CPUAttentionBackendImpl.forward = orig


def test_selected_for_ternary_models_only_and_never_over_the_user_s_backend(monkeypatch):
    """vLLM's own ``CPU_ATTN`` pick becomes the fused backend for a ternary model; a backend the user named,
    an override of ``CPU_ATTN`` someone registered, or another quantization keep vLLM's choice."""
    import vllm.config as vc
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    default = AttentionBackendEnum.CPU_ATTN.value
    ternary = SimpleNamespace(quant_config=SimpleNamespace(get_name=lambda: "ternary"))
    fp8 = SimpleNamespace(quant_config=SimpleNamespace(get_name=lambda: "fp8"))
    dense = SimpleNamespace(quant_config=None)
    for config, expect in ((ternary, plugin.FUSED_ATTENTION), (fp8, default), (dense, default)):
        monkeypatch.setattr(vc, "get_current_vllm_config", lambda c=config: c)
        assert plugin.attention_backend_path(default, None) == expect
    monkeypatch.setattr(vc, "get_current_vllm_config", lambda: ternary)
    assert plugin.attention_backend_path(default, AttentionBackendEnum.CPU_ATTN) == default
    assert plugin.attention_backend_path("my.Backend", None) == "my.Backend"
    assert plugin.attention_choice(SimpleNamespace(attention_config=SimpleNamespace(backend=None))).value == \
        "CPU_ATTN+update"
    mine = plugin.attention_choice(SimpleNamespace(attention_config=SimpleNamespace(
        backend=AttentionBackendEnum.CPU_ATTN)))
    assert mine.by_user and mine.value == "CPU_ATTN" and not mine.variable
    register_backend(AttentionBackendEnum.CPU_ATTN, "my.Backend")
    try:
        assert plugin.attention_choice(SimpleNamespace(attention_config=SimpleNamespace(backend=None))).by_user
        assert plugin.attention_backend_path(AttentionBackendEnum.CPU_ATTN.get_path(), None) == "my.Backend"
    finally:
        AttentionBackendEnum.CPU_ATTN.clear_override()
    # the path the plugin names is importable and is vLLM's backend with the update inside
    from vllm.utils.import_utils import resolve_obj_by_qualname

    cls = resolve_obj_by_qualname(plugin.FUSED_ATTENTION)
    assert issubclass(cls, cpu_attn.CPUAttentionBackend) and cls.forward_includes_kv_cache_update
    assert cls.get_name() == "CPU_ATTN" and cls.get_builder_cls() is cpu_attn.CPUAttentionMetadataBuilder
