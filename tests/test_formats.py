"""Bit-exact codecs: every format against an independent reference.

* TQ1_0 / TQ2_0: the PyPI ``gguf`` package's ``gguf.quants.quantize/dequantize`` (both directions).
* Every format: the plain NumPy codecs of ``tests/support/format_reference.py`` (written from docs/formats.md#summary).
* The worked byte examples of docs/formats.md#worked-examples (running trits [+1,0,−1,−1,0,+1,+1,0], d = 0.5) as fixed vectors.
* Round trips canonical → format → canonical and format → canonical → other format.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ternary_rs
from support import format_reference as ref
from ternary_rs.core.tensor import TernaryTensor, decode_bytes, encode

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

EXAMPLE = np.array([1, 0, -1, -1, 0, 1, 1, 0], np.int8)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# format → (block values, reference encoder, reference decoder)
BLOCK_REFS = {
    "TQ2_0": (256, ref.encode_tq2_0, ref.decode_tq2_0),
    "TQ1_0": (256, ref.encode_tq1_0, ref.decode_tq1_0),
    "Q2_0": (64, lambda t, s: ref.encode_consecutive(t, s, 64), lambda d, sh: ref.decode_consecutive(d, sh, 64)),
    "PQ2_0": (128, lambda t, s: ref.encode_consecutive(t, s, 128), lambda d, sh: ref.decode_consecutive(d, sh, 128)),
    "Q2_0_G128": (128, lambda t, s: ref.encode_consecutive(t, s, 128),
                  lambda d, sh: ref.decode_consecutive(d, sh, 128)),
    "PTQ1_0": (128, ref.encode_ptq1_0, ref.decode_ptq1_0),
}


# -- strategies ------------------------------------------------------------------------------------

@st.composite
def ternary_matrix(draw, k_multiple=256, max_rows=6, max_blocks=3, rows_multiple=1):
    """Random trits with all three values frequent (random mix, each value ≥ 15 %)."""
    rows = draw(st.integers(1, max_rows)) * rows_multiple
    cols = draw(st.integers(1, max_blocks)) * k_multiple
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    p = rng.dirichlet([1, 1, 1]) * 0.55 + 0.15
    trits = rng.choice(np.array([-1, 0, 1], np.int8), size=(rows, cols), p=p / p.sum())
    return trits, rng


def random_scales(rng, shape, positive=False):
    """Finite fp16 scales spanning magnitudes, negatives and exact zeros included unless positive."""
    mag = np.exp(rng.uniform(np.log(1e-4), np.log(60000.0), size=shape))
    s = mag if positive else mag * rng.choice([-1.0, 1.0], size=shape)
    s = s.astype(np.float16)
    if not positive:
        s[rng.random(shape) < 0.05] = 0
    assert np.isfinite(s).all()
    return s


def canonical(trits, scales) -> TernaryTensor:
    return TernaryTensor(ref.pack_canonical(trits), scales)


def assert_tensor(t: TernaryTensor, trits, scales):
    np.testing.assert_array_equal(t.trits(), trits)
    np.testing.assert_array_equal(t.scales.view(np.uint16), np.asarray(scales, np.float16).view(np.uint16))
    np.testing.assert_array_equal(t.qweight, ref.pack_canonical(trits))


# -- GGUF block formats against the NumPy reference -------------------------------------------------

@pytest.mark.parametrize("fmt", list(BLOCK_REFS))
@SETTINGS
@given(data=st.data())
def test_block_format_matches_reference_both_ways(fmt, data):
    block, ref_encode, ref_decode = BLOCK_REFS[fmt]
    trits, rng = data.draw(ternary_matrix(k_multiple=256))
    scales = random_scales(rng, (trits.shape[0], trits.shape[1] // block))
    want = ref_encode(trits, scales)
    got = encode(canonical(trits, scales), fmt)
    np.testing.assert_array_equal(got, want)
    assert got.size == ternary_rs._core.gguf_tensor_bytes(fmt, *trits.shape)
    t = decode_bytes(fmt, want, trits.shape)
    assert t.group_size == block
    assert_tensor(t, trits, scales)


@pytest.mark.parametrize("fmt", ["TQ1_0", "PTQ1_0"])
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4))
def test_base3_arbitrary_bytes_decode_like_reference(fmt, seed, rows):
    """Bytes no encoder writes (non-canonical base-3 values) decode exactly like the reference."""
    block, _, ref_decode = BLOCK_REFS[fmt]
    size = 54 if fmt == "TQ1_0" else 28
    rng = np.random.default_rng(seed)
    cols = 2 * 256
    data = rng.integers(0, 256, size=rows * cols // block * size, dtype=np.uint8)
    blocks = data.reshape(-1, size)
    blocks[:, size - 2:] = random_scales(rng, (blocks.shape[0], 1), positive=True).view(np.uint8)
    codes, d = ref_decode(data, (rows, cols))
    t = decode_bytes(fmt, data, (rows, cols))
    np.testing.assert_array_equal(t.trits(), codes.astype(np.int8) - 1)
    np.testing.assert_array_equal(t.scales, d)


# -- TQ1_0 / TQ2_0 against gguf-py ---------------------------------------------------------------

@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4))
def test_tq1_0_arbitrary_bytes_decode_like_gguf_py(seed, rows):
    """Any TQ1_0 bytes (also ones no encoder writes) dequantize exactly as gguf-py's dequantizer."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, 2 * 54), dtype=np.uint8)
    blocks = data.reshape(-1, 54)
    blocks[:, 52:] = random_scales(rng, (blocks.shape[0], 1)).view(np.uint8)
    want = gguf_dequantize(data, QT.TQ1_0)
    np.testing.assert_array_equal(decode_bytes("TQ1_0", data, (rows, 512)).dequantize("float32"), want)


