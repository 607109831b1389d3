"""inspect / verify: fake ternary files, NaN scales, code 3, flipped bytes, truncation, config mismatch.
Corruptions are made with safetensors / plain byte edits; expectations come from the edit itself."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import ternary_rs
from support.models import build_tiny_model

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("iv")
    src = root / "qwen3"
    build_tiny_model(src, arch="qwen3", group_size=128)
    out = root / "qwen3-vllm"
    ternary_rs.convert(src, out, progress=False)
    return root, src, out


def _copy_dir(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _shard_with(d: Path, name: str) -> Path:
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    return d / wm[name]


def test_inspect_real_ternary_hf_dir(tiny):
    _, src, _ = tiny
    head = ternary_rs.inspect(src)  # headers only: float weights are not read, so undecided
    assert head["is_ternary"] is None and head["ternary"]["tensors"] == 0 and not head["problems"]
    assert len(head["ternary"]["unchecked_float_linear_weights"]) == 2 + 2 * 7
    r = ternary_rs.inspect(src, scan=True)
    assert r["format"] in ("directory", "safetensors")
    assert r["architecture"] == "qwen3"
    assert r["is_ternary"] and not r["problems"]
    assert r["ternary"]["group_sizes"] == [128]
    assert r["ternary"]["tensors"] == 2 + 2 * 7  # embed, lm_head, 7 linears per layer
    cfg = json.loads((src / "config.json").read_text())
    assert r["config"]["num_key_value_heads"] == cfg["num_key_value_heads"] == 2
    assert r["config"]["hidden_size"] == 256


def test_inspect_vllm_dir_stats(tiny):
    _, _, out = tiny
    assert ternary_rs.inspect(out)["ternary"]["scales"] is None  # headers only
    r = ternary_rs.inspect(out, scan=True)
    assert r["is_ternary"] and not r["problems"], r["problems"]
    assert r["quantization_config"]["quant_method"] == "ternary"
    s = r["ternary"]["scales"]
    assert s["nan"] == 0 and s["inf"] == 0 and s["min"] > 0
    # packed: 2 bits + 16/128 bits per weight
    assert r["packed_ternary_bits_per_weight"] == pytest.approx(2 + 16 / 128)


def test_fake_ternary_fp16_is_flagged(tiny):
    root, src, _ = tiny
    rng = np.random.default_rng(0)
    for claims, name in ((True, "Ternary-Bonsai-fake"), (False, "plain-fp16")):
        d = _copy_dir(src, root / name)
        tensors = load_file(d / "model.safetensors")
        for k, v in tensors.items():
            if v.ndim == 2:
                tensors[k] = (rng.standard_normal(v.shape) * 0.02).astype(np.float16)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        r = ternary_rs.inspect(d, scan=True)
        assert r["is_ternary"] is False
        assert r["ternary"]["tensors"] == 0
        # Not ternary at all is a problem whatever the name claims (issue 24, item 9: convert refuses it
        # too, so verify must not pass what convert will not take); a claim adds "fake ternary".
        assert any("not a ternary checkpoint" in p for p in r["problems"]), r["problems"]
        assert any("fake ternary" in p for p in r["problems"]) == claims, r["problems"]
        assert not ternary_rs.verify(d).ok


def test_verify_clean_then_flipped_byte(tiny):
    root, _, out = tiny
    rep = ternary_rs.verify(out)
    assert rep.ok and rep.checked_files >= 3, str(rep)
    d = _copy_dir(out, root / "flipped")
    shard = _shard_with(d, "model.layers.0.mlp.up_proj.qweight")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    rep = ternary_rs.verify(d)
    assert not rep.ok
    assert any(shard.name in p and "SHA-256" in p for p in rep.problems), rep.problems


def test_verify_catches_nan_scale_and_code3(tiny):
    root, _, out = tiny
    d = _copy_dir(out, root / "corrupt-values")
    shard = _shard_with(d, "model.layers.1.self_attn.k_proj.scales")
    tensors = load_file(shard)
    tensors["model.layers.1.self_attn.k_proj.scales"][3, 1] = np.float16("nan")
    qname = "model.layers.1.self_attn.k_proj.qweight"
    if qname in tensors:
        tensors[qname][0, 0] = 0xFF  # four codes of 3
    save_file(tensors, str(shard), metadata={"format": "pt"})
    rep = ternary_rs.verify(d)
    assert not rep.ok
    assert any("k_proj" in p and "NaN" in p for p in rep.problems), rep.problems
    if qname in tensors:
        assert any("k_proj" in p and "codes equal 3" in p and "4 codes" in p for p in rep.problems), rep.problems


def test_verify_truncated_shard_and_config_mismatch(tiny):
    root, _, out = tiny
    d = _copy_dir(out, root / "truncated")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    rep = ternary_rs.verify(d)
    assert not rep.ok
    assert any(shard.name in p for p in rep.problems), rep.problems

    d2 = _copy_dir(out, root / "bad-config")
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (d2 / "config.json").write_text(json.dumps(cfg))
    r = ternary_rs.inspect(d2)
    assert any("k_proj" in p and "config implies 256" in p for p in r["problems"]), r["problems"]


def test_inspect_and_verify_gguf(tiny):
    root, src, _ = tiny
    g = root / "tiny-PQ2_0.gguf"
    ternary_rs.convert(src, g, to="gguf", gguf_type="PQ2_0", progress=False)
    r = ternary_rs.inspect(g)
    assert r["format"] == "gguf" and r["architecture"] == "qwen3"
    assert r["is_ternary"] and not r["problems"], r["problems"]
    assert r["by_type"]["PQ2_0"]["tensors"] == 16
    assert r["ternary"]["group_sizes"] == [128]
    assert ternary_rs.verify(g).ok
    bad = root / "tiny-truncated.gguf"
    bad.write_bytes(g.read_bytes()[: g.stat().st_size // 2])
    rep = ternary_rs.verify(bad)
    assert not rep.ok and rep.problems
