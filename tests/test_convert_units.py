"""Unit tests of the conversion pieces that need no container/codec: naming, permutations, dense
ternary detection, staging, shards, manifest. References: gguf-py's tensor map, llama.cpp's
``LlamaModel.permute`` (copied below), transformers' GGUF reverse permute, ``tests/support/contract_writer.py``."""

from __future__ import annotations

import hashlib
import json
import os

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import contract_writer as cw
from ternary_rs import ValidationError
from ternary_rs.arch import ARCHES, arch_for_config, arch_for_gguf
from ternary_rs.arch.base import llama_qk_permutation
from ternary_rs.core import tensor as tensor_module
from ternary_rs.core.formats import dense_ternary_group, float_view
from ternary_rs.core.tensor import decode_bytes, recover_dense
from ternary_rs.sinks.checkpoint import (
    TMP_MARK,
    Job,
    OutTensor,
    Staging,
    parse_size,
    plan_shards,
    quantization_config,
    remove_stale_temporaries,
    sha256_file,
    write_manifest,
)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim from llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


# ------------------------------------------------------------------------------------------ names
@pytest.mark.parametrize("arch_name, model_arch", [("llama", gguf.MODEL_ARCH.LLAMA), ("qwen3", gguf.MODEL_ARCH.QWEN3)])
def test_names_follow_gguf_py_tensor_map(arch_name, model_arch):
    arch = ARCHES[arch_name]
    n_blocks = 3
    tmap = gguf.get_tensor_name_map(model_arch, n_blocks)
    hf_names = list(arch.hf_global_names) + [t.format(bid=b) for b in range(n_blocks) for t in arch.hf_block_names]
    seen = set()
    for hf in hf_names:
        g = arch.gguf_name(hf, n_blocks)
        assert g == tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert arch.hf_name(g, n_blocks) == hf
        seen.add(g)
    assert len(seen) == len(hf_names)
    assert arch.hf_name("rope_freqs.weight", n_blocks) is None
    with pytest.raises(KeyError):
        arch.hf_name("blk.0.not_a_tensor.weight", n_blocks)


def test_registry_dispatch():
    assert arch_for_gguf("qwen3") is ARCHES["qwen3"]
    assert arch_for_config({"model_type": "llama"}) is ARCHES["llama"]
    assert arch_for_config({"architectures": ["Qwen3ForCausalLM"]}) is ARCHES["qwen3"]
    from ternary_rs import UnsupportedTypeError

    with pytest.raises(UnsupportedTypeError, match="gpt_neox"):
        arch_for_gguf("gpt_neox")
    with pytest.raises(UnsupportedTypeError):
        arch_for_config({"model_type": "bert"})


# ------------------------------------------------------------------------------------------ permutation
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (8, 8, 16), (32, 8, 128), (6, 1, 4)])
def test_llama_permutation_matches_llama_cpp_and_transformers(heads, kv_heads, head_dim):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(0)
    arch = ARCHES["llama"]
    cfg = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    q = rng.standard_normal((heads * head_dim, 24)).astype(np.float32)
    k = rng.standard_normal((kv_heads * head_dim, 24)).astype(np.float32)
    pq = arch.rows_to_gguf("model.layers.0.self_attn.q_proj.weight", cfg, q.shape[0])
    pk = arch.rows_to_gguf("model.layers.0.self_attn.k_proj.weight", cfg, k.shape[0])
    np.testing.assert_array_equal(q[pq], llama_cpp_permute(q, heads, heads))
    np.testing.assert_array_equal(k[pk], llama_cpp_permute(k, heads, kv_heads))
    proc = LlamaTensorProcessor(config=cfg)
    gq, gk = q[pq], k[pk]
    back_q = arch.rows_from_gguf("model.layers.0.self_attn.q_proj.weight", cfg, q.shape[0])
    back_k = arch.rows_from_gguf("model.layers.0.self_attn.k_proj.weight", cfg, k.shape[0])
    np.testing.assert_array_equal(gq[back_q], proc._reverse_permute_weights(gq, heads, heads))
    np.testing.assert_array_equal(gk[back_k], proc._reverse_permute_weights(gk, heads, kv_heads))
    np.testing.assert_array_equal(gq[back_q], q)
    assert arch.rows_to_gguf("model.layers.0.self_attn.v_proj.weight", cfg, 8) is None
    assert ARCHES["qwen3"].rows_to_gguf("model.layers.0.self_attn.q_proj.weight", cfg, q.shape[0]) is None
    with pytest.raises(ValueError):
        llama_qk_permutation(10, 4)