@pytest.mark.parametrize("fmt", ["TQ1_0", "TQ2_0"])
@SETTINGS
@given(data=st.data())
def test_gguf_quantized_bytes_decode_to_gguf_values(fmt, data):
    """gguf-py quantizes arbitrary floats; our decode dequantizes to exactly gguf-py's floats."""
    trits, rng = data.draw(ternary_matrix(k_multiple=256))
    w = rng.standard_normal(trits.shape).astype(np.float32) * np.float32(rng.uniform(0.01, 3))
    w[rng.random(w.shape) < 0.2] = 0
    raw = gguf_quantize(w, QT[fmt])
    want = gguf_dequantize(raw, QT[fmt])
    t = decode_bytes(fmt, raw.reshape(-1), w.shape)
    np.testing.assert_array_equal(t.dequantize("float32"), want)


@pytest.mark.parametrize("fmt", ["TQ1_0", "TQ2_0"])
@SETTINGS
@given(data=st.data())
def test_our_encode_of_ternarized_tensor_equals_gguf_quantize(fmt, data):
    """ternarize(absmax, g256) → encode gives the bytes gguf-py's quantize writes for those weights."""
    trits, rng = data.draw(ternary_matrix(k_multiple=256))
    w = rng.standard_normal(trits.shape).astype(np.float32) * np.float32(rng.uniform(1e-3, 10))
    t = ternary_rs.ternarize(w, 256, "absmax")
    dense = t.dequantize("float32")
    want = gguf_quantize(dense, QT[fmt]).reshape(-1)
    np.testing.assert_array_equal(encode(t, fmt), want)
    # And straight from the raw weights, wherever no value sits exactly on a rounding tie
    # (gguf-py rounds x·(1/d) half away from zero, ternary-qat rounds x/d half to even).
    direct = gguf_quantize(w, QT[fmt]).reshape(-1)
    size = 66 if fmt == "TQ2_0" else 54
    blocks = w.reshape(-1, 256).astype(np.float64)
    ratio = np.abs(blocks) / np.abs(blocks).max(axis=1, keepdims=True)
    clear = ~(np.abs(ratio - 0.5) < 1e-6).any(axis=1)  # blocks with no value within ~16 ulp of a tie
    np.testing.assert_array_equal(encode(t, fmt).reshape(-1, size)[clear], direct.reshape(-1, size)[clear])


def test_gguf_tie_convention_is_documented_difference():
    """At an exact tie |w| = amax/2 gguf-py rounds away from zero, ternarize (torch.round) to even."""
    w = np.zeros((1, 256), np.float32)
    w[0, 0], w[0, 1] = 1.0, 0.5
    t = ternary_rs.ternarize(w, 256, "absmax")
    assert t.trits()[0, 1] == 0
    g = gguf_dequantize(gguf_quantize(w, QT.TQ2_0), QT.TQ2_0)
    assert g[0, 1] == 1.0


# -- other formats against the NumPy reference ------------------------------------------------------

