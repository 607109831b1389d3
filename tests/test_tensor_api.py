"""The Python TernaryTensor API: dequantization, ternarization, regrouping, helpers, errors, threads.

References: the NumPy codecs of ``tests/support/format_reference.py`` (from docs/formats.md#summary), torch / ml_dtypes for
float rounding, and torch re-statements of the ternary-qat / BitNet ternarization formulas.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ternary_rs
from support import format_reference as ref
from ternary_rs.core.tensor import TernaryTensor, decode_bytes, encode

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw, g=None):
    rows = draw(st.integers(1, 6))
    group = g or draw(st.sampled_from([32, 64, 128, 256]))
    cols = group * draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    p = rng.dirichlet([1, 1, 1]) * 0.55 + 0.15
    trits = rng.choice(np.array([-1, 0, 1], np.int8), size=(rows, cols), p=p / p.sum())
    scales = (rng.uniform(-3, 3, size=(rows, cols // group)) * 10.0 ** rng.integers(-4, 4)).astype(np.float16)
    return trits, scales, rng


# -- dequantize / trits / torch -----------------------------------------------------------------------

@SETTINGS
@given(tensors())
def test_dequantize_all_dtypes_match_reference(case):
    trits, scales, _ = case
    t = TernaryTensor(ref.pack_canonical(trits), scales)
    want = ref.dequantize(trits, scales)
    f32 = t.dequantize("float32")
    np.testing.assert_array_equal(f32, want)
    np.testing.assert_array_equal(t.dequantize(np.float16).view(np.uint16), want.astype(np.float16).view(np.uint16))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = t.dequantize("bfloat16")
    assert bf.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bf.view(np.uint16), want.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(t.trits(), trits)
    assert t.shape == trits.shape


def test_dequantize_to_torch_dtypes():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    trits = rng.integers(-1, 2, size=(8, 256)).astype(np.int8)
    scales = rng.uniform(0.01, 2, size=(8, 2)).astype(np.float16)
    t = TernaryTensor(ref.pack_canonical(trits), scales)
    want = torch.from_numpy(ref.dequantize(trits, scales))
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        got = t.dequantize(dt)
        assert isinstance(got, torch.Tensor) and got.dtype == dt
        assert torch.equal(got, want.to(dt))
    # Filling caller-provided buffers (torch tensors and NumPy arrays) gives the same values.
    for dt in (torch.float32, torch.bfloat16):
        buf = torch.empty(t.shape, dtype=dt)
        assert t.dequantize(dt, out=buf) is buf and torch.equal(buf, want.to(dt))
    arr = np.empty(t.shape, np.float16)
    np.testing.assert_array_equal(t.dequantize("float16", out=arr), want.numpy().astype(np.float16))
    with pytest.raises(ValueError, match="shape"):
        t.dequantize("float32", out=np.empty((4, 256), np.float32))
    q, s = t.to_torch()
    assert q.dtype == torch.uint8 and s.dtype == torch.float16
    assert q.data_ptr() == t.qweight.ctypes.data  # no copy


def test_construction_validates():
    q = np.full((2, 32), 0x55, np.uint8)
    q[1, 3] = 0b1100_0101  # code 3 at element 32·4 + 3·4 + 3 = 143
    with pytest.raises(ternary_rs.ValidationError, match=r"first at index 143, 1 in total"):
        TernaryTensor(q, np.ones((2, 1), np.float16), name="w")
    with pytest.raises(ternary_rs.ValidationError, match="non-finite"):
        TernaryTensor(np.full((2, 32), 0x55, np.uint8), np.array([[1.0], [np.nan]], np.float16))
    with pytest.raises(ValueError):
        TernaryTensor(np.zeros((2, 32), np.uint8), np.ones((2, 3), np.float16))
    with pytest.raises(TypeError):
        TernaryTensor(np.zeros((2, 32), np.uint8), np.ones((2, 1), np.float32))


# -- pack / unpack helpers --------------------------------------------------------------------------

@SETTINGS
@given(tensors())
def test_pack_unpack_codes(case):
    trits, _, _ = case
    q = ternary_rs.pack_codes(trits)
    np.testing.assert_array_equal(q, ref.pack_canonical(trits))
    np.testing.assert_array_equal(ternary_rs.unpack_codes(q), trits)
    np.testing.assert_array_equal(ternary_rs.pack_codes(trits.astype(np.int64)), q)


def test_pack_codes_rejects_non_trits():
    t = np.zeros((2, 8), np.int8)
    t[1, 5] = 2
    with pytest.raises(ternary_rs.ValidationError, match="first at index 13, 1 in total"):
        ternary_rs.pack_codes(t)
    with pytest.raises(ValueError):
        ternary_rs.pack_codes(np.zeros((2, 6), np.int8))


# -- ternarize ----------------------------------------------------------------------------------------

@st.composite
def dense_weights(draw):
    rows = draw(st.integers(1, 5))
    g = draw(st.sampled_from([32, 64, 128, 256]))
    cols = g * draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    w = (rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-3, 1)).astype(np.float32)
    # Exact ties and zeros: |w| = amax/2 and w = 0 in some groups.
    w[rng.random(w.shape) < 0.05] = 0
    if draw(st.booleans()):
        w[:, 0] = 1.0
        w[:, 1] = 0.5
        w[:, 2] = -0.5
    return w, g


@SETTINGS
@given(dense_weights())
def test_ternarize_absmax_matches_reference_and_torch(case):
    w, g = case
    t = ternary_rs.ternarize(w, g, "absmax")
    trits, scales = ref.ternarize_absmax(w, g)
    np.testing.assert_array_equal(t.trits(), trits)
    np.testing.assert_array_equal(t.scales, scales)
    np.testing.assert_array_equal(t.dequantize("float32"), ref.dequantize(trits, scales))
    torch = pytest.importorskip("torch")
    # ternary-qat's ternarize_weight, restated in torch: a = amax.clamp(1e-8); round(clamp(w/a, -1, 1)).
    wt = torch.from_numpy(w).reshape(w.shape[0], -1, g)
    a = wt.abs().amax(-1, keepdim=True).clamp(min=1e-8)
    tq = torch.round(torch.clamp(wt / a, -1, 1)).reshape(w.shape).to(torch.int8).numpy()
    np.testing.assert_array_equal(t.trits(), tq)


@SETTINGS
@given(dense_weights(), st.booleans())
def test_ternarize_absmean_matches_reference(case, per_tensor):
    w, g = case
    t = ternary_rs.ternarize(w, g, "absmean", per_tensor=per_tensor)
    trits, scales = ref.ternarize_absmean(w, None if per_tensor else g)
    np.testing.assert_array_equal(t.trits(), trits)
    want_scales = np.broadcast_to(scales, t.scales.shape) if per_tensor else scales
    np.testing.assert_array_equal(t.scales, want_scales)


def test_ternarize_accepts_torch_and_bf16():
    torch = pytest.importorskip("torch")
    w = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    t = ternary_rs.ternarize(w, 128)
    trits, scales = ref.ternarize_absmax(w.float().numpy(), 128)
    np.testing.assert_array_equal(t.trits(), trits)
    np.testing.assert_array_equal(t.scales, scales)


def test_ternarize_errors():
    w = np.ones((2, 128), np.float32)
    w[1, 7] = np.nan
    with pytest.raises(ternary_rs.ValidationError, match="first at index 135"):
        ternary_rs.ternarize(w, 128)
    with pytest.raises(ternary_rs.ValidationError, match="fp16 range"):
        ternary_rs.ternarize(np.full((1, 128), 1e6, np.float32), 128)
    with pytest.raises(ValueError, match="method"):
        ternary_rs.ternarize(np.ones((1, 128), np.float32), 128, "median")
    with pytest.raises(ValueError):
        ternary_rs.ternarize(np.ones((1, 100), np.float32), 128)


# -- regrouping --------------------------------------------------------------------------------------

@SETTINGS
@given(tensors(g=128))
def test_repack_rules(case):
    trits, scales, rng = case
    t = TernaryTensor(ref.pack_canonical(trits), scales)
    want = t.dequantize("float32")
    for smaller in (32, 64):
        s = ternary_rs.repack(t, smaller)
        assert s.group_size == smaller and np.array_equal(s.dequantize("float32"), want)
        assert ternary_rs.repack(s, 128).equal(t)  # merging repeated scales is lossless
    if trits.shape[1] % 256:
        return
    pairs = scales.reshape(scales.shape[0], -1, 2)
    nz = (trits.reshape(trits.shape[0], -1, 2, 128) != 0).any(axis=-1)
    mergeable = np.all((pairs[..., 0] == pairs[..., 1]) | ~nz[..., 0] | ~nz[..., 1])
    if mergeable:
        big = ternary_rs.repack(t, 256)
        np.testing.assert_array_equal(big.dequantize("float32"), want)
    else:
        with pytest.raises(ternary_rs.ValidationError, match="requantize"):
            ternary_rs.repack(t, 256)
        with pytest.raises(ternary_rs.ValidationError):
            encode(t, "TQ2_0")
        rq = ternary_rs.repack(t, 256, requantize=True)
        expect = ternary_rs.ternarize(want, 256, "absmax")
        assert rq.equal(expect)
        np.testing.assert_array_equal(encode(t, "TQ2_0", requantize=True), encode(expect, "TQ2_0"))


def test_repack_merge_reports_first_group():
    trits = np.ones((2, 512), np.int8)
    scales = np.ones((2, 4), np.float16)
    scales[1, 3] = 2  # merged group (row 1, second 256-group) = index 3
    t = TernaryTensor(ref.pack_canonical(trits), scales)
    with pytest.raises(ternary_rs.ValidationError, match="first at index 3, 1 in total"):
        ternary_rs.repack(t, 256)
    # g128 → TQ2_0 allowed when pairs share the scale.
    scales[1, 3] = 1
    ok = TernaryTensor(ref.pack_canonical(trits), scales)
    np.testing.assert_array_equal(encode(ok, "TQ2_0"), ref.encode_tq2_0(trits, np.ones((2, 2), np.float16)))


# -- decode errors -----------------------------------------------------------------------------------

def test_decode_errors_name_tensor_and_index():
    rng = np.random.default_rng(3)
    trits = rng.integers(-1, 2, size=(2, 512)).astype(np.int8)
    raw = ref.encode_tq2_0(trits, np.ones((2, 2), np.float16)).copy()
    raw[3 * 66 + 64:3 * 66 + 66] = np.array([np.nan], "<f2").view(np.uint8)
    with pytest.raises(ternary_rs.ValidationError, match=r"blk\.0\.ffn_up\.weight.*first at index 3, 1 in total"):
        decode_bytes("TQ2_0", raw, (2, 512), name="blk.0.ffn_up.weight")
    raw = ref.encode_consecutive(trits, np.ones((2, 4), np.float16), 128).copy()
    raw[34 + 2 + 1] |= 0b1100  # block 1 (row 0, values 128..), byte 1, field 1 → element 133
    raw[3 * 34 + 2] |= 0b11  # block 3 (row 1, values 128..) → element 512 + 128 = 640
    with pytest.raises(ternary_rs.ValidationError, match=r"code 3.*first at index 133, 2 in total"):
        decode_bytes("PQ2_0", raw, (2, 512))
    with pytest.raises(ternary_rs.ValidationError, match="multiple of its block size 256"):
        decode_bytes("TQ2_0", np.zeros(66, np.uint8), (1, 128))
    with pytest.raises(ternary_rs.FormatError, match="needs 54 bytes"):
        decode_bytes("TQ1_0", np.zeros(53, np.uint8), (1, 256))
    with pytest.raises(ternary_rs.UnsupportedTypeError, match="TL2"):
        decode_bytes("TL2", np.zeros(64, np.uint8), (1, 256))
    with pytest.raises(ternary_rs.FormatError, match="tail"):
        decode_bytes("I2_S", np.zeros(32, np.uint8), (1, 128))


def test_dense_not_ternary_reports_first_index():
    w = np.zeros((2, 256), np.float16)
    w[0, :4] = [0.5, -0.5, 0, 0.5]
    w[1, 10] = 0.25
    w[1, 11] = 0.125  # row 1 group 0: {0.25, 0.125} is not {−a, 0, a}
    with pytest.raises(ternary_rs.ValidationError, match=r"up\.weight.*first at index 267, 1 in total"):
        decode_bytes("DENSE", w, w.shape, group_size=128, name="up.weight")
    ok = decode_bytes("DENSE", w[:1], (1, 256), group_size=128)
    np.testing.assert_array_equal(ok.trits()[0, :4], [1, -1, 0, 1])


def test_dense_scale_must_be_exact_in_fp16():
    w = np.zeros((1, 128), np.float32)
    w[0, :3] = [1e-6, -1e-6, 0]  # 1e-6 is not an fp16 value: the scale could not be kept exactly
    with pytest.raises(ternary_rs.ValidationError, match="not exactly representable in fp16"):
        decode_bytes("F32", w, w.shape, group_size=128)
    w[0, 3] = np.inf
    with pytest.raises(ternary_rs.ValidationError, match="non-finite.*first at index 3"):
        decode_bytes("F32", w, w.shape, group_size=128)


def test_mlx_bias_not_minus_scale_is_refused():
    trits = np.zeros((2, 256), np.int8)
    scales = np.ones((2, 2), np.float16)
    biases = -scales
    biases[1, 0] = -0.5
    with pytest.raises(ternary_rs.ValidationError, match=r"not ternary.*group 2.*first at index 2"):
        decode_bytes("MLX", ref.pack_mlx(trits), (2, 256), scales=scales, biases=biases)
    w = ref.pack_mlx(trits)
    w[0, 1] |= np.uint32(3) << np.uint32(4)  # element 16 + 2 = 18
    with pytest.raises(ternary_rs.ValidationError, match="first at index 18"):
        decode_bytes("MLX", w, (2, 256), scales=scales, biases=-scales)


def test_bitnet_shape_errors():
    with pytest.raises(ternary_rs.ValidationError, match="multiple of 4"):
        decode_bytes("BITNET", np.zeros((1, 32), np.uint8), (6, 32), weight_scale=[1.0])
    with pytest.raises(ternary_rs.FormatError):
        decode_bytes("BITNET", np.zeros((1, 32), np.uint8), (8, 32), weight_scale=[1.0])
    with pytest.raises(ValueError, match="linear_class"):
        decode_bytes("BITNET", np.zeros((1, 32), np.uint8), (4, 32), weight_scale=[1.0], linear_class="x")


# -- threads -----------------------------------------------------------------------------------------

def test_thread_count_is_respected_and_results_identical():
    rng = np.random.default_rng(5)
    trits = rng.integers(-1, 2, size=(64, 1024)).astype(np.int8)
    raw = ref.encode_ptq1_0(trits, np.full((64, 8), 0.25, np.float16))
    before = ternary_rs.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            ternary_rs.set_num_threads(n)
            assert ternary_rs.get_num_threads() == n
            results.append(decode_bytes("PTQ1_0", raw, trits.shape).dequantize("bfloat16").view(np.uint16))
        for r in results[1:]:
            np.testing.assert_array_equal(r, results[0])
    finally:
        ternary_rs.set_num_threads(before)


def test_heavy_calls_release_the_gil():
    """With a switch interval far longer than the test, the worker thread keeps the GIL unless a call
    releases it: the main thread then runs before the worker's decoding ends only if the Rust calls
    released the GIL (a call that held it would let the main thread in only when the worker exits)."""
    import sys
    import threading
    import time

    rng = np.random.default_rng(6)
    trits = rng.integers(-1, 2, size=(4096, 4096)).astype(np.int8)
    t = TernaryTensor(ternary_rs.pack_codes(trits), np.full((4096, 32), 0.5, np.float16))
    raw = encode(t, "PTQ1_0")
    started = threading.Event()
    times: dict[str, float] = {}

    core = ternary_rs._core
    args = t._args()
    out = np.empty(trits.shape, np.uint16)

    def worker():  # only extension calls: NumPy code could release the GIL by itself
        started.set()
        for _ in range(3):
            core.decode_gguf("PTQ1_0", raw, *trits.shape)
            core.dequantize_into(*args, out, dtype="bfloat16")
        times["end"] = time.perf_counter()

    old = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        th = threading.Thread(target=worker)
        th.start()
        started.wait()
        times["main"] = time.perf_counter()
        th.join()
    finally:
        sys.setswitchinterval(old)
    assert times["main"] < times["end"]



# -- our own checkpoints ------------------------------------------------------------------------------

def test_decode_reads_our_canonical_pairs_against_safetensors(tmp_path):
    """``decode(f, "<prefix>.qweight")``, the bare prefix and ``<prefix>.weight`` give the checkpoint's own
    qweight/scales (read independently with the ``safetensors`` package), zero-copy and validated."""
    import json

    from safetensors.numpy import load_file

    from ternary_rs.demo import write_demo_gguf

    src = tmp_path / "demo.gguf"
    write_demo_gguf(src)
    out = ternary_rs.convert(src, tmp_path / "out", progress=False, use_transformers=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = "model.layers.1.self_attn.o_proj"
    theirs = load_file(out / index[f"{prefix}.qweight"])
    with ternary_rs.open(out) as f:
        for name in (f"{prefix}.qweight", prefix, f"{prefix}.weight"):
            t = ternary_rs.decode(f, name)
            assert t.name == prefix and t.group_size == 128
            np.testing.assert_array_equal(t.qweight, theirs[f"{prefix}.qweight"])
            np.testing.assert_array_equal(t.scales, theirs[f"{prefix}.scales"])
        g64 = ternary_rs.decode(f, prefix, group_size=64)
        np.testing.assert_array_equal(g64.dequantize("float32"), t.dequantize("float32"))
        assert g64.scales.shape[1] == 2 * t.scales.shape[1]
        with pytest.raises(KeyError, match="model.norm"):
            ternary_rs.decode(f, "model.norm")
    # a corrupted pair is refused by the same validation as any other input
    shard = out / index[f"{prefix}.qweight"]
    tensors = load_file(shard)
    tensors[f"{prefix}.qweight"][2, 5] = 0xC0  # code 3 in lane 3
    from safetensors.numpy import save_file

    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ternary_rs.ValidationError, match="code 3") as err:
        ternary_rs.decode(out, prefix)
    k = t.shape[1]
    assert (err.value.tensor, err.value.first_index, err.value.count) == (prefix, 2 * k + 5 * 4 + 3, 1)
