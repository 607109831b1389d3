"""``ternary_rs::decode_attention`` (bindings ``torch/attention_op.rs`` → core ``attention.rs``) against the torch
reference (``ops._decode_attention_torch``, also its fallback): every dtype, GQA, block sizes, sliding window,
soft-cap, strided queries and outputs, padded cache pages, empty sequences; every kernel build this CPU runs;
and the arguments it refuses, with a message that names what is wrong."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ternary_rs.serving import _ops_cpu, ops  # noqa: E402

ULP = {torch.float32: 2 ** -20, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def paged(seq_lens, kv_heads, head, block, dtype, gen, pad_blocks=0, pad_heads=0):
    """A cache holding ``seq_lens`` tokens on shuffled blocks (one spare), as vLLM lays it out; with padding,
    a strided view of a larger buffer (vLLM pads hybrid models' pages). Returns (cache, block table)."""
    width = max(1, max(-(-s // block) for s in seq_lens))
    blocks = len(seq_lens) * width + 1
    slab = 2 * block * head
    head_stride, block_stride = slab + pad_heads, kv_heads * (slab + pad_heads) + pad_blocks
    buf = torch.randn(blocks * block_stride + slab, generator=gen).to(dtype)
    cache = buf.as_strided((blocks, kv_heads, block, 2 * head), (block_stride, head_stride, 2 * head, 1))
    order = torch.randperm(blocks, generator=gen)[: len(seq_lens) * width].view(len(seq_lens), width)
    table = torch.full((len(seq_lens) + 2, width + 3), -7, dtype=torch.int32)  # extra rows, padded columns
    table[: len(seq_lens), :width] = order.int()
    return cache, table[:, :width]


def check(seq_lens, heads, kv_heads, head, block, dtype, window=-1, softcap=0.0, seed=0, pad=(0, 0), out2d=False):
    gen = torch.Generator().manual_seed(seed)
    cache, table = paged(seq_lens, kv_heads, head, block, dtype, gen, *pad)
    n = len(seq_lens)
    # a query cut out of a wider qkv tensor, as vLLM's attention layer passes it
    qkv = torch.randn(n, heads + 2 * kv_heads, head, generator=gen).to(dtype)
    q = qkv[:, :heads]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head ** -0.5
    want = torch.zeros(n, heads, head, dtype=dtype)
    ops._decode_attention_torch(want, q, cache, lens, table, scale, window, softcap)
    got = torch.full((n, heads * head) if out2d else (n, heads, head), float("nan"), dtype=dtype)
    ops.decode_attention(got, q, cache, lens, table, scale, window, softcap)
    got = got.view(n, heads, head)
    diff = (got.double() - want.double()).abs()
    assert (diff <= ULP[dtype] * want.double().abs() + 1e-5).all(), diff.max()
    return got


def test_native_kernel_is_registered():
    assert ops.NATIVE_ATTENTION_UNAVAILABLE is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head,block", [(16, 8, 128, 128), (8, 2, 64, 32), (24, 4, 256, 128),
                                                        (6, 1, 80, 16), (4, 4, 32, 64)])
def test_matches_the_torch_reference(dtype, heads, kv_heads, head, block):
    check([1, 37, 300, 128, 0, 129], heads, kv_heads, head, block, dtype, seed=heads + head)


@pytest.mark.parametrize("kernel", _ops_cpu.available_variants())
def test_every_kernel_build(kernel):
    old = _ops_cpu._variant
    try:
        _ops_cpu.set_kernel_variant(kernel)
        check([5, 700, 64], 8, 2, 128, 128, torch.bfloat16, window=300, softcap=20.0, seed=3)
    finally:
        _ops_cpu.set_kernel_variant(old)


def test_window_softcap_padded_pages_and_flat_output():
    check([90, 41, 2, 1000], 8, 2, 64, 32, torch.bfloat16, window=40, softcap=30.0, pad=(40, 8), out2d=True)
    # one long sequence on many threads: its keys split into spans and merged
    check([20000], 16, 8, 128, 128, torch.bfloat16, seed=5)


def test_empty_sequences_give_zeros():
    got = check([0, 3], 4, 2, 64, 32, torch.float32)
    assert (got[0] == 0).all()


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=5), group=st.sampled_from([1, 2, 3, 6]),
       kv_heads=st.sampled_from([1, 2, 4]), head=st.sampled_from([16, 64, 96]), block=st.sampled_from([16, 32, 128]),
       window=st.sampled_from([-1, 1, 50]), softcap=st.sampled_from([0.0, 5.0]), seed=st.integers(0, 1000))
def test_random_shapes(lens, group, kv_heads, head, block, window, softcap, seed):
    check(lens, group * kv_heads, kv_heads, head, block, torch.float32, window, softcap, seed)


def test_bad_arguments_name_what_is_wrong():
    gen = torch.Generator().manual_seed(1)
    cache, table = paged([40, 10], 2, 64, 32, torch.bfloat16, gen)
    q = torch.randn(2, 4, 64).bfloat16()
    out = torch.empty_like(q)
    lens = torch.tensor([40, 10], dtype=torch.int32)

    def err(**kw):
        args = dict(out=out, query=q, kv_cache=cache, seq_lens=lens, block_table=table) | kw
        with pytest.raises(RuntimeError) as e:
            ops.decode_attention(args["out"], args["query"], args["kv_cache"], args["seq_lens"], args["block_table"],
                                 0.125)
        return str(e.value)

    bad = table.clone()
    bad[1, 0] = cache.shape[0]
    assert "sequence 1: block table entry 0 is block 5; the cache has 5 blocks" in err(block_table=bad)
    assert "needs 3 blocks of 32" in err(seq_lens=torch.tensor([70, 10], dtype=torch.int32))
    assert "seq_lens must be int32" in err(seq_lens=lens.long())
    assert "out must have the query's dtype" in err(out=out.float())
    assert "kv_cache must be [blocks, kv_heads, block_size, 128]" in err(kv_cache=cache[..., :64])
    assert "out overlaps query" in err(out=q)
    assert "out must be [2, 4, 64] or [2, 256]" in err(out=torch.empty(2, 4, 32).bfloat16())
    assert "4 query heads over 3 KV heads" in err(kv_cache=torch.zeros(5, 3, 32, 128).bfloat16())