@SETTINGS
@given(data=st.data())
def test_q1_0_binary(data):
    trits, rng = data.draw(ternary_matrix(k_multiple=128))
    signs = np.where(trits >= 0, 1, -1).astype(np.int8)
    scales = random_scales(rng, (signs.shape[0], signs.shape[1] // 128))
    raw = ref.encode_q1_0(signs, scales)
    t = decode_bytes("Q1_0", raw, signs.shape)
    assert_tensor(t, signs, scales)
    assert not (t.trits() == 0).any()
    np.testing.assert_array_equal(encode(t, "Q1_0"), raw)
    with pytest.raises(ternary_rs.ValidationError, match="zero"):
        encode(canonical(np.zeros_like(signs), scales), "Q1_0")


@SETTINGS
@given(data=st.data())
def test_i2_s(data):
    trits, rng = data.draw(ternary_matrix(k_multiple=128))
    scale = np.float32(rng.uniform(0.001, 3))
    raw = ref.encode_i2_s(trits, scale)
    t = decode_bytes("I2_S", raw, trits.shape, group_size=128)
    codes, s = ref.decode_i2_s(raw, trits.shape)
    np.testing.assert_array_equal(t.trits(), codes.astype(np.int8) - 1)
    np.testing.assert_array_equal(t.scales, np.full(t.scales.shape, np.float16(s)))
    # Re-encoding writes the fp16-rounded scale as f32.
    back = ref.encode_i2_s(trits, np.float32(np.float16(scale)))
    np.testing.assert_array_equal(encode(t, "I2_S"), back)


@pytest.mark.parametrize("linear_class", ["bitlinear", "autobitlinear"])
@SETTINGS
@given(data=st.data())
def test_bitnet(linear_class, data):
    trits, rng = data.draw(ternary_matrix(k_multiple=32, max_blocks=6, rows_multiple=4))
    packed = ref.pack_bitnet(trits)
    np.testing.assert_array_equal(ref.unpack_bitnet(packed), trits)  # the reference is self-consistent
    ws = np.float32(rng.uniform(0.01, 50))
    t = decode_bytes("BITNET", packed, trits.shape, weight_scale=np.array([ws]), linear_class=linear_class)
    want_scale = ref.bitnet_scale(ws, linear_class)
    np.testing.assert_array_equal(t.trits(), trits)
    assert (t.scales == want_scale).all()
    np.testing.assert_array_equal(t.dequantize("float32"), trits.astype(np.float32) * np.float32(want_scale))
    out = encode(t, "BITNET", linear_class=linear_class)
    np.testing.assert_array_equal(out["weight"], packed)
    again = decode_bytes("BITNET", out["weight"], trits.shape, weight_scale=out["weight_scale"],
                         linear_class=linear_class)
    assert again.equal(t)


@SETTINGS
@given(data=st.data(), g=st.sampled_from([32, 64, 128]))
def test_mlx_zero_copy(data, g):
    trits, rng = data.draw(ternary_matrix(k_multiple=128))
    scales = random_scales(rng, (trits.shape[0], trits.shape[1] // g), positive=True)
    weight = ref.pack_mlx(trits)
    biases = -scales
    t = decode_bytes("MLX", weight, trits.shape, scales=scales, biases=biases)
    assert t.group_size == g
    assert np.shares_memory(t.qweight, weight) and np.shares_memory(t.scales, scales)
    np.testing.assert_array_equal(t.trits(), trits)
    np.testing.assert_array_equal(t.dequantize("float32"), ref.dequantize_mlx(weight, scales, biases))
    out = encode(t, "MLX")
    np.testing.assert_array_equal(out["weight"], weight)
    np.testing.assert_array_equal(out["biases"], biases)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@SETTINGS
@given(data=st.data(), g=st.sampled_from([32, 64, 128, 256]))
def test_dense_unpacked_recovery(dtype, data, g):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    np_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    trits, rng = data.draw(ternary_matrix(k_multiple=256))
    scales = random_scales(rng, (trits.shape[0], trits.shape[1] // g), positive=True)
    if dtype == "bfloat16":  # scales must survive bf16 to be recoverable exactly as fp16
        scales = scales.astype(ml_dtypes.bfloat16).astype(np.float16)
    dense = ref.dequantize(trits, scales).astype(np_dtype)
    t = decode_bytes("DENSE", dense, dense.shape, group_size=g)
    # Groups whose trits are all zero have max|group| = 0: their scale is recovered as 0.
    nz = (trits.reshape(trits.shape[0], -1, g) != 0).any(axis=-1)
    np.testing.assert_array_equal(t.trits(), trits)
    np.testing.assert_array_equal(t.scales, np.where(nz, scales, np.float16(0)))
    np.testing.assert_array_equal(t.dequantize(dtype).astype(np.float32), dense.astype(np.float32))


# -- round trips through every format ---------------------------------------------------------------

ALL_GGUF = ["TQ1_0", "TQ2_0", "Q2_0", "Q2_0_G128", "PQ2_0", "PTQ1_0", "I2_S"]


@SETTINGS
@given(data=st.data())
def test_every_format_to_every_format(data):
    """Per-tensor scale (so every format can hold it): format A → canonical → format B → canonical
    gives the same tensor, and each encoding decodes to the same dequantized values."""
    trits, rng = data.draw(ternary_matrix(k_multiple=256, max_rows=3, rows_multiple=4))
    scale = random_scales(rng, (1, 1), positive=True)[0, 0]
    base = canonical(trits, np.full((trits.shape[0], trits.shape[1] // 256), scale, np.float16))
    want = base.dequantize("float32")
    for a in ALL_GGUF:
        ta = decode_bytes(a, encode(base, a), trits.shape, group_size=256)
        assert ta.equal(base), a
        for b in ALL_GGUF:
            tb = decode_bytes(b, encode(ta, b), trits.shape)
            np.testing.assert_array_equal(tb.dequantize("float32"), want, err_msg=f"{a}->{b}")
    bn = encode(base, "BITNET")
    tb = decode_bytes("BITNET", bn["weight"], trits.shape, weight_scale=bn["weight_scale"], group_size=256)
    assert tb.equal(base)
    mx = encode(base, "MLX")
    assert decode_bytes("MLX", mx["weight"], trits.shape, scales=mx["scales"], biases=mx["biases"]).equal(base)


# -- worked examples (docs/formats.md#worked-examples) ----------------------------------------------

def _example(block: int, rows: int = 1) -> tuple[np.ndarray, np.ndarray]:
    trits = np.zeros((rows, block), np.int8)
    trits[0, :8] = EXAMPLE
    return trits, np.full((rows, 1), 0.5, np.float16)


@pytest.mark.parametrize("fmt,block,expected,at", [
    ("PQ2_0", 128, "00 38 06 69 55 55", 0),
    ("Q2_0_G128", 128, "00 38 06 69 55 55", 0),
    ("Q2_0", 64, "00 38 06 69 55 55", 0),
    ("PTQ1_0", 128, "d5 80 2b 2b 80 d5 d5 80" + " 80" * 16 + " 7f 7f 00 38", 0),
    ("TQ1_0", 256, "d5 80 2b 2b 80 d5 d5 80", 0),
    ("TQ2_0", 256, "56 55 54 54 55 56 56 55", 0),
])
def test_formats_md_examples(fmt, block, expected, at):
    trits, scales = _example(block)
    raw = encode(canonical(trits, scales), fmt)
    want = bytes.fromhex(expected)
    assert raw[at:at + len(want)].tobytes() == want
    assert decode_bytes(fmt, raw, trits.shape).equal(canonical(trits, scales))


def test_formats_md_examples_tails():
    trits, scales = _example(256)
    tq1 = encode(canonical(trits, scales), "TQ1_0")
    assert tq1[48:54].tobytes() == bytes.fromhex("7f 7f 7f 7f 00 38")
    tq2 = encode(canonical(trits, scales), "TQ2_0")
    assert tq2[64:66].tobytes() == bytes.fromhex("00 38")
    pq = encode(canonical(*_example(128)), "PQ2_0")
    assert len(pq) == 34 and (pq[4:] == 0x55).all()
    q2 = encode(canonical(*_example(64)), "Q2_0")
    assert len(q2) == 18


def test_formats_md_q1_0_example():
    signs = np.ones((1, 128), np.int8)
    signs[0, :8] = [1, -1, -1, 1, 1, 1, -1, 1]
    raw = encode(TernaryTensor(ref.pack_canonical(signs), np.full((1, 1), 0.5, np.float16)), "Q1_0")
    assert raw[:3].tobytes() == bytes.fromhex("00 38 b9")
    np.testing.assert_array_equal(decode_bytes("Q1_0", raw, (1, 128)).trits(), signs)


def test_formats_md_i2_s_example():
    trits, scales = _example(128)
    raw = encode(canonical(trits, scales), "I2_S")
    assert raw[:8].tobytes() == bytes.fromhex("95 55 15 15 55 95 95 55")
    assert raw.size == 128 // 4 + 32 and raw[32:36].view("<f4")[0] == 0.5
    assert decode_bytes("I2_S", raw, (1, 128), group_size=128).equal(canonical(trits, scales))


def test_formats_md_bitnet_example():
    w = np.zeros((8, 32), np.int8)
    w[:, 0] = EXAMPLE
    t = canonical(w, np.full((8, 1), 0.5, np.float16))
    out = encode(t, "BITNET")
    assert out["weight"][:, 0].tobytes() == bytes.fromhex("92 61")
    assert out["weight_scale"][0] == 2.0  # bitlinear stores the reciprocal
    assert encode(t, "BITNET", linear_class="autobitlinear")["weight_scale"][0] == 0.5


def test_formats_md_mlx_example():
    trits, scales = _example(128)
    out = encode(canonical(trits, scales), "MLX")
    assert int(out["weight"][0, 0]) & 0xFFFF == 0x6906
