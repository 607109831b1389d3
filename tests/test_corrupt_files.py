"""A corpus of malformed GGUF / safetensors / index files. Each must raise a TernaryError subclass (never
crash the interpreter, never hang), with a message that says what is wrong and where.

The GGUF files are built byte by byte here from the GGUF spec (docs/formats.md#gguf-container), independent of the
code under test; the valid starting points come from gguf-py and safetensors."""

from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

import ternary_rs
from ternary_rs import FormatError, TernaryError, UnsupportedTypeError


# ---- a tiny spec-level GGUF builder -----------------------------------------------------------
def gstr(s: bytes | str, length: int | None = None) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b) if length is None else length) + b


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def tinfo(name: str, ne: list[int], ggml_type: int, offset: int, n_dims: int | None = None) -> bytes:
    n = len(ne) if n_dims is None else n_dims
    return gstr(name) + struct.pack("<I", n) + b"".join(struct.pack("<Q", d) for d in ne) + struct.pack("<IQ", ggml_type, offset)


def gguf_file(kvs=(), infos=(), data=b"", version=3, n_tensors=None, n_kv=None, magic=b"GGUF", alignment=32) -> bytes:
    head = magic + struct.pack("<I", version)
    head += struct.pack("<QQ", len(infos) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(infos)
    head += b"\0" * (-len(head) % alignment)
    return head + data


F32_4 = np.arange(4, dtype=np.float32).tobytes()  # one 16-byte F32 tensor

CORRUPT_GGUF = {
    "empty file": (b"", "needs 4 bytes"),
    "bad magic": (gguf_file(magic=b"GGML"), "bad magic"),
    "version 0": (gguf_file(version=0), "unsupported GGUF version"),
    "version 1": (gguf_file(version=1), "version 1"),
    "version 4": (gguf_file(version=4), "unsupported GGUF version 4"),
    "version 0xFFFF": (gguf_file(version=0xFFFF), "unsupported GGUF version"),
    "huge tensor count": (gguf_file(n_tensors=2**63), "MAX_TENSORS"),
    "tensor count beyond file": (gguf_file(n_tensors=1000), "truncated"),
    "huge kv count": (gguf_file(n_kv=2**40), "MAX_KV"),
    "kv count beyond file": (gguf_file(n_kv=5), "truncated"),
    "huge key length": (gguf_file(kvs=[gstr("k", 2**62)], n_kv=1), "MAX_STRING_LEN"),
    "key length beyond file": (gguf_file(kvs=[gstr("k", 1000)], n_kv=1), "truncated"),
    "huge string value": (gguf_file(kvs=[kv("k", 8, struct.pack("<Q", 2**60))]), "MAX_STRING_LEN"),
    "huge array length": (gguf_file(kvs=[kv("k", 9, struct.pack("<IQ", 4, 2**40))]), "MAX_ARRAY_LEN"),
    "array longer than file": (gguf_file(kvs=[kv("k", 9, struct.pack("<IQ", 10, 10**6))]), "needs at least"),
    "unknown value type": (gguf_file(kvs=[kv("k", 13, b"")]), "unknown metadata value type 13"),
    "unknown array element type": (gguf_file(kvs=[kv("k", 9, struct.pack("<IQ", 99, 1))]), "unknown metadata value type 99"),
    "bool not 0/1": (gguf_file(kvs=[kv("k", 7, b"\x02")]), "bool byte is 0x02"),
    "deeply nested arrays": (
        gguf_file(kvs=[kv("k", 9, struct.pack("<IQ", 9, 1) * 12 + struct.pack("<IQ", 4, 0))]), "MAX_ARRAY_DEPTH"),
    "key not UTF-8": (gguf_file(kvs=[gstr(b"\xff\xfe") + struct.pack("<IB", 0, 1)]), "not valid UTF-8"),
    "duplicate key": (gguf_file(kvs=[kv("k", 0, b"\x01"), kv("k", 0, b"\x02")]), "duplicate metadata key"),
    "alignment not a power of two": (gguf_file(kvs=[kv("general.alignment", 4, struct.pack("<I", 48))]), "power of two"),
    "alignment zero": (gguf_file(kvs=[kv("general.alignment", 4, struct.pack("<I", 0))]), "power of two"),
    "alignment wrong type": (gguf_file(kvs=[kv("general.alignment", 10, struct.pack("<Q", 32))]), "must be a u32"),
    "n_dims > 4": (gguf_file(infos=[tinfo("t", [1, 1, 1, 1, 4], 0, 0)], data=F32_4), "MAX_DIMS"),
    "huge n_dims": (gguf_file(infos=[tinfo("t", [4], 0, 0, n_dims=2**31)], data=F32_4), "MAX_DIMS"),
    "element count overflow": (gguf_file(infos=[tinfo("t", [2**40, 2**40], 0, 0)]), "overflows"),
    "unknown type id": (gguf_file(infos=[tinfo("t", [4], 37, 0)], data=F32_4), "ggml type id 37"),
    "type id 1000": (gguf_file(infos=[tinfo("t", [4], 1000, 0)], data=F32_4), "ggml type id 1000"),
    "ne[0] not a block multiple": (gguf_file(infos=[tinfo("t", [100, 2], 35, 0)], data=bytes(200)), "block size 256"),
    "offset past the end": (gguf_file(infos=[tinfo("t", [4], 0, 2**20)], data=F32_4), "past the end"),
    "offset overflow": (gguf_file(infos=[tinfo("t", [4], 0, 2**64 - 32)], data=F32_4), "past the end"),
    "data truncated": (gguf_file(infos=[tinfo("t", [64], 0, 0)], data=F32_4), "past the end"),
    "misaligned offset": (gguf_file(infos=[tinfo("t", [4], 0, 8)], data=bytes(64)), "not a multiple of the alignment"),
    "overlapping tensors": (
        gguf_file(infos=[tinfo("a", [16], 0, 0), tinfo("b", [16], 0, 32)], data=bytes(128)), "overlaps"),
    "same offset twice": (
        gguf_file(infos=[tinfo("a", [4], 0, 0), tinfo("b", [4], 0, 0)], data=bytes(64)), "overlaps"),
    "duplicate tensor name": (
        gguf_file(infos=[tinfo("a", [4], 0, 0), tinfo("a", [4], 0, 32)], data=bytes(64)), "duplicate tensor name"),
    "tensor name too long": (gguf_file(infos=[tinfo("x" * 5000, [4], 0, 0)], data=F32_4), "MAX_TENSOR_NAME_LEN"),
    "id 42 span fits neither variant": (
        gguf_file(infos=[tinfo("q", [4096], 42, 0)], data=bytes(4096)), "matches neither Q2_0"),
}


@pytest.mark.parametrize("case", list(CORRUPT_GGUF))
def test_corrupt_gguf(tmp_path, case):
    blob, message = CORRUPT_GGUF[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(TernaryError, match=message) as exc:
        ternary_rs.open(path)
    assert str(path) in str(exc.value)
    if "type id" in case:
        assert isinstance(exc.value, UnsupportedTypeError)
    else:
        assert isinstance(exc.value, FormatError)


def test_every_truncation_of_a_gguf_py_file_is_an_error(tmp_path):
    src = tmp_path / "src.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_uint32("x", 5)
    w.add_tensor("w", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.add_tensor("v", np.arange(8, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    blob = src.read_bytes()
    ref = gguf.GGUFReader(str(src))
    data_end = max(t.data_offset + t.n_bytes for t in ref.tensors)
    cut_path = tmp_path / "cut.gguf"
    for cut in range(data_end):  # past data_end only padding is lost: still a valid file
        cut_path.write_bytes(blob[:cut])
        with pytest.raises(FormatError):
            ternary_rs.open(cut_path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_byte_corruption_never_crashes(tmp_path, data):
    """Overwrite random header bytes of a valid file: open either succeeds or raises TernaryError."""
    base = gguf_file(
        kvs=[kv("general.alignment", 4, struct.pack("<I", 32)), kv("a", 9, struct.pack("<IQ", 8, 2) + gstr("x") + gstr("yz"))],
        infos=[tinfo("t", [4], 0, 0), tinfo("u", [256], 35, 32)],
        data=F32_4 + bytes(16) + bytes(66),
    )
    blob = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, 200))
        blob[pos] = data.draw(st.integers(0, 255))
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(blob))
    try:
        with ternary_rs.open(path) as f:
            for name in f.tensors:
                f.raw(name).sum()
    except TernaryError:
        pass


# ---- safetensors --------------------------------------------------------------------------------
def st_file(header: dict | bytes, data: bytes, n: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if n is None else n) + h + data


T = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
CORRUPT_SAFETENSORS = {
    "empty file": (b"", "too small"),
    "header size over the cap": (st_file({}, b"", n=100_000_001), "MAX_HEADER_SIZE"),
    "header size past the end": (st_file({}, b"", n=1000), "past the end"),
    "header not JSON": (st_file(b"{not json}", b""), "not a valid safetensors JSON header"),
    "header not UTF-8": (st_file(b"{\xff}", b""), "not valid UTF-8"),
    "header not an object": (st_file(b"[1, 2]", b""), "does not start with"),
    "entry not an object": (st_file({"t": 5}, b""), "tensor 't': invalid type"),
    "missing dtype": (st_file({"t": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "dtype"),
    "unknown dtype": (st_file({"t": {**T, "dtype": "F17"}}, bytes(8)), "F17"),
    "negative shape": (st_file({"t": {**T, "shape": [-2]}}, bytes(8)), "tensor 't': invalid value: integer `-2`"),
    "three data offsets": (st_file({"t": {**T, "data_offsets": [0, 8, 9]}}, bytes(8)), "tensor 't': trailing characters"),
    "duplicate tensor name": (st_file(b'{"t": %s, "t": %s}' % (json.dumps(T).encode(), json.dumps(T).encode()), bytes(8)),
                              "duplicate tensor name 't'"),
    "shape overflow": (st_file({"t": {**T, "shape": [2**40, 2**40]}}, bytes(8)), "overflows"),
    "size does not match shape": (st_file({"t": {**T, "data_offsets": [0, 12]}}, bytes(12)), "do not span"),
    "end before start": (st_file({"t": {**T, "data_offsets": [8, 0]}}, bytes(8)), "do not span"),
    "offsets past the end": (st_file({"t": T}, bytes(4)), "past the end"),
    "gap between tensors": (
        st_file({"a": T, "b": {**T, "data_offsets": [12, 20]}}, bytes(20)), "contiguous"),
    "overlapping tensors": (
        st_file({"a": T, "b": {**T, "data_offsets": [4, 12]}}, bytes(12)), "contiguous"),
    "first tensor not at 0": (st_file({"t": {**T, "data_offsets": [4, 12]}}, bytes(12)), "contiguous"),
    "trailing bytes": (st_file({"t": T}, bytes(12)), "data section holds 12"),
    "metadata not strings": (st_file({"__metadata__": {"k": 1}, "t": T}, bytes(8)), "__metadata__ must be an object of strings"),
    "sub-byte size": (st_file({"t": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2)), "whole bytes"),
}


@pytest.mark.parametrize("case", list(CORRUPT_SAFETENSORS))
def test_corrupt_safetensors(tmp_path, case):
    blob, message = CORRUPT_SAFETENSORS[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(TernaryError, match=message) as exc:
        ternary_rs.open(path)
    assert str(path) in str(exc.value)
    assert isinstance(exc.value, UnsupportedTypeError if case == "unknown dtype" else FormatError)


def test_every_truncation_of_a_safetensors_file_is_an_error(tmp_path):
    src = tmp_path / "src.safetensors"
    save_file({"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 3), np.int8)}, str(src))
    blob = src.read_bytes()
    cut_path = tmp_path / "cut.safetensors"
    for cut in range(len(blob)):
        cut_path.write_bytes(blob[:cut])
        with pytest.raises(FormatError):
            ternary_rs.open(cut_path)


def make_sharded(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    save_file({"b": np.zeros(2, np.float32)}, str(tmp_path / "s2.safetensors"))


@pytest.mark.parametrize(
    "index, message",
    [
        ({"weight_map": {"a": "s1.safetensors", "b": "missing.safetensors"}}, "missing.safetensors.*does not exist"),
        ({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}, "'b' is in shard 's1.safetensors', but it is not there"),
        ({"weight_map": {"a": "../s1.safetensors"}}, "not a plain file name"),
        ({"weight_map": {"a": 3}}, "expected a string"),
        ({"metadata": {}}, "missing 'weight_map'"),
        ("{broken", "not a valid index"),
    ],
)
def test_corrupt_index(tmp_path, index, message):
    make_sharded(tmp_path)
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(FormatError, match=message):
        ternary_rs.open(path)
    with pytest.raises(FormatError):
        ternary_rs.open(tmp_path)  # the directory resolves to the same index


def test_tensor_in_two_shards(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "s2.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "x": "s2.safetensors"}}))
    with pytest.raises(FormatError, match="also in shard"):
        ternary_rs.open(tmp_path)


def test_directory_problems(tmp_path):
    with pytest.raises(FormatError, match="the folder is empty"):  # issue 24, item 18: said as such
        ternary_rs.open(tmp_path)
    (tmp_path / "notes.txt").write_text("no model here")
    with pytest.raises(FormatError, match="no model.safetensors.index.json"):
        ternary_rs.open(tmp_path)
    (tmp_path / "notes.txt").unlink()
    make_sharded(tmp_path)
    with pytest.raises(FormatError, match="no \\*.safetensors.index.json"):
        ternary_rs.open(tmp_path)
    with pytest.raises(FileNotFoundError):
        ternary_rs.open(tmp_path / "nope.gguf")


def test_bad_config_json(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{oops")
    with ternary_rs.open(tmp_path) as f, pytest.raises(FormatError, match="config.json"):
        f.config  # noqa: B018
