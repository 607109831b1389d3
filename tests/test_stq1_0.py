"""STQ1_0 (GGUF type 43, llama.cpp PR #22836; Tencent Hy-MT2 1.8B / Hy4-preview).

Two layers:

* the NumPy reference (``format_reference.decode_stq1_0`` / ``encode_stq1_0``) against the upstream
  facts: the codebook table of ``ggml/src/ggml-common.h`` (sjl623/llama.cpp, branch ``STQ_0``, commit
  4ea7990d1833671c05ed5b98fca60df79272943d) and the ground-truth blocks of vllm-project/vllm-gguf-plugin
  ``tests/test_stq1_0.py`` (commit 527b32876c57b4c45f697bc4c89a680a5431c4d9), whose reference codec
  ``vllm_gguf_plugin/gguf_stq.py`` (commit bf83c94cecffa3f391b132ed6d6c62aa6ac71a3a) fixes the stride-16
  lane layout — and, when that plugin is importable, against its ``dequantize_stq1_0`` itself;
* the Rust core (through the extension) against the reference on random blocks, encode refusals, and a
  GGUF file with an STQ1_0 tensor opened, listed and decoded.

Phase 1 put the codec in the Rust core only. The extension reaches it once ``repack::decode_gguf`` /
``encode_gguf`` dispatch ``Format::Stq1_0`` (phase 2) and the extension is rebuilt; until then the
Rust-side tests skip, saying which piece is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import format_reference as ref
import ternary_rs
from ternary_rs import _core
from ternary_rs.tensor import _from_core

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ggml-common.h, PR #22836: stq1_0_codebook[32], index = (sign << 4) | slot.
UPSTREAM_CODEBOOK = [
    0xA9, 0x89, 0x29, 0x09, 0xA6, 0x86, 0x26, 0x06, 0x9A, 0x92, 0x1A, 0x12, 0x6A, 0x62, 0x4A, 0x42,
    0x01, 0x21, 0x81, 0xA1, 0x04, 0x24, 0x84, 0xA4, 0x10, 0x18, 0x90, 0x98, 0x40, 0x48, 0x60, 0x68,
]


def _f16_bytes(x: float) -> np.ndarray:
    return np.array([x], np.float16).view(np.uint8)


def random_blocks(rng, n_blocks: int) -> np.ndarray:
    """Any qs/sign bytes (every one decodes) with finite fp16 scales, zeros and negatives included."""
    data = rng.integers(0, 256, size=(n_blocks, 42), dtype=np.uint8)
    mag = np.exp(rng.uniform(np.log(1e-4), np.log(60000.0), size=n_blocks))
    d = (mag * rng.choice([-1.0, 1.0], size=n_blocks)).astype(np.float16)
    d[rng.random(n_blocks) < 0.1] = 0
    data[:, 40:42] = d.view(np.uint8).reshape(-1, 2)
    return data.reshape(-1)


def representable_trits(rng, rows: int, cols: int) -> np.ndarray:
    """One zero per group (lanes at stride 16 in 64-value chunks), independent signs elsewhere."""
    t = rng.choice(np.array([-1, 1], np.int8), size=(rows, cols))
    zero = rng.integers(0, 4, size=(rows, cols // 64, 16))
    r, c, g = np.indices(zero.shape)
    t[r, c * 64 + g + 16 * zero] = 0
    return t


# -- the reference against the upstream facts ----------------------------------------------------------

def test_reference_codebook_is_the_upstream_table():
    assert ref.stq1_0_codebook().tolist() == UPSTREAM_CODEBOOK


def test_reference_decodes_upstream_ground_truth_blocks():
    """vllm-gguf-plugin's hand-crafted blocks: zero qs/sign with d = 1 is CODEBOOK[0] = (0, +1, +1, +1)
    in every group, so the zeros sit where value % 64 < 16; setting sign bit 0 flips group 0's lanes
    at values 16, 32, 48."""
    blk = np.zeros(42, np.uint8)
    blk[40:42] = _f16_bytes(1.0)
    codes, d = ref.decode_stq1_0(blk, (1, 256))
    want = np.where(np.arange(256) % 64 < 16, 1, 2).astype(np.uint8)
    np.testing.assert_array_equal(codes[0], want)
    assert d[0, 0] == 1.0
    blk[32] = 0x01
    want[[16, 32, 48]] = 0
    np.testing.assert_array_equal(ref.decode_stq1_0(blk, (1, 256))[0][0], want)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), blocks=st.integers(1, 3))
def test_reference_round_trips_representable_tensors(seed, rows, blocks):
    rng = np.random.default_rng(seed)
    trits = representable_trits(rng, rows, 256 * blocks)
    scales = rng.uniform(-2, 2, size=(rows, blocks)).astype(np.float16)
    data = ref.encode_stq1_0(trits, scales)
    assert data.size == rows * blocks * 42
    codes, d = ref.decode_stq1_0(data, trits.shape)
    np.testing.assert_array_equal(codes.astype(np.int8) - 1, trits)
    np.testing.assert_array_equal(d.view(np.uint16), scales.view(np.uint16))


def test_reference_agrees_with_vllm_gguf_plugin_codec():
    """The plugin's own torch codec, where it is installed (not vendored here)."""
    torch = pytest.importorskip("torch")
    gguf_stq = pytest.importorskip("vllm_gguf_plugin.gguf_stq")
    rng = np.random.default_rng(7)
    data = random_blocks(rng, 12)
    codes, d = ref.decode_stq1_0(data, (3, 1024))
    want = (codes.astype(np.float32) - 1) * np.repeat(d.astype(np.float32), 256, axis=1)
    got = gguf_stq.dequantize_stq1_0(torch.from_numpy(data.reshape(3, 4 * 42))).numpy()
    np.testing.assert_array_equal(got, want)