# ------------------------------------------------------------------------------------------ dense detection
def _ternary_dense(rng, n, k, g, dtype=np.float16):
    t = rng.integers(-1, 2, size=(n, k)).astype(np.float32)
    a = rng.uniform(0.01, 0.1, size=(n, k // g)).astype(np.float16).astype(np.float32)
    return (t.reshape(n, k // g, g) * a[..., None]).reshape(n, k).astype(dtype)


@pytest.mark.parametrize("g", [32, 64, 128, 256])
def test_dense_detection_finds_largest_exact_group(g):
    rng = np.random.default_rng(g)
    w = _ternary_dense(rng, 16, 512, g)
    assert dense_ternary_group(w.view(np.uint8), "F16", w.shape) == g
    t = decode_bytes("DENSE", w.view(np.uint8), w.shape, group_size=g, dtype="F16")
    codes, scales = cw.ternarize_groups(w, g)
    np.testing.assert_array_equal(t.qweight, cw.pack_codes_lsb_first(codes))
    np.testing.assert_array_equal(t.scales, scales)
    # a smaller group repeats the scale, still exact
    if g > 32:
        t2 = decode_bytes("DENSE", w, w.shape, group_size=g // 2)
        np.testing.assert_array_equal(cw.dequantize(t2.qweight, t2.scales, g // 2), w.astype(np.float32))


def test_dense_detection_rejects_non_ternary_and_handles_bf16_f32():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 256)).astype(np.float16)
    assert dense_ternary_group(w.view(np.uint8), "F16", w.shape) is None
    t = _ternary_dense(rng, 8, 256, 128, np.float32)
    assert dense_ternary_group(t.view(np.uint8), "F32", t.shape) == 128
    t[3, 17] = t[3, 17] * 0.5 if t[3, 17] != 0 else 0.001  # one off-grid value
    assert dense_ternary_group(t.view(np.uint8), "F32", t.shape) is None
    # bf16 (truncating f32 keeps ±a ternary: every value of a group truncates the same way)
    b = _ternary_dense(rng, 8, 256, 64, np.float32)
    b16 = (b.view(np.uint32) >> 16).astype(np.uint16)
    exact = (b16.astype(np.uint32) << 16).view(np.float32)
    assert dense_ternary_group(b16.view(np.uint8), "BF16", b.shape) == 64
    np.testing.assert_array_equal(float_view(b16.view(np.uint8), "BF16").reshape(b.shape), exact)
    nan = _ternary_dense(rng, 4, 128, 128)
    nan[0, 0] = np.nan
    assert dense_ternary_group(nan.view(np.uint8), "F16", nan.shape) is None


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.sampled_from([32, 64, 128, 256]), st.integers(0, 2**31 - 1))
def test_dense_roundtrip_property(rows, g, seed):
    rng = np.random.default_rng(seed)
    w = _ternary_dense(rng, rows, 256, g)
    found = dense_ternary_group(w.view(np.uint8), "F16", w.shape)
    assert found is not None and found >= g
    t = decode_bytes("DENSE", w.view(np.uint8), w.shape, group_size=found, dtype="F16")
    np.testing.assert_array_equal(cw.dequantize(t.qweight, t.scales, found), w.astype(np.float32))


# One dense recovery (Rust dense::recover, chunked by rows): all-zero groups get scale 0 (= max|group|),
# a scale that fp16 cannot hold exactly is refused, and chunking changes neither results nor errors.
def test_dense_recovery_zero_group_scale_is_zero_and_matches_the_contract_writer():
    rng = np.random.default_rng(7)
    w = _ternary_dense(rng, 6, 256, 64)
    w[2, 64:128] = 0  # one all-zero group
    w[5, :] = 0       # an all-zero row
    assert dense_ternary_group(w.view(np.uint8), "F16", w.shape) == 64
    t = decode_bytes("DENSE", w, w.shape, group_size=64)
    codes, scales = cw.ternarize_groups(w, 64)
    assert scales[2, 1] == 0 and (scales[5] == 0).all()
    np.testing.assert_array_equal(t.scales, scales)
    np.testing.assert_array_equal(t.qweight, cw.pack_codes_lsb_first(codes))
    np.testing.assert_array_equal(t.dequantize("float32"), w.astype(np.float32))


def test_dense_recovery_refuses_a_scale_fp16_cannot_hold():
    w = np.zeros((2, 128), dtype=np.float32)
    w[1, 5], w[1, 9] = 0.1, -0.1  # exactly {-a, 0, +a} in f32, but 0.1 is not an fp16 value
    assert dense_ternary_group(w.view(np.uint8), "F32", w.shape) is None
    with pytest.raises(ValidationError, match=r"not exactly representable in fp16 \(first index is the group\)"
                                              r" \(first at index 1, 1 in total\)"):
        decode_bytes("DENSE", w, w.shape, group_size=128)


def test_dense_recovery_chunked_equals_whole_tensor(monkeypatch):
    import threading
    from concurrent.futures import CancelledError

    rng = np.random.default_rng(3)
    w = _ternary_dense(rng, 37, 256, 128)
    whole = decode_bytes("DENSE", w, w.shape, group_size=128)
    monkeypatch.setattr(tensor_module, "DENSE_CHUNK_BYTES", 5 * 256 * 2)  # 5 rows per chunk
    chunked = recover_dense(w.view(np.uint8), "F16", 37, 256, 128, name="w")
    assert chunked.equal(whole)
    bad = w.copy()
    bad[23, 200] = np.abs(bad[23, 128:]).max() / 2  # neither 0 nor ±max of its group (the max stays)
    bad[30, 3] = np.abs(bad[30, :128]).max() / 2
    monkeypatch.setattr(tensor_module, "DENSE_CHUNK_BYTES", 1 << 30)
    with pytest.raises(ValidationError) as whole_err:
        recover_dense(bad.view(np.uint8), "F16", 37, 256, 128, name="w")
    monkeypatch.setattr(tensor_module, "DENSE_CHUNK_BYTES", 5 * 256 * 2)
    with pytest.raises(ValidationError) as chunk_err:
        recover_dense(bad.view(np.uint8), "F16", 37, 256, 128, name="w")
    assert str(chunk_err.value) == str(whole_err.value)
    assert f"first at index {23 * 256 + 200}, 2 in total" in str(chunk_err.value)
    stop = threading.Event()
    stop.set()
    with pytest.raises(CancelledError):
        recover_dense(w.view(np.uint8), "F16", 37, 256, 128, name="w", stop=stop)


# ------------------------------------------------------------------------------------------ checkpoint pieces
def test_parse_size_and_quant_config():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5 MB") == 1_500_000
    assert parse_size(123) == 123
    for bad in ("", "5 parsecs", "-1GB", 0):
        with pytest.raises(ValueError):
            parse_size(bad)
    qc = quantization_config(128, ["lm_head"])
    assert qc == {"quant_method": "ternary", "format_version": 1, "group_size": 128, "scale_dtype": "float16",
                  "modules_not_converted": ["lm_head"]}
    with pytest.raises(ValueError):
        quantization_config(96)


def test_plan_shards_keeps_jobs_whole():
    def job(n):
        return Job([OutTensor("a", "U8", (n,), n)], lambda: ())

    jobs = [job(n) for n in (40, 40, 30, 100, 10)]
    assert plan_shards(jobs, 100) == [[0, 1], [2], [3], [4]]
    assert plan_shards(jobs, 10**9) == [[0, 1, 2, 3, 4]]
    assert plan_shards([], 10) == [[]]


def test_staging_commit_refuse_force_and_cleanup(tmp_path):
    dst = tmp_path / "out"
    with (s := Staging(dst)) as tmp:
        (tmp / "f").write_text("1")
        write_manifest(tmp, [], {})
        assert not dst.exists() and tmp.name.startswith(f".out{TMP_MARK}")
        s.commit()
    assert (dst / "f").read_text() == "1"
    with pytest.raises(FileExistsError, match="--force"):
        with Staging(dst):
            pass
    with pytest.raises(RuntimeError):
        with Staging(dst, force=True) as tmp:
            (tmp / "f").write_text("2")
            raise RuntimeError("crash mid-way")
    assert (dst / "f").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with (s := Staging(dst, force=True)) as tmp:
        (tmp / "g").write_text("3")
        s.commit()
    assert sorted(p.name for p in dst.iterdir()) == ["g"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # ``out`` now has no manifest: it is not ternary_rs's to replace, force or not
    with pytest.raises(FileExistsError, match="not written by ternary_rs"):
        with Staging(dst, force=True):
            pass
    assert sorted(p.name for p in dst.iterdir()) == ["g"]


def test_a_destination_appearing_mid_run_is_never_replaced(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(FileExistsError, match="not written by ternary_rs"):
        with (s := Staging(dst, force=True)) as tmp:
            (tmp / "f").write_text("new")
            dst.mkdir()
            (dst / "user.txt").write_text("precious")
            s.commit()
    assert (dst / "user.txt").read_text() == "precious" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    dst = tmp_path / "model"
    dead = tmp_path / f".model{TMP_MARK}999999999-abcd"
    dead.mkdir()
    alive = tmp_path / f".model{TMP_MARK}{os.getpid()}-abcd"
    alive.mkdir()
    assert remove_stale_temporaries(dst) == [dead]
    assert alive.exists() and not dead.exists()


def test_manifest_hashes_every_file(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("hello")
    src = tmp_path / "src.gguf"
    src.write_bytes(b"GGUF")
    m = write_manifest(tmp_path, [{"path": str(src), "size": 4, "sha256": sha256_file(src)}], {"k": 1})
    on_disk = json.loads((tmp_path / "ternary_rs.json").read_text())
    assert on_disk == m
    assert m["files"]["a.bin"] == {"size": 1000, "sha256": hashlib.sha256(b"x" * 1000).hexdigest()}
    assert m["files"]["sub/b.txt"]["sha256"] == hashlib.sha256(b"hello").hexdigest()
    assert "src.gguf" in m["files"] and m["sources"][0]["sha256"] == hashlib.sha256(b"GGUF").hexdigest()
    assert m["tool"] == "ternary_rs" and m["tool_version"]
