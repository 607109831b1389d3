"""GPU tests of the fused ternary CUDA kernels (skipped when torch sees no CUDA device).

Every path (decode GEMV for M <= 8, the four mma GEMM tile shapes, split-K and not) is checked against a
float64 reference ``x @ W.T + bias`` with W dequantized here from the canonical tensors by plain torch
ops (codes in the canonical bit order, docs/checkpoint.md#canonical-layout), in bf16 and fp16, with and without bias, under CUDA-graph capture
and replay, on a side stream, and with ``torch.library.opcheck``. Only torch, numpy and pytest are used so
this runs on the bare GPU machine (benches/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch

from ternary_rs import _core
from ternary_rs.serving import _ops_cuda, ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"),
]

DTYPES = [torch.bfloat16, torch.float16]
# Output rounding of the kernel (fp32 accumulation, one rounding to the output dtype) and of the reference.
RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9}


@pytest.fixture(scope="module", autouse=True)
def _kernels_built():
    if not _core.cuda_available():
        pytest.fail("this ternary_rs build has no CUDA kernels; install the wheel built with --features cuda")
    # The dequantize + cuBLAS path and the references must not use reduced-precision reductions.
    flags = torch.backends.cuda.matmul
    saved = (flags.allow_tf32, flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction)
    flags.allow_tf32 = False
    flags.allow_bf16_reduced_precision_reduction = False
    flags.allow_fp16_reduced_precision_reduction = False
    yield
    flags.allow_tf32, flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction = saved


def make_layer(n: int, k: int, g: int, seed: int, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 3, (n, k), generator=gen, dtype=torch.uint8)
    packed = (codes.view(n, k // 4, 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)).sum(-1).to(torch.uint8)
    scales = (torch.rand(n, k // g, generator=gen) * 0.045 + 0.005).to(torch.float16)
    return packed.to(device), scales.to(device)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, g: int) -> torch.Tensor:
    """Canonical -> float64 W[N, K] (independent of the kernels and of the GPU layout)."""
    shifts = torch.tensor([0, 2, 4, 6], device=qweight.device, dtype=torch.uint8)
    codes = ((qweight[..., None] >> shifts) & 3).reshape(qweight.shape[0], -1).double() - 1
    return codes * scales.double().repeat_interleave(g, dim=1)


def reference(x: torch.Tensor, w: torch.Tensor, bias) -> torch.Tensor:
    y = x.double() @ w.T
    return y + bias.double() if bias is not None else y


def assert_matches(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str):
    assert y.dtype == dtype or what.startswith("fp32"), (y.dtype, dtype)
    err = (y.double() - ref).abs()
    bound = RTOL[dtype] * ref.abs() + 1e-3 * ref.abs().max().clamp_min(1e-6)
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} outputs off; worst |err| {float(err.max()):.4g} "
        f"at {tuple(int(i) for i in (err == err.max()).nonzero()[0])}, max |ref| {float(ref.abs().max()):.4g}"
    )


M_VALUES = [1, 2, 3, 8, 16, 24, 33, 128, 512, 2048]  # 24: the 32-row GEMM tile
SHAPES = [(45, 256, 64), (1000, 1024, 128), (333, 2048, 256), (4097, 512, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k,g", SHAPES)
def test_every_path_against_reference(dtype, n, k, g):
    qw, sc = make_layer(n, k, g, seed=n + k)
    w = dequantize(qw, sc, g)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    assert q_k.is_cuda and s_k.is_cuda
    bias = (torch.randn(n, device="cuda") * 0.1).to(dtype)
    for m in M_VALUES:
        if m * k > 2048 * 1024 and m > 512:
            continue
        x = torch.randn(m, k, device="cuda").to(dtype)
        for b in (None, bias):
            y = torch.ops.ternary_rs.ternary_linear(x, q_k, s_k, n, k, g, b)
            plan = _core.cuda_plan(m, n, k, g, torch.cuda.get_device_properties(0).multi_processor_count)
            assert y.shape == (m, n)
            assert_matches(y, reference(x, w, b), dtype, f"m={m} n={n} k={k} g={g} {plan} bias={b is not None}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_group_32_and_half_chunk_k(dtype):
    # K = 96: the last 64-wide chunk is half padding; g = 32 flushes scales twice per chunk.
    n, k, g = 77, 96, 32
    qw, sc = make_layer(n, k, g, seed=5)
    w = dequantize(qw, sc, g)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    for m in (1, 5, 9, 40, 300):
        x = torch.randn(m, k, device="cuda").to(dtype)
        assert_matches(ops.ternary_linear(x, q_k, s_k, n, k, g), reference(x, w, None), dtype, f"g32 m={m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_gemv_cutoff_16_runs_rows_9_to_16_on_the_decode_kernel(dtype):
    n, k, g = 200, 1536, 128
    qw, sc = make_layer(n, k, g, seed=31)
    w = dequantize(qw, sc, g)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    prev = _ops_cuda.set_gemv_max_m(16)
    try:
        for m in (9, 12, 16):
            assert _core.cuda_plan(m, n, k, g, sm)["kernel"] == "gemv"
            x = torch.randn(m, k, device="cuda").to(dtype)
            bias = torch.randn(n, device="cuda").to(dtype)
            assert_matches(ops.ternary_linear(x, q_k, s_k, n, k, g, bias), reference(x, w, bias), dtype, f"gemv16 m={m}")
    finally:
        _ops_cuda.set_gemv_max_m(prev)


def test_batched_noncontiguous_fp32_and_empty_inputs():
    n, k, g = 96, 512, 128
    qw, sc = make_layer(n, k, g, seed=9)
    w = dequantize(qw, sc, g)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    x = torch.randn(3, 5, 2 * k, device="cuda", dtype=torch.bfloat16)[..., ::2]  # non-contiguous
    y = ops.ternary_linear(x, q_k, s_k, n, k, g)
    assert y.shape == (3, 5, n)
    assert_matches(y.reshape(-1, n), reference(x.reshape(-1, k), w, None), torch.bfloat16, "batched")
    x32 = torch.randn(4, k, device="cuda")
    y32 = ops.ternary_linear(x32, q_k, s_k, n, k, g)
    assert y32.dtype == torch.float32  # computed in bf16 (documented), returned as fp32
    assert_matches(y32, reference(x32.to(torch.bfloat16), w, None), torch.bfloat16, "fp32 input")
    empty = ops.ternary_linear(torch.empty(0, k, device="cuda", dtype=torch.float16), q_k, s_k, n, k, g)
    assert empty.shape == (0, n)


def test_split_k_is_deterministic_and_counters_reset():
    n, k, g = 64, 4096, 128  # few strips, long K: the decode kernel splits K
    qw, sc = make_layer(n, k, g, seed=13)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (1, 8, 16, 64):
        assert _core.cuda_plan(m, n, k, g, sm)["splits"] > 1
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        first = ops.ternary_linear(x, q_k, s_k, n, k, g)
        for _ in range(5):
            assert torch.equal(ops.ternary_linear(x, q_k, s_k, n, k, g), first)
        assert_matches(first, reference(x, dequantize(qw, sc, g), None), torch.bfloat16, f"split m={m}")


@pytest.mark.parametrize("m", [1, 4, 16, 200])
@pytest.mark.parametrize("warm_stream", [True, False], ids=["warm-stream", "fresh-stream"])
def test_cuda_graph_capture_and_replay(m, warm_stream):
    # warm-stream: the capture stream ran the op before (its split-K counters exist); fresh-stream: the
    # counters are first allocated (and zeroed) inside the capture.
    n, k, g = 320, 2048, 128
    qw, sc = make_layer(n, k, g, seed=m)
    w = dequantize(qw, sc, g)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    static_x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    if warm_stream:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ops.ternary_linear(static_x, q_k, s_k, n, k, g, bias)
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_y = ops.ternary_linear(static_x, q_k, s_k, n, k, g, bias)
    for step in range(4):
        static_x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(static_y, reference(static_x, w, bias), torch.bfloat16, f"graph replay {step} m={m}")
    # Eager calls after the graph still see zeroed counters.
    assert_matches(ops.ternary_linear(static_x, q_k, s_k, n, k, g, bias), reference(static_x, w, bias),
                   torch.bfloat16, f"eager after graph m={m}")


def test_side_stream_and_second_layer_interleaved():
    qa, sa = make_layer(100, 1024, 64, seed=1)
    qb, sb = make_layer(60, 1024, 256, seed=2)
    pa, pb = ops.prepare_weight(qa, sa, 64), ops.prepare_weight(qb, sb, 256)
    x = torch.randn(2, 1024, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ya = ops.ternary_linear(x, *pa, 100, 1024, 64)
        yb = ops.ternary_linear(x, *pb, 60, 1024, 256)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert_matches(ya, reference(x, dequantize(qa, sa, 64), None), torch.float16, "stream a")
    assert_matches(yb, reference(x, dequantize(qb, sb, 256), None), torch.float16, "stream b")


def test_bad_arguments_raise():
    qw, sc = make_layer(64, 256, 64, seed=3)
    q_k, s_k = ops.prepare_weight(qw, sc, 64)
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    # The native kernel reports through torch (RuntimeError), the Python path with ValueError/TypeError.
    with pytest.raises((ValueError, RuntimeError), match="prepared CUDA layout"):
        ops.ternary_linear(x, qw, s_k, 64, 256, 64)
    with pytest.raises((ValueError, RuntimeError), match="features"):
        ops.ternary_linear(x[:, :128], q_k, s_k, 64, 256, 64)
    with pytest.raises((TypeError, RuntimeError), match="not supported"):
        ops.ternary_linear(x.to(torch.float64), q_k, s_k, 64, 256, 64)


@pytest.mark.parametrize("m", [1, 24])
def test_opcheck(m):
    n, k, g = 96, 512, 128
    qw, sc = make_layer(n, k, g, seed=21)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.ternary_rs.ternary_linear.default, (x, q_k, s_k, n, k, g, bias))
    torch.library.opcheck(torch.ops.ternary_rs.ternary_linear.default, (x, q_k, s_k, n, k, g, None))


def test_prepared_tensor_shapes():
    for n, k, g in [(45, 96, 32), (4097, 512, 128)]:
        qw, sc = make_layer(n, k, g, seed=1)
        q_k, s_k = _ops_cuda.prepare_weight(qw, sc, g)
        assert (tuple(q_k.shape), tuple(s_k.shape)) == _ops_cuda.gpu_shapes(n, k, g)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_dequantize_is_exact_and_dequant_cublas_path(dtype):
    n, k, g = 333, 1024, 64
    qw, sc = make_layer(n, k, g, seed=17)
    w = dequantize(qw, sc, g)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    # trit * scale rounded once to dtype: exactly what rounding the float64 reference gives.
    assert torch.equal(_ops_cuda.dequantize(q_k, s_k, n, k, g, dtype), w.to(dtype))
    x = torch.randn(600, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    prev = _ops_cuda.set_dequant_min_m(512)
    try:
        y = ops.ternary_linear(x, q_k, s_k, n, k, g, bias)
    finally:
        _ops_cuda.set_dequant_min_m(prev)
    # cuBLAS on the rounded weights: compare with the reference on the same rounded weights.
    assert_matches(y, reference(x, w.to(dtype).double(), bias), dtype, "dequant + cuBLAS")


# ---- the native registration (rust/bindings/src/torch/cuda_op.rs) against the Python path it replaces ----

def test_the_cuda_kernel_is_registered_natively():
    assert ops.NATIVE_CUDA_UNAVAILABLE is None, f"native CUDA registration failed: {ops.NATIVE_CUDA_UNAVAILABLE}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("n,k,g", [(320, 2048, 128), (64, 4096, 128), (45, 256, 32)], ids=["plain", "split-k", "g32"])
def test_native_kernel_equals_the_python_path(dtype, n, k, g):
    """Same kernels, same plans, same conversions: the native op is the Python path bit for bit."""
    qw, sc = make_layer(n, k, g, seed=n + g)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    for m in (1, 5, 16, 48, 300):
        x = torch.randn(2, m, k, device="cuda", dtype=dtype)
        for b in (None, bias):
            for mode in (ops.AUTO, ops.EXACT, ops.INT8_TOKEN):
                native = torch.ops.ternary_rs.ternary_linear(x, q_k, s_k, n, k, g, b, mode)
                python = _ops_cuda.ternary_linear(x, q_k, s_k, n, k, g, b, mode)
                assert native.dtype == dtype and native.shape == (2, m, n)
                assert torch.equal(native, python), f"m={m} mode={mode} bias={b is not None}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_native_int8_modes_against_their_reference(dtype):
    """Per token: ``(Σ q·W)·xs + bias`` from the CPU kernel's codes (``_int8_activations``); per group: the
    GEMM of the dequantized q·xs_g. Both within the output rounding of float64 references."""
    n, k, g = 192, 1024, 64
    qw, sc = make_layer(n, k, g, seed=31)
    w = dequantize(qw, sc, g)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    bias = torch.randn(n, device="cuda").to(dtype)
    x = (torch.randn(9, k, device="cuda") * torch.logspace(-3, 2, 9, device="cuda").unsqueeze(1)).to(dtype)
    y = ops.ternary_linear(x, q_k, s_k, n, k, g, bias, ops.INT8_TOKEN)
    q, xs = _ops_cuda._int8_activations(x, g, True)
    ref = reference(q.double(), w, None) * xs.double() + bias.double()
    bound = torch.float16 if dtype == torch.float32 else dtype  # fp32 x: the fp16 GEMM output's rounding
    assert_matches(y.to(bound), ref, bound, "int8 per token")
    y = ops.ternary_linear(x, q_k, s_k, n, k, g, bias, ops.INT8_GROUP)
    xq, _ = _ops_cuda._int8_activations(x, g, False)
    ref = reference(xq.to(torch.bfloat16), w, bias.to(torch.bfloat16))
    assert_matches(y.to(torch.bfloat16), ref, torch.bfloat16, "int8 per group")


def test_native_int8_token_mode_under_graph_capture_and_opcheck():
    n, k, g = 256, 2048, 128
    qw, sc = make_layer(n, k, g, seed=41)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    static_x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_y = ops.ternary_linear(static_x, q_k, s_k, n, k, g, bias, ops.INT8_TOKEN)
    for _ in range(3):
        static_x.copy_(torch.randn(4, k, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, _ops_cuda.ternary_linear(static_x, q_k, s_k, n, k, g, bias, ops.INT8_TOKEN))
    torch.library.opcheck(torch.ops.ternary_rs.ternary_linear.default, (static_x, q_k, s_k, n, k, g, bias, ops.INT8_TOKEN))


def test_native_errors_name_the_problem():
    qw, sc = make_layer(64, 256, 64, seed=3)
    q_k, s_k = ops.prepare_weight(qw, sc, 64)
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises((RuntimeError, ValueError), match="activations=9"):
        ops.ternary_linear(x, q_k, s_k, 64, 256, 64, None, 9)
    with pytest.raises((RuntimeError, ValueError), match="another device|CUDA tensor|is on cpu"):
        ops.ternary_linear(x, q_k.cpu(), s_k, 64, 256, 64)


@pytest.mark.parametrize("path", ["native", "python"])
def test_counters_made_inside_a_capture_are_zeroed_before_eager_use(path):
    """The first split-K call on a fresh stream is inside a capture, so its counters' zeros exist only as a
    node of that graph. An eager call on the same stream before the graph ever replays, and a second
    capture on it, must still see zeroed counters."""
    fn = ops.ternary_linear if path == "native" else _ops_cuda.ternary_linear
    n, k, g = 64, 4096, 128
    qw, sc = make_layer(n, k, g, seed=43)
    w = dequantize(qw, sc, g)
    q_k, s_k = ops.prepare_weight(qw, sc, g)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    assert _core.cuda_plan(1, n, k, g, torch.cuda.get_device_properties(0).multi_processor_count)["splits"] > 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(first, stream=side):
        y_first = fn(x, q_k, s_k, n, k, g)
    with torch.cuda.graph(second, stream=side):
        y_second = fn(x, q_k, s_k, n, k, g)
    with torch.cuda.stream(side):
        y_eager = fn(x, q_k, s_k, n, k, g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    ref = reference(x, w, None)
    assert_matches(y_eager, ref, torch.bfloat16, f"{path}: eager before any replay")
    second.replay()
    first.replay()
    torch.cuda.synchronize()
    assert_matches(y_second, ref, torch.bfloat16, f"{path}: second graph")
    assert_matches(y_first, ref, torch.bfloat16, f"{path}: first graph")
