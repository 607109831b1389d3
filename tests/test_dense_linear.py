"""torch.ops.ternary_rs.dense_linear (a ternary model's dense bf16 / f16 layers on CPUs without native bf16
GEMM; ``half_linear`` in the Rust core) against a float64 product, and the routing the vLLM plugin does.

Documented bound (``rust/ternary-core/src/kernels/cpu/half_linear.rs``): f32 sums of exact products,
``|y − y64| ≤ K·2⁻²³·Σₖ|x_k·W[n,k]|``, then one rounding to the half type (half an ulp: 2⁻⁸ relative for
bf16, 2⁻¹¹ for fp16, plus fp16's subnormal step).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ternary_rs.serving import _ops_cpu, ops

OP = torch.ops.ternary_rs.dense_linear
OUT_EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def check_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    exact = x64 @ w64.T
    mass = x64.abs() @ w64.abs().T
    if bias is not None:
        exact = exact + bias.double()
        mass = mass + bias.double().abs()
    k = x.shape[-1]
    sums = (k + 2) * 2.0**-23 * mass
    bound = sums + (exact.abs() + sums) * OUT_EPS[w.dtype] + 2.0**-24
    err = (y.double().reshape(exact.shape) - exact).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()} (shape x {tuple(x.shape)}, w {tuple(w.shape)})"


@given(
    m=st.integers(1, 19),
    n=st.integers(1, 70),
    k=st.integers(1, 300),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_matches_float64_within_the_bound(m, n, k, dtype, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    y = OP(x, w, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    check_bound(y, x, w, bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_shapes_threads_and_the_scalar_reference_agree_bit_for_bit(dtype):
    """Several threads, one thread and the scalar reference variant (same summation order) give the same
    bits; the head-sized product stays within the float64 bound."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(17, 1030, generator=g).to(dtype)
    w = (torch.randn(3001, 1030, generator=g) * 0.03).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        y = OP(x, w)
        torch.set_num_threads(1)
        y1 = OP(x, w)
        _ops_cpu.set_kernel_variant("scalar")
        ys = OP(x, w)
    finally:
        _ops_cpu.set_kernel_variant("auto")
        torch.set_num_threads(threads)
    assert torch.equal(y.view(torch.int16), y1.view(torch.int16))
    assert torch.equal(y.view(torch.int16), ys.view(torch.int16))
    check_bound(y, x, w, None)


def test_batched_and_strided_inputs():
    """x of any leading shape, a transposed (non-contiguous) weight view and an empty batch."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, generator=g).to(torch.bfloat16)
    wt = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    y = OP(x, wt.T)
    assert y.shape == (2, 3, 24)
    check_bound(y, x, wt.T.contiguous(), None)
    assert OP(x[:0], wt.T).shape == (0, 3, 24)


def test_refusals_name_the_problem():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"x has shape \[2, 15\], expected \[\.\.\., 16\]"):
        OP(torch.zeros(2, 15, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="x must have the weight's dtype"):
        OP(torch.zeros(2, 16, dtype=torch.float16), w)
    with pytest.raises(RuntimeError, match="weight dtype is not supported"):
        OP(torch.zeros(2, 16), torch.zeros(8, 16))
    with pytest.raises(RuntimeError, match=r"weight must be 2-D"):
        OP(torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(2, 8, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"bias must be a CPU tensor of shape \[8\]"):
        OP(torch.zeros(2, 16, dtype=torch.bfloat16), w, torch.zeros(7, dtype=torch.bfloat16))


def test_native_and_traceable():
    assert ops.NATIVE_DENSE_UNAVAILABLE is None, ops.NATIVE_DENSE_UNAVAILABLE
    w = torch.randn(12, 32).to(torch.bfloat16)
    f = torch.compile(lambda x: ops.dense_linear(x, w) * 2, backend="aot_eager", fullgraph=True, dynamic=True)
    x = torch.randn(5, 32).to(torch.bfloat16)
    assert torch.equal(f(x), OP(x, w) * 2)


def test_vllm_routing_rule():
    """Which dense weights the plugin sends to the kernel: 2-D bf16 / f16 CPU weights, only where torch's
    bf16 GEMM is not native; activations of another dtype keep torch's linear."""
    pytest.importorskip("vllm")
    from ternary_rs.serving.cpu import bf16_gemm_is_native
    from ternary_rs.vllm import dense

    slow = not bf16_gemm_is_native()
    assert dense.takes_dense_kernel(torch.zeros(4, 8, dtype=torch.bfloat16)) == slow
    assert dense.takes_dense_kernel(torch.zeros(4, 8, dtype=torch.float16)) == slow
    assert not dense.takes_dense_kernel(torch.zeros(4, 8))  # float32: torch's GEMM is fine
    assert not dense.takes_dense_kernel(torch.zeros(0, dtype=torch.bfloat16))  # packed away by vLLM
    assert not dense.takes_dense_kernel(torch.zeros(2, 4, 8, dtype=torch.bfloat16))
    assert not dense.takes_dense_kernel(None)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(6, 8).to(torch.bfloat16), requires_grad=False)
    assert dense.route_to_dense_kernel(layer) == slow
    if slow:
        x = torch.randn(3, 8).to(torch.bfloat16)
        assert torch.equal(layer.cpu_linear(x, layer.weight, None), OP(x, layer.weight))
        xf, wf = torch.randn(3, 8), layer.weight.float()
        assert torch.equal(layer.cpu_linear(xf, wf, None), torch.nn.functional.linear(xf, wf))


def test_routed_weight_moves_to_huge_pages_once_and_tied_sharers_follow():
    """A weight the plugin routes to the kernel is copied onto huge pages (where THP allows) with the
    same values, through ``.data``: a module tied to the same Parameter sees the move, and routing the
    tied partner too does not copy it again."""
    pytest.importorskip("vllm")
    from ternary_rs.serving import hugepages
    from ternary_rs.serving.cpu import bf16_gemm_is_native
    from ternary_rs.vllm import dense

    if bf16_gemm_is_native():
        pytest.skip("torch's bf16 GEMM is native here: the plugin leaves dense layers to vLLM")
    values = torch.randn(64, 32).to(torch.bfloat16)
    head, embed = torch.nn.Module(), torch.nn.Module()
    head.weight = torch.nn.Parameter(values.clone(), requires_grad=False)
    embed.weight = head.weight  # tied
    assert dense.route_to_dense_kernel(head)
    assert torch.equal(head.weight, values) and embed.weight is head.weight
    moved = head.weight.data_ptr()
    assert hugepages.advised(head.weight) == hugepages.available()
    assert dense.route_to_dense_kernel(embed)
    assert embed.weight.data_ptr() == moved  # not copied twice
