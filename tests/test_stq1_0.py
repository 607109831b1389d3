"""STQ1_0 (GGUF type 43, llama.cpp PR #22836; Tencent Hy-MT2 1.8B / Hy4-preview).

Three layers:

* the NumPy reference (``format_reference.decode_stq1_0`` / ``encode_stq1_0``) against the upstream
  facts: the codebook table of ``ggml/src/ggml-common.h`` (sjl623/llama.cpp, branch ``STQ_0``, commit
  4ea7990d1833671c05ed5b98fca60df79272943d) and the ground-truth blocks of vllm-project/vllm-gguf-plugin
  ``tests/test_stq1_0.py`` (commit 527b32876c57b4c45f697bc4c89a680a5431c4d9), whose reference codec
  ``vllm_gguf_plugin/gguf_stq.py`` (commit bf83c94cecffa3f391b132ed6d6c62aa6ac71a3a) fixes the stride-16
  lane layout — and, when that plugin is importable, against its ``dequantize_stq1_0`` itself;
* the Rust core (through the extension) against the reference on random blocks, encode refusals, the
  requantizer against a NumPy port of llama.cpp's ``quantize_row_stq1_0_ref`` (ggml-quants.c of the PR branch,
  sjl623/llama.cpp commit 9b898c1f19b2b0da6db28c99ecea74017892c013, lanes at the shipped stride-16 places),
  and a GGUF file with an STQ1_0 tensor opened, listed and decoded;
* the command line on a small qwen3 STQ1_0 GGUF: inspect / verify / plan, convert to a checkpoint and back
  bit for bit, the refusal of unrepresentable weights and ``--requantize``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ternary_rs
from support import format_reference as ref
from ternary_rs import _core
from ternary_rs.core.tensor import _from_core
from ternary_rs.sinks.writers import GGUFWriter

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

def rust_decode(data: np.ndarray, shape, name: str = "w"):
    return _from_core(_core.decode_gguf("STQ1_0", data, *shape, None, False, tensor=name), name)


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


def test_rust_encode_refuses_unrepresentable_groups():
    rng = np.random.default_rng(11)
    trits = representable_trits(rng, 2, 512)
    trits[1, 256 + 64 + 5 + 16 * np.arange(4)] = 1  # row 1, group 64 + 21: no zero
    q = ref.pack_canonical(trits)
    s = np.ones((2, 2), np.float16).view(np.uint16)
    with pytest.raises(ternary_rs.ValidationError, match=r"'blk\.0\.ffn_gate_exps'.*row 1 group 85"):
        _core.encode_gguf("STQ1_0", q, s, 2, 512, 256, False, tensor="blk.0.ffn_gate_exps")


def _write_gguf(path, name: str, shape, data: np.ndarray) -> None:
    w = GGUFWriter(path)
    w.add_metadata("general.architecture", "hunyuan")
    w.add_tensor_info(name, shape, 43, data.size)
    w.write_tensor_data(name, data)
    w.close()


def test_gguf_file_with_stq1_0_opens_and_lists(tmp_path):
    rng = np.random.default_rng(5)
    shape = (3, 512)
    data = random_blocks(rng, 6)
    path = tmp_path / "stq.gguf"
    _write_gguf(path, "blk.0.ffn_up.weight", shape, data)
    f = ternary_rs.open(path)
    info = f.tensors["blk.0.ffn_up.weight"]
    assert (info.type, info.type_id, info.shape, info.nbytes) == ("STQ1_0", 43, shape, 252)
    np.testing.assert_array_equal(f.raw("blk.0.ffn_up.weight"), data)
    t = rust_decode(np.asarray(f.raw("blk.0.ffn_up.weight")), shape, "blk.0.ffn_up.weight")
    codes, d = ref.decode_stq1_0(data, shape)
    np.testing.assert_array_equal(t.trits(), codes.astype(np.int8) - 1)
    np.testing.assert_array_equal(t.scales.view(np.uint16), d.view(np.uint16))


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


# -- encode through the public API, refusals and requantization ------------------------------------------

def _canonical(trits: np.ndarray, scales: np.ndarray, group: int, name: str = "w") -> ternary_rs.TernaryTensor:
    return ternary_rs.TernaryTensor(ref.pack_canonical(trits), scales.astype(np.float16), group, name=name)


def test_reference_quantizer_follows_the_upstream_rule():
    """quantize_row_stq1_0_ref: d = max |x|; the zero lane is the first smallest |x|; others take x's sign
    (0 and -0.0 give +1)."""
    x = np.full((1, 256), 0.25, np.float32)
    x[0, [0, 16, 32, 48]] = [-3.0, 1.0, 2.0, -1.0]
    x[0, [1, 17, 33, 49]] = [0.0, -0.0, 0.0, -0.0]
    x[0, 255] = 4.0
    t, d = ref.quantize_stq1_0(x)
    assert d[0, 0] == 4.0
    assert t[0, [0, 16, 32, 48]].tolist() == [-1, 0, 1, -1]
    assert t[0, [1, 17, 33, 49]].tolist() == [0, 1, 1, 1]
    assert t[0, [2, 18, 34, 50]].tolist() == [0, 1, 1, 1]  # ties: lane 0 is the zero


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5), blocks=st.integers(1, 3))
def test_encode_matches_reference_and_round_trips(seed, rows, blocks):
    rng = np.random.default_rng(seed)
    trits = representable_trits(rng, rows, 256 * blocks)
    scales = rng.uniform(-3, 3, size=(rows, blocks)).astype(np.float16)
    t = _canonical(trits, scales, 256)
    data = np.asarray(ternary_rs.encode(t, "STQ1_0"))
    np.testing.assert_array_equal(data, ref.encode_stq1_0(trits, scales))
    # requantize=True changes nothing that is representable
    np.testing.assert_array_equal(ternary_rs.encode(t, "STQ1_0", requantize=True), data)
    back = ternary_rs.decode_bytes("STQ1_0", data, trits.shape)
    np.testing.assert_array_equal(back.trits(), trits)
    # g128 with equal halves regroups losslessly to 256
    t128 = _canonical(trits, np.repeat(scales, 2, axis=1), 128)
    np.testing.assert_array_equal(ternary_rs.encode(t128, "STQ1_0"), data)


def test_encode_refuses_unrepresentable_groups_naming_row_and_group():
    rng = np.random.default_rng(12)
    trits = representable_trits(rng, 2, 512)
    trits[1, 256 + 64 + 5 + 16 * np.arange(4)] = -1  # row 1, group 64 + 21: no zero
    trits[0, [0, 16]] = 0  # row 0, group 0: two zeros (counted, and first)
    t = _canonical(trits, np.ones((2, 2)), 256, name="blk.4.ffn_down.weight")
    with pytest.raises(ternary_rs.ValidationError,
                       match=r"'blk\.4\.ffn_down\.weight'.*row 0 group 0 \(columns \[0, 16, 32, 48\]\).*"
                             r"requantize=True.*first at index 0, 2 in total"):
        ternary_rs.encode(t, "STQ1_0")
    # merging g128 halves of different scales is refused as every lossy regroup is
    t128 = _canonical(representable_trits(rng, 1, 256), np.array([[1.0, 2.0]]), 128)
    with pytest.raises(ternary_rs.ValidationError, match="cannot merge groups of 128 into groups of 256"):
        ternary_rs.encode(t128, "STQ1_0")


def _requantized_check(t: ternary_rs.TernaryTensor, data) -> None:
    """``data`` is upstream's quantizer on ``t``'s weights, and within its error bound: with d = max |x| of
    the block (exactly an fp16 scale here, so fp16(d) = d), every weight becomes 0 or ±d with x's sign, so
    |x - x̂| <= d — the zero lane loses |x| <= d, a ±d lane |d - |x|| <= d."""
    x = t.dequantize("float32")
    trits, d = ref.quantize_stq1_0(x)
    np.testing.assert_array_equal(np.asarray(data), ref.encode_stq1_0(trits, d))
    got = ternary_rs.decode_bytes("STQ1_0", data, x.shape, name=t.name).dequantize("float32")
    d_per_value = np.repeat(np.abs(x).reshape(x.shape[0], -1, 256).max(axis=-1), 256, axis=1)
    assert np.all(np.abs(got - x) <= d_per_value)
    assert np.all(got * x >= 0)
    # and exactly: one zero per group, x's sign elsewhere
    assert np.array_equal(got, trits.astype(np.float32) * np.repeat(d.astype(np.float32), 256, axis=1))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), blocks=st.integers(1, 3),
       group=st.sampled_from([32, 64, 128, 256]))
def test_requantize_is_upstreams_quantizer_within_its_bound(seed, rows, blocks, group):
    rng = np.random.default_rng(seed)
    k = 256 * blocks
    trits = rng.integers(-1, 2, size=(rows, k)).astype(np.int8)
    scales = rng.uniform(-0.1, 0.1, size=(rows, k // group)).astype(np.float16)
    t = _canonical(trits, scales, group)
    data = ternary_rs.encode(t, "STQ1_0", requantize=True)
    assert np.asarray(data).size == rows * blocks * 42
    _requantized_check(t, data)


# -- the command line on a qwen3 STQ1_0 GGUF --------------------------------------------------------------

def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ternary_rs", *map(str, args)], capture_output=True, text=True,
                          timeout=240)


def _tensor_bytes(path) -> dict:
    f = ternary_rs.open(path)
    return {n: (i.type, i.shape, bytes(np.asarray(f.raw(n)))) for n, i in f.tensors.items()}


def test_cli_inspect_verify_plan_and_convert_round_trip(tmp_path):
    import json

    from ternary_rs.demo import write_demo_gguf

    src = tmp_path / "hy-STQ1_0.gguf"
    written = write_demo_gguf(src, "STQ1_0", seed=4)
    f = ternary_rs.open(src)
    assert {f.tensors[n].type for n in written} == {"STQ1_0"}
    for name, t in written.items():  # ternary_rs.decode of every tensor = what was written
        got = ternary_rs.decode(f, name)
        np.testing.assert_array_equal(got.qweight, t.qweight)
        np.testing.assert_array_equal(got.scales.view(np.uint16), np.asarray(t.scales).view(np.uint16))

    r = _cli("inspect", src, "--scan", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["packed_ternary_bits_per_weight"] == rep["linear_bits_per_weight"] == 42 * 8 / 256 == 1.3125
    assert rep["is_ternary"] and rep["ternary"]["group_sizes"] == [256] and not rep["problems"]
    r = _cli("inspect", src)
    assert "really ternary: yes" in r.stdout and "1.312 for linear weights" in r.stdout, r.stdout
    r = _cli("verify", src)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _cli("plan", src, "--gpu-memory", "24", "--context", "2048", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["group_size"] == 256 and json.loads(r.stdout)["fits"]

    out = tmp_path / "vllm"
    r = _cli("convert", src, out, "--no-progress", "--no-transformers")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 256
    assert _cli("verify", out).returncode == 0
    back = tmp_path / "back.gguf"
    r = _cli("convert", out, back, "--gguf-type", "STQ1_0", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert _tensor_bytes(back) == _tensor_bytes(src)
    # llama.cpp's LLAMA_FTYPE_MOSTLY_STQ1_0 (PR #22836 numbering; gguf-py 0.19 cannot open type 43 files)
    assert ternary_rs.open(back).metadata["general.file_type"] == 42
    # GGUF -> GGUF keeps the source's type by default
    again = tmp_path / "again.gguf"
    assert _cli("convert", src, again, "--no-progress").returncode == 0
    assert _tensor_bytes(again) == _tensor_bytes(src)


def test_cli_refuses_unrepresentable_weights_unless_requantize(tmp_path):
    from ternary_rs.demo import write_demo_gguf

    src = tmp_path / "tq2.gguf"
    write_demo_gguf(src, "TQ2_0", seed=6)  # random trits: most groups are not STQ1_0 patterns
    dst = tmp_path / "out-STQ1_0.gguf"
    r = _cli("convert", src, dst, "--gguf-type", "STQ1_0", "--no-progress")
    assert r.returncode == 1
    assert re.search(r"tensor token_embd\.weight: STQ1_0 .* row 0 group (\d+) \(columns \[\1, \d+, \d+, \d+\]\) "
                     r"holds trits \[.*\], which its codebook cannot represent; pass --requantize", r.stderr), r.stderr
    assert not dst.exists()
    r = _cli("convert", src, dst, "--gguf-type", "STQ1_0", "--requantize", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert _cli("verify", dst).returncode == 0
    a, b = ternary_rs.open(src), ternary_rs.open(dst)
    for name, info in a.tensors.items():
        if info.type != "TQ2_0":
            continue
        assert b.tensors[name].type == "STQ1_0"
        _requantized_check(ternary_rs.decode(a, name), b.raw(name))
