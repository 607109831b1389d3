"""CPU weight memory on huge pages (``ternary_rs.serving.hugepages``): the prepared weights the kernels
stream live in mappings that asked for 2 MiB pages, and nothing about their values, shapes or lifetimes
differs from ``torch.empty`` memory. Where the kernel has THP off (or off Linux) the module must be plain
``torch.empty``; both branches are tested here whatever this machine has."""

from __future__ import annotations

import gc
import mmap
import threading

import numpy as np
import pytest
import torch

from ternary_rs.serving import hugepages, ops

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="transparent huge pages are off here "
                               f"({hugepages.thp_mode()}); the fallback test below covers this machine")


def test_thp_mode_reads_the_bracketed_word(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "THP_ENABLED", f)
    assert hugepages.thp_mode() == "madvise"
    f.write_text("always madvise [never]\n")
    assert hugepages.thp_mode() == "never" and not hugepages.available()
    monkeypatch.setattr(hugepages, "THP_ENABLED", tmp_path / "missing")
    assert hugepages.thp_mode() == "unavailable" and not hugepages.available()


def test_without_thp_it_is_torch_empty(monkeypatch):
    monkeypatch.setattr(hugepages, "available", lambda: False)
    t = hugepages.empty((3, 5), torch.float16)
    assert t.shape == (3, 5) and t.dtype == torch.float16 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == 30  # its own storage, not a view of a shared region
    assert torch.equal(hugepages.copy_of(torch.ones(2, 3).t()), torch.ones(3, 2))


@needs_thp
@pytest.mark.parametrize("shape,dtype", [((7,), torch.uint8), ((33, 17), torch.float16), ((5, 3, 2), torch.float32),
                                         ((3 << 20,), torch.float32), ((0, 4), torch.uint8)])
def test_tensors_behave_like_torch_empty(shape, dtype):
    t = hugepages.empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    if t.numel():
        assert t.data_ptr() % hugepages.ALIGN == 0
        src = torch.arange(t.numel()).reshape(shape).to(dtype)
        t.copy_(src)
        assert torch.equal(t, src)
        assert hugepages.advised(t)


@needs_thp
def test_large_tensors_start_on_a_huge_page_and_get_huge_pages():
    t = hugepages.empty((hugepages.OWN_REGION_BYTES + 12345,), torch.uint8)
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t.fill_(3)
    assert hugepages.advised(t)
    # Whether the kernel found free 2 MiB frames is its business (fragmentation); report, don't insist.
    print(f"huge-page bytes behind an {t.numel()}-byte tensor: {hugepages.huge_page_bytes(t)}")


@needs_thp
def test_small_tensors_share_a_region_without_overlapping():
    ts = [hugepages.empty((n,), torch.uint8) for n in (1, 63, 64, 65, 4096, 100_000, 3)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in ts)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    for i, t in enumerate(ts):
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(ts))


@needs_thp
def test_tensors_outlive_the_arena_and_free_their_region():
    keep = hugepages.empty((1000,), torch.float32)
    keep.copy_(torch.arange(1000, dtype=torch.float32))
    hugepages._current = None  # the arena forgets the region; the tensor still holds it
    junk = [torch.full((1 << 18,), 7.0) for _ in range(8)]
    gc.collect()
    del junk
    assert torch.equal(keep, torch.arange(1000, dtype=torch.float32))
    big = hugepages.empty((hugepages.OWN_REGION_BYTES,), torch.uint8)
    address = big.data_ptr()
    del big
    gc.collect()
    assert hugepages._smaps_entry(address) == {}  # its own region was unmapped with it


@needs_thp
def test_concurrent_allocations_do_not_overlap():
    got: list[torch.Tensor] = []
    lock = threading.Lock()

    def work():
        mine = [hugepages.empty((4096 + 64 * i,), torch.uint8) for i in range(50)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in got)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_copy_equals_torch():
    x = torch.randn(5, 7).t()  # non-contiguous source
    c = hugepages.copy_of(x)
    assert torch.equal(c, x) and c.is_contiguous()


@needs_thp
def test_prepared_cpu_weights_are_on_huge_page_memory_and_compute_the_same():
    rng = np.random.default_rng(5)
    n, k, g = 72, 512, 128
    codes = rng.integers(0, 3, size=(n, k), dtype=np.uint8)
    packed = torch.from_numpy((codes.reshape(n, k // 4, 4) << np.array([0, 2, 4, 6], dtype=np.uint8))
                              .sum(axis=2, dtype=np.uint8))
    scales = torch.from_numpy(rng.uniform(0.01, 0.1, size=(n, k // g)).astype(np.float16))
    qk, sk = ops.prepare_weight(packed, scales, g)
    assert hugepages.advised(qk) and hugepages.advised(sk)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    on_huge = torch.ops.ternary_rs.ternary_linear(x, qk, sk, n, k, g)
    # The plain copies live in a mapping of their own that never asked for huge pages: a torch clone
    # comes from the malloc heap, which another test in the same process may have left advised.
    qp, sp = _plain_copy(qk), _plain_copy(sk)
    assert not hugepages.advised(qp) and not hugepages.advised(sp)
    plain = torch.ops.ternary_rs.ternary_linear(x, qp, sp, n, k, g)
    assert torch.equal(on_huge, plain)


def _plain_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into a fresh anonymous mapping without MADV_HUGEPAGE (4 KiB pages where THP is madvise)."""
    nbytes = t.numel() * t.element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    out = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def test_trim_heap_keeps_every_live_tensor():
    """``trim_heap`` (glibc ``malloc_trim`` before each CPU prepare, so the heap memory of freed canonical
    tensors goes back to the system) frees nothing that is still in use."""
    live = [torch.full((1 << 16,), float(i)) for i in range(16)]
    dead = [torch.ones(1 << 18) for _ in range(16)]
    del dead
    hugepages.trim_heap()
    assert all(bool((t == i).all()) for i, t in enumerate(live))


def test_stacked_experts_are_prepared_in_place_equal_to_one_by_one():
    """``ops.prepare_stacked`` (the MoE experts) writes each expert's kernel layout straight into its slice
    of one tensor: the same bytes as ``prepare_weight`` expert by expert, stacked."""
    rng = np.random.default_rng(9)
    e, n, k, g = 5, 36, 512, 64
    codes = rng.integers(0, 3, size=(e, n, k), dtype=np.uint8)
    packed = torch.from_numpy((codes.reshape(e, n, k // 4, 4) << np.array([0, 2, 4, 6], dtype=np.uint8))
                              .sum(axis=3, dtype=np.uint8))
    scales = torch.from_numpy(rng.uniform(0.01, 0.1, size=(e, n, k // g)).astype(np.float16))
    qs, ss = ops.prepare_stacked(packed, scales, g)
    one_by_one = [ops.prepare_weight(packed[i], scales[i], g) for i in range(e)]
    assert torch.equal(qs, torch.stack([p[0] for p in one_by_one]))
    assert torch.equal(ss, torch.stack([p[1] for p in one_by_one]))
    assert hugepages.advised(qs) == hugepages.available()
    with pytest.raises(ValueError, match=r"\[E, N, K/4\]"):
        ops.prepare_stacked(packed[0], scales[0], g)