# -- the Rust core against the reference ---------------------------------------------------------------

def _probe(what: str) -> str | None:
    """None when the extension runs STQ1_0 `what` ("decode" / "encode"), else why it does not."""
    blk = np.zeros(42, np.uint8)
    blk[40:42] = _f16_bytes(1.0)
    try:
        if what == "decode":
            _core.decode_gguf("STQ1_0", blk, 1, 256, None, False, tensor="probe")
        else:
            q, s, g = _core.decode_gguf("STQ1_0", blk, 1, 256, None, False, tensor="probe")
            _core.encode_gguf("STQ1_0", q, s, 1, 256, g, False, tensor="probe")
    except Exception as e:  # noqa: BLE001 — only the "not wired up yet" messages skip, below
        msg = str(e)
        if "STQ1_0" in msg and ("not a GGUF tensor type" in msg or "unknown ternary format" in msg):
            return f"phase 2: the extension does not {what} STQ1_0 yet ({msg})"
        if what == "encode":
            return None
        raise
    return None


needs_decode = pytest.mark.skipif(_probe("decode") is not None, reason=str(_probe("decode")))
needs_encode = pytest.mark.skipif(_probe("encode") is not None, reason=str(_probe("encode")))


def rust_decode(data: np.ndarray, shape, name: str = "w"):
    return _from_core(_core.decode_gguf("STQ1_0", data, *shape, None, False, tensor=name), name)


@needs_decode
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 7), blocks=st.integers(1, 3))
def test_rust_decode_of_random_blocks_matches_reference(seed, rows, blocks):
    rng = np.random.default_rng(seed)
    shape = (rows, 256 * blocks)
    data = random_blocks(rng, rows * blocks)
    codes, d = ref.decode_stq1_0(data, shape)
    t = rust_decode(data, shape)
    assert t.group_size == 256
    np.testing.assert_array_equal(t.trits(), codes.astype(np.int8) - 1)
    np.testing.assert_array_equal(t.scales.view(np.uint16), d.view(np.uint16))
    want = (codes.astype(np.float32) - 1) * np.repeat(d.astype(np.float32), 256, axis=1)
    np.testing.assert_array_equal(t.dequantize("float32"), want)


@needs_decode
def test_rust_decode_refuses_non_finite_scales_by_block():
    rng = np.random.default_rng(3)
    data = random_blocks(rng, 6).reshape(6, 42)
    data[4, 40:42] = _f16_bytes(np.inf)
    with pytest.raises(ternary_rs.ValidationError, match=r"'blk\.2\.ffn_up_exps'.*STQ1_0.*first at index 4, 1 in total"):
        rust_decode(data.reshape(-1), (2, 768), name="blk.2.ffn_up_exps")
    data[4, 40:42] = _f16_bytes(np.nan)
    with pytest.raises(ternary_rs.ValidationError, match="non-finite"):
        rust_decode(data.reshape(-1), (2, 768))
    with pytest.raises(ternary_rs.TernaryError, match="STQ1_0"):
        rust_decode(data.reshape(-1)[:-1], (2, 768))


@needs_encode
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5), blocks=st.integers(1, 3))
def test_rust_encode_matches_reference(seed, rows, blocks):
    rng = np.random.default_rng(seed)
    trits = representable_trits(rng, rows, 256 * blocks)
    scales = rng.uniform(-3, 3, size=(rows, blocks)).astype(np.float16)
    want = ref.encode_stq1_0(trits, scales)
    q = ref.pack_canonical(trits)
    got = _core.encode_gguf("STQ1_0", q, scales.view(np.uint16), rows, 256 * blocks, 256, False, tensor="w")
    np.testing.assert_array_equal(got, want)


@needs_encode
def test_rust_encode_refuses_unrepresentable_groups():
    rng = np.random.default_rng(11)
    trits = representable_trits(rng, 2, 512)
    trits[1, 256 + 64 + 5 + 16 * np.arange(4)] = 1  # row 1, group 64 + 21: no zero
    q = ref.pack_canonical(trits)
    s = np.ones((2, 2), np.float16).view(np.uint16)
    with pytest.raises(ternary_rs.ValidationError, match=r"'blk\.0\.ffn_gate_exps'.*row 1 group 85"):
        _core.encode_gguf("STQ1_0", q, s, 2, 512, 256, False, tensor="blk.0.ffn_gate_exps")


def _write_gguf(path, name: str, shape, data: np.ndarray) -> None:
    w = ternary_rs.io.GGUFWriter(path)
    w.add_metadata("general.architecture", "hunyuan")
    w.add_tensor_info(name, shape, 43, data.size)
    w.write_tensor_data(name, data)
    w.close()


def test_gguf_file_with_stq1_0_opens_and_lists(tmp_path):
    rng = np.random.default_rng(5)
    shape = (3, 512)
    data = random_blocks(rng, 6)
    path = tmp_path / "stq.gguf"
    try:
        _write_gguf(path, "blk.0.ffn_up.weight", shape, data)
        f = ternary_rs.open(path)
    except ternary_rs.UnsupportedTypeError as e:
        pytest.skip(f"extension predates GgmlType::STQ1_0 (rebuild with scripts/build.sh): {e}")
    info = f.tensors["blk.0.ffn_up.weight"]
    assert (info.type, info.type_id, info.shape, info.nbytes) == ("STQ1_0", 43, shape, 252)
    np.testing.assert_array_equal(f.raw("blk.0.ffn_up.weight"), data)
    if _probe("decode") is None:
        t = rust_decode(np.asarray(f.raw("blk.0.ffn_up.weight")), shape, "blk.0.ffn_up.weight")
        codes, d = ref.decode_stq1_0(data, shape)
        np.testing.assert_array_equal(t.trits(), codes.astype(np.int8) - 1)
        np.testing.assert_array_equal(t.scales.view(np.uint16), d.view(np.uint16))


@pytest.mark.skipif("STQ1_0" not in ternary_rs.tensor.GGUF_FORMATS,
                    reason="phase 2: STQ1_0 is not in ternary_rs.tensor.GGUF_FORMATS yet")
def test_ternary_rs_decode_of_a_gguf_tensor(tmp_path):
    rng = np.random.default_rng(6)
    shape = (2, 256)
    data = random_blocks(rng, 2)
    path = tmp_path / "stq.gguf"
    _write_gguf(path, "w", shape, data)
    t = ternary_rs.decode(ternary_rs.open(path), "w")
    codes, d = ref.decode_stq1_0(data, shape)
    np.testing.assert_array_equal(t.trits(), codes.astype(np.int8) - 1)
    np.testing.assert_array_equal(t.scales.view(np.uint16), d.view(np.uint16))
    np.testing.assert_array_equal(ternary_rs.decode_bytes("STQ1_0", data, shape).qweight, t.qweight)
