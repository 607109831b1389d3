"""Bonsai 2 (``qwen35``) conversion: PrismML GGUF (PQ2_0 / PTQ1_0 + ``prism.hadamard.*``) and the MLX
Bonsai 2 pack → vLLM checkpoint.

The inputs are written by ``tests/support/bonsai2_model.py`` (NumPy codecs from docs/formats.md#summary + the PyPI ``gguf``
writer); expected values come from the tiny model itself (its stored ternary ``W'`` in Hugging Face order and
its dense Hugging Face tensors), read back with ``safetensors`` — never from ternary_rs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import ternary_rs
from support.bonsai2_model import (
    build_bonsai2_tiny,
    dequant,
    prism_metadata,
    unrotate,
    write_mlx_pack,
    write_prism_gguf,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_bonsai2_tiny(tmp_path_factory.mktemp("bonsai2") / "hf", block_size=128)


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35")
    out = {}
    for qtype in ("PQ2_0", "PTQ1_0"):
        src = write_prism_gguf(tiny, root / f"tiny-{qtype}.gguf", qtype)
        out[qtype] = ternary_rs.convert(src, root / f"vllm-{qtype}", progress=False)
    mlx = write_mlx_pack(tiny, root / "mlx")
    out["MLX"] = ternary_rs.convert(mlx, root / "vllm-mlx", progress=False)
    return out


def read_all(d: Path) -> dict[str, np.ndarray]:
    index = json.loads((Path(d) / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(Path(d) / shard), framework="pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                out[k] = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    assert set(out) == set(index["weight_map"])
    return out


def pack_codes(t: np.ndarray) -> np.ndarray:
    """Canonical qweight (docs/checkpoint.md#canonical-layout): code t+1 of W[n, k] at bits 2·(k%4) of byte k/4."""
    c = (t.astype(np.int16) + 1).astype(np.uint8).reshape(t.shape[0], -1, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


@pytest.mark.parametrize("source", ["PQ2_0", "PTQ1_0", "MLX"])
def test_tensors_match_the_model(tiny, converted, source):
    got = read_all(converted[source])
    # Every ternary weight, the embedding included (served ternary by the plugin's Qwen3.5 class), is W' as
    # stored: codes and fp16 scales bit-exact.
    for name, (t, d) in tiny.stored.items():
        module = name[: -len(".weight")]
        np.testing.assert_array_equal(got[module + ".qweight"], pack_codes(t), err_msg=module)
        np.testing.assert_array_equal(got[module + ".scales"].view(np.uint16), d.astype(np.float16).view(np.uint16))
    for name, want in tiny.dense.items():
        assert name in got, name
        have = got[name]
        # Dense tensors are float32 (lossless: the source value or the float32 of its transform).
        assert have.dtype == np.float32 and have.shape == want.shape, name
        # F32 round trips (w+1−1, log(exp)) and, for MLX, the fp16 of the pack.
        tol = 2e-3 if source == "MLX" else 2e-6
        np.testing.assert_allclose(have, want, atol=tol * max(1.0, float(np.abs(want).max())), err_msg=name)
    ternary = [m[: -len(".weight")] for m in tiny.stored]
    assert set(got) == {m + s for m in ternary for s in (".qweight", ".scales")} | set(tiny.dense)


@pytest.mark.parametrize("source", ["PQ2_0", "PTQ1_0", "MLX"])
def test_config_and_rotation_description(tiny, converted, source):
    cfg = json.loads((Path(converted[source]) / "config.json").read_text())
    ref = tiny.config
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "linear_key_head_dim", "linear_value_head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "linear_conv_kernel_dim", "layer_types",
                "tie_word_embeddings"):
        assert cfg[key] == ref[key], key
    assert cfg["rope_parameters"]["partial_rotary_factor"] == pytest.approx(0.25)
    assert cfg["rope_parameters"]["mrope_section"] == ref["rope_parameters"]["mrope_section"]
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "ternary" and qc["group_size"] == 128
    had = qc["hadamard"]
    assert had["block_size"] == tiny.block_size and had["version"] == 1
    assert set(had["layers"]) == {n[: -len(".weight")] for n in tiny.rotated_names}
    assert had["inverse_embeddings"] == ["model.embed_tokens"]  # ternary, un-rotated per looked-up row
    assert all("gdn_permute" not in v for v in had["layers"].values())  # gdn_v_grouped: vLLM is grouped too
    at = 0
    for w in had["sign_widths"]:
        np.testing.assert_array_equal(np.array(had["sign_values"][at:at + w]), tiny.signs[w])
        at += w
    for module, entry in had["layers"].items():
        assert entry["width"] == tiny.stored[module + ".weight"][0].shape[1]


def test_rotated_weights_reproduce_the_dense_model(tiny, converted):
    """Dequantized W' un-rotated with the checkpoint's own description (scipy Hadamard) == transformers' W."""
    from safetensors.numpy import load_file  # noqa: F401  (same reader as read_all)

    got = read_all(converted["PTQ1_0"])
    had = json.loads((Path(converted["PTQ1_0"]) / "config.json").read_text())["quantization_config"]["hadamard"]
    signs, at = {}, 0
    for w in had["sign_widths"]:
        signs[w] = np.array(had["sign_values"][at:at + w])
        at += w
    with safe_open(str(tiny.hf_dir / "model.safetensors"), framework="numpy") as f:
        for module in had["layers"]:
            q, s = got[module + ".qweight"], got[module + ".scales"]
            codes = np.stack([(q >> (2 * i)) & 3 for i in range(4)], axis=-1).reshape(q.shape[0], -1)
            w_stored = dequant(codes.astype(np.int8) - 1, s, 128)
            dense = unrotate(w_stored, signs[w_stored.shape[1]], had["block_size"])
            np.testing.assert_allclose(dense, f.get_tensor(module + ".weight"), atol=1e-5, err_msg=module)


def test_plain_qwen35_without_rotation(tiny, tmp_path):
    """A qwen35 GGUF without prism.hadamard.* is an ordinary model: same tensors, no rotation entry."""
    src = write_prism_gguf(tiny, tmp_path / "plain.gguf", "PQ2_0", hadamard=False)
    out = ternary_rs.convert(src, tmp_path / "plain", progress=False)
    cfg = json.loads((Path(out) / "config.json").read_text())
    assert "hadamard" not in cfg["quantization_config"]
    got = read_all(out)
    t, _ = tiny.stored["model.layers.0.mlp.down_proj.weight"]
    np.testing.assert_array_equal(got["model.layers.0.mlp.down_proj.qweight"], pack_codes(t))


def test_plain_qwen35_to_upstream_tq2_0(tiny, converted, tmp_path):
    """Upstream llama.cpp runs qwen35 in TQ2_0 / TQ1_0 (no PrismML types), as llama.cpp PR #22836 in STQ1_0: a
    checkpoint without rotation is written so (group 256: --requantize from group 128; STQ1_0 requantizes onto
    its codebook); a rotated one is refused (upstream would drop the rotation)."""
    src = write_prism_gguf(tiny, tmp_path / "plain.gguf", "PQ2_0", hadamard=False)
    plain = ternary_rs.convert(src, tmp_path / "plain", progress=False)
    with pytest.raises(ternary_rs.TernaryError):  # g128 -> g256 is lossy here
        ternary_rs.convert(plain, tmp_path / "strict.gguf", to="gguf", gguf_type="TQ2_0", progress=False)
    for qtype in ("TQ2_0", "TQ1_0", "STQ1_0"):
        g = ternary_rs.convert(plain, tmp_path / f"plain-{qtype}.gguf", to="gguf", gguf_type=qtype,
                               requantize=True, progress=False)
        with ternary_rs.open(g) as f:
            assert f.metadata["general.architecture"] == "qwen35"
            assert qtype in {i.type for i in f.tensors.values()}
            assert not [k for k in f.metadata if k.startswith("prism.")]
        back = read_all(ternary_rs.convert(g, tmp_path / f"back-{qtype}", progress=False))
        assert set(back) == set(read_all(plain))
    for qtype in ("TQ2_0", "STQ1_0"):
        with pytest.raises(ternary_rs.TernaryError, match="Hadamard rotation"):
            ternary_rs.convert(converted["PQ2_0"], tmp_path / "rot.gguf", to="gguf", gguf_type=qtype,
                               requantize=True, progress=False)


def test_gdn_tiled_basis_gets_a_permutation(tiny, tmp_path):
    import gguf

    src = write_prism_gguf(tiny, tmp_path / "tiled.gguf", "PQ2_0",
                           overrides={"prism.hadamard.gdn_v_grouped": (False, gguf.GGUFValueType.BOOL, None)})
    out = ternary_rs.convert(src, tmp_path / "tiled", progress=False)
    layers = json.loads((Path(out) / "config.json").read_text())["quantization_config"]["hadamard"]["layers"]
    c = tiny.config
    for name, entry in layers.items():
        if name.endswith("linear_attn.out_proj"):
            assert entry["gdn_permute"] == {"from": "grouped", "to": "tiled",
                                            "num_v_heads": c["linear_num_value_heads"],
                                            "num_k_heads": c["linear_num_key_heads"],
                                            "head_dim": c["linear_value_head_dim"]}
        else:
            assert "gdn_permute" not in entry


def _refusal_cases():
    import gguf

    V = gguf.GGUFValueType
    return [
        ({"prism.hadamard.version": (3, V.UINT32, None)}, "version"),
        ({"prism.hadamard.transform": ("random-orthogonal", V.STRING, None)}, "transform"),
        ({"prism.hadamard.block_size": (96, V.UINT32, None)}, "power of two"),
        ({"prism.hadamard.sign_values": ([1, -1] * 8, V.ARRAY, V.INT8)}, "sign_values"),
        ({"prism.hadamard.weight_names": (["blk.0.ffn_down.weight", "blk.77.ffn_up.weight"], V.ARRAY, V.STRING)},
         "blk.77"),
        ({"prism.hadamard.axis": ("output-first-dimension", V.STRING, None)}, "axis"),
        ({"prism.hadamard.block_size": (None, V.UINT32, None)}, "block_size"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_rotation_metadata_problems_are_refused(tiny, tmp_path, case):
    overrides, match = _refusal_cases()[case]
    src = write_prism_gguf(tiny, tmp_path / "bad.gguf", "PQ2_0", overrides=overrides)
    dst = tmp_path / "out"
    with pytest.raises(ternary_rs.ValidationError, match=match):
        ternary_rs.convert(src, dst, progress=False)
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]  # no temporary left behind


def test_mlx_pack_sign_mismatch_refused(tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = write_mlx_pack(tiny, tmp_path / "mlx")
    tensors = load_file(str(d / "model.safetensors"))
    key = "language_model.model.layers.0.mlp.down_proj.signs"
    tensors[key] = -tensors[key]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "mlx"})
    with pytest.raises(ternary_rs.ValidationError, match="sign vector"):
        ternary_rs.convert(d, tmp_path / "out", progress=False)


def test_prism_metadata_shape(tiny):
    """The reference writer's keys are the ones docs/formats.md#bonsai2-rotation lists (guards the test inputs)."""
    kv = prism_metadata(tiny)
    assert {k.rsplit(".", 1)[-1] for k in kv} == {
        "version", "transform", "axis", "sign_mode", "block_size", "sign_widths", "sign_values",
        "weight_names", "inverse_weight_names", "gdn_v_grouped"}


def test_gguf_to_gguf_keeps_the_rotation(tiny, converted, tmp_path):
    """PQ2_0 → PTQ1_0 GGUF re-encodes W' and copies prism.hadamard.*: converting that gives the same checkpoint."""
    src = write_prism_gguf(tiny, tmp_path / "a.gguf", "PQ2_0")
    g = ternary_rs.convert(src, tmp_path / "b.gguf", to="gguf", gguf_type="PTQ1_0", progress=False)
    f = ternary_rs.open(g)
    assert f.metadata["prism.hadamard.block_size"] == tiny.block_size
    assert {i.type for i in f.tensors.values()} >= {"PTQ1_0"}
    out = ternary_rs.convert(g, tmp_path / "v", progress=False)
    a, b = read_all(out), read_all(converted["PQ2_0"])
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    qa = json.loads((Path(out) / "config.json").read_text())["quantization_config"]
    qb = json.loads((Path(converted["PQ2_0"]) / "config.json").read_text())["quantization_config"]
    assert qa["hadamard"] == qb["hadamard"]


def test_dequantized_checkpoint_is_the_dense_model(tiny, converted, tmp_path):
    """``dequantize_checkpoint`` un-rotates: transformers on it gives the reference model's logits."""
    from transformers import AutoModelForCausalLM

    dense = ternary_rs.dequantize_checkpoint(converted["PTQ1_0"], tmp_path / "dense")
    ids = torch.tensor([[5, 17, 42, 99, 123, 7, 250, 3]])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tiny.hf_dir, dtype=torch.float32).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()(ids).logits
    # Nothing in the checkpoint is rounded (ternary W' and float32 dense tensors): float32 summation only.
    torch.testing.assert_close(got, ref, atol=1e-4 * float(ref.std()), rtol=0)


def test_generic_paths_refuse_rotated_sources(tmp_path):
    """A rotated source the generic (non-qwen35) writers would flatten is refused, never silently converted."""
    from support.models import build_tiny_model

    hf = tmp_path / "hf"
    build_tiny_model(hf, arch="qwen3")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "ternary", "format_version": 1, "group_size": 128,
                                  "hadamard": {"version": 1}}
    (hf / "config.json").write_text(json.dumps(cfg))
    for to in ("vllm", "gguf"):
        with pytest.raises(ternary_rs.ValidationError, match="rotated"):
            ternary_rs.convert(hf, tmp_path / f"out-{to}", to=to, progress=False)
        assert not (tmp_path / f"out-{to}").exists()


def test_mlx_pack_module_list_must_match_hadamard_json(tiny, tmp_path):
    d = write_mlx_pack(tiny, tmp_path / "mlx")
    had = json.loads((d / "hadamard.json").read_text())
    had["weight_names"] = [n for n in had["weight_names"] if not n.endswith("layers.1.mlp.up_proj.weight")]
    (d / "hadamard.json").write_text(json.dumps(had))
    with pytest.raises(ternary_rs.ValidationError, match="layers.1.mlp.up_proj"):
        ternary_rs.convert(d, tmp_path / "out", progress=False)


# ------------------------------------------------------------------------------------------------------
# Bonsai files as they ship: first-generation id-42 Q2_0, g64 Q2_0, rotation version 2, identity signs,
# sign arrays of any int width, a missing gdn_v_grouped (docs/formats.md#prism-gguf-types, docs/formats.md#bonsai2-rotation)
# ------------------------------------------------------------------------------------------------------


def _ternary_matches(tiny, got, group):
    """Every stored ternary weight (W' codes and fp16 scales at ``group``) is in the checkpoint, bit-exact."""
    for name, (t, d) in tiny.stored.items():
        module = name[: -len(".weight")]
        np.testing.assert_array_equal(got[module + ".qweight"], pack_codes(t), err_msg=module)
        want = np.repeat(d.astype(np.float16), tiny.group_size // group, axis=1)
        np.testing.assert_array_equal(got[module + ".scales"].view(np.uint16), want.view(np.uint16), err_msg=module)


def test_first_generation_id42_g128_q2_0(tiny, converted, tmp_path):
    """Type id 42 with 34-byte blocks (``Ternary-Bonsai-27B-Q2_0.gguf``): decoded as the fork's g128 Q2_0,
    giving exactly the PQ2_0 file's checkpoint."""
    src = write_prism_gguf(tiny, tmp_path / "gen1-Q2_0.gguf", "Q2_0_G128")
    assert {i.type for i in ternary_rs.open(src).tensors.values()} >= {"Q2_0_G128"}
    out = ternary_rs.convert(src, tmp_path / "gen1", progress=False)
    a, b = read_all(out), read_all(converted["PQ2_0"])
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert json.loads((Path(out) / "config.json").read_text())["quantization_config"]["group_size"] == 128


@pytest.fixture(scope="module")
def tiny_g64(tmp_path_factory):
    return build_bonsai2_tiny(tmp_path_factory.mktemp("bonsai2_g64") / "hf", block_size=128, group_size=64)


def test_q2_0_g64_keeps_its_groups(tiny_g64, tmp_path):
    """Upstream Q2_0 (id 42, 18-byte blocks, g64) with a distinct scale per 64 values stays g64."""
    src = write_prism_gguf(tiny_g64, tmp_path / "m-Q2_g64.gguf", "Q2_0")
    assert {i.type for i in ternary_rs.open(src).tensors.values()} >= {"Q2_0"}
    out = ternary_rs.convert(src, tmp_path / "g64", progress=False)
    assert json.loads((Path(out) / "config.json").read_text())["quantization_config"]["group_size"] == 64
    _ternary_matches(tiny_g64, read_all(out), 64)


def test_prism_q2_g64_of_a_g128_model(tiny, tmp_path):
    """PrismML's ``*-Q2_g64.gguf`` repeats each g128 scale per 64-value block: native g64, and g128 on request
    (lossless, the pairs agree)."""
    src = write_prism_gguf(tiny, tmp_path / "m-Q2_g64.gguf", "Q2_0")
    got = read_all(ternary_rs.convert(src, tmp_path / "g64", progress=False))
    _ternary_matches(tiny, got, 64)
    got128 = read_all(ternary_rs.convert(src, tmp_path / "g128", group_size=128, progress=False))
    _ternary_matches(tiny, got128, 128)


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    return build_bonsai2_tiny(tmp_path_factory.mktemp("bonsai2_tied") / "hf", block_size=128,
                              tie_word_embeddings=True)


def test_rotation_version_2_tied_output(tiny_tied, tmp_path):
    """``version = 2`` + ``tied_output``: no ``output.weight``; the checkpoint ties the head to the ternary,
    inverse-rotated embedding (vLLM applies the forward transform to a tied head)."""
    src = write_prism_gguf(tiny_tied, tmp_path / "v2.gguf", "PQ2_0")
    f = ternary_rs.open(src)
    assert "output.weight" not in f.tensors and f.metadata["prism.hadamard.version"] == 2
    out = ternary_rs.convert(src, tmp_path / "v2", progress=False)
    cfg = json.loads((Path(out) / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    got = read_all(out)
    assert not any(k.startswith("lm_head") for k in got)
    _ternary_matches(tiny_tied, got, 128)
    assert cfg["quantization_config"]["hadamard"]["inverse_embeddings"] == ["model.embed_tokens"]


def test_tied_output_needs_version_2_and_no_output_tensor(tiny, tiny_tied, tmp_path):
    import gguf

    V = gguf.GGUFValueType
    # version 1 does not know tied_output: refuse rather than guess which head to serve.
    src = write_prism_gguf(tiny_tied, tmp_path / "v1-tied.gguf", "PQ2_0",
                           overrides={"prism.hadamard.version": (1, V.UINT32, None)})
    with pytest.raises(ternary_rs.ValidationError, match="tied_output"):
        ternary_rs.convert(src, tmp_path / "a", progress=False)
    # tied_output = true but the file has an output.weight: contradictory.
    src = write_prism_gguf(tiny, tmp_path / "v2-untied.gguf", "PQ2_0",
                           overrides={"prism.hadamard.version": (2, V.UINT32, None),
                                      "prism.hadamard.tied_output": (True, V.BOOL, None)})
    with pytest.raises(ternary_rs.ValidationError, match="output.weight"):
        ternary_rs.convert(src, tmp_path / "b", progress=False)


@pytest.mark.parametrize("key", ["axis", "sign_mode"])
def test_axis_and_sign_mode_are_required(tiny, tmp_path, key):
    src = write_prism_gguf(tiny, tmp_path / "bad.gguf", "PQ2_0", overrides={f"prism.hadamard.{key}": (None, None, None)})
    with pytest.raises(ternary_rs.ValidationError, match=f"prism.hadamard.{key}"):
        ternary_rs.convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_identity_sign_mode_without_sign_arrays(tmp_path):
    """``sign_mode = "identity"``: no sign arrays, s = 1; the un-rotated weights are the dense model's."""
    tiny = build_bonsai2_tiny(tmp_path / "hf", block_size=128, sign_mode="identity")
    src = write_prism_gguf(tiny, tmp_path / "id.gguf", "PTQ1_0")
    assert "prism.hadamard.sign_values" not in ternary_rs.open(src).metadata
    out = ternary_rs.convert(src, tmp_path / "id", progress=False)
    had = json.loads((Path(out) / "config.json").read_text())["quantization_config"]["hadamard"]
    assert set(had["sign_values"]) == {1}
    assert set(had["layers"]) == {n[: -len(".weight")] for n in tiny.rotated_names}
    got = read_all(out)
    _ternary_matches(tiny, got, 128)
    with safe_open(str(tiny.hf_dir / "model.safetensors"), framework="numpy") as f:
        module = "model.layers.1.mlp.down_proj"
        q, s = got[module + ".qweight"], got[module + ".scales"]
        codes = np.stack([(q >> (2 * i)) & 3 for i in range(4)], axis=-1).reshape(q.shape[0], -1)
        dense = unrotate(dequant(codes.astype(np.int8) - 1, s, 128), np.ones(q.shape[1] * 4), 128)
        np.testing.assert_allclose(dense, f.get_tensor(module + ".weight"), atol=1e-5)


def test_identity_sign_mode_with_flipping_signs_refused(tiny, tmp_path):
    import gguf

    src = write_prism_gguf(tiny, tmp_path / "bad.gguf", "PQ2_0",
                           overrides={"prism.hadamard.sign_mode": ("identity", gguf.GGUFValueType.STRING, None)})
    with pytest.raises(ternary_rs.ValidationError, match="identity"):
        ternary_rs.convert(src, tmp_path / "out", progress=False)


@pytest.mark.parametrize("width", ["INT16", "INT32", "INT64"])
def test_sign_arrays_of_any_int_width(tiny, converted, tmp_path, width):
    """gguf-py writes Python int lists as INT32; any signed integer array is accepted."""
    import gguf

    V = gguf.GGUFValueType
    widths = sorted(tiny.signs)
    values = [int(v) for w in widths for v in tiny.signs[w]]
    src = write_prism_gguf(tiny, tmp_path / "w.gguf", "PQ2_0",
                           overrides={"prism.hadamard.sign_values": (values, V.ARRAY, getattr(V, width))})
    assert ternary_rs.open(src).metadata_types["prism.hadamard.sign_values"] == f"array[i{width[3:]}]"
    out = ternary_rs.convert(src, tmp_path / "o", progress=False)
    qa = json.loads((Path(out) / "config.json").read_text())["quantization_config"]["hadamard"]
    qb = json.loads((Path(converted["PQ2_0"]) / "config.json").read_text())["quantization_config"]["hadamard"]
    assert qa == qb


def test_missing_gdn_v_grouped_means_false_gguf(tiny, tmp_path):
    """Upstream's loader reads an absent ``gdn_v_grouped`` as false: same checkpoint as an explicit false."""
    import gguf

    absent = ternary_rs.convert(write_prism_gguf(tiny, tmp_path / "a.gguf", "PQ2_0", overrides={
        "prism.hadamard.gdn_v_grouped": (None, None, None)}), tmp_path / "absent", progress=False)
    false = ternary_rs.convert(write_prism_gguf(tiny, tmp_path / "f.gguf", "PQ2_0", overrides={
        "prism.hadamard.gdn_v_grouped": (False, gguf.GGUFValueType.BOOL, None)}), tmp_path / "false", progress=False)
    ha = json.loads((Path(absent) / "config.json").read_text())["quantization_config"]["hadamard"]
    hf = json.loads((Path(false) / "config.json").read_text())["quantization_config"]["hadamard"]
    assert ha == hf
    assert all("gdn_permute" in v for k, v in ha["layers"].items() if k.endswith("linear_attn.out_proj"))


def test_missing_gdn_v_grouped_means_false_mlx(tiny, tmp_path):
    d = write_mlx_pack(tiny, tmp_path / "mlx")
    had = json.loads((d / "hadamard.json").read_text())
    del had["gdn_v_grouped"]
    (d / "hadamard.json").write_text(json.dumps(had))
    out = ternary_rs.convert(d, tmp_path / "out", progress=False)
    layers = json.loads((Path(out) / "config.json").read_text())["quantization_config"]["hadamard"]["layers"]
    c = tiny.config
    for name, entry in layers.items():
        if name.endswith("linear_attn.out_proj"):
            assert entry["gdn_permute"] == {"from": "grouped", "to": "tiled",
                                            "num_v_heads": c["linear_num_value_heads"],
                                            "num_k_heads": c["linear_num_key_heads"],
                                            "head_dim": c["linear_value_head_dim"]}


def test_q2_0_g64_to_g128_refused_when_pairs_differ(tiny_g64, tmp_path):
    src = write_prism_gguf(tiny_g64, tmp_path / "m-Q2_g64.gguf", "Q2_0")
    with pytest.raises(ternary_rs.ValidationError):
        ternary_rs.convert(src, tmp_path / "g128", group_size=128, progress=False)
    assert not (tmp_path / "g128").exists()


# ------------------------------------------------------------------------------------------------------
# What convert writes is what inspect / verify / plan describe (issue 16 item 3)
# ------------------------------------------------------------------------------------------------------


def _served_bytes_from_headers(ckpt: Path) -> int:
    """Bytes vLLM holds for the checkpoint, from the safetensors headers (``safetensors``, not ternary_rs):
    ternary qweight + scales as stored, every float tensor at 2 bytes per value (served in bf16)."""
    total = 0
    for shard in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(shard), framework="numpy") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                n = int(np.prod(sl.get_shape()))
                total += n * (1 if k.endswith(".qweight") else 2)
    return total


@pytest.mark.parametrize("qtype", ["PQ2_0", "PTQ1_0"])
def test_inspect_verify_plan_describe_the_output(tiny, converted, tmp_path, qtype):
    import subprocess
    import sys

    out = Path(converted[qtype])
    src = write_prism_gguf(tiny, tmp_path / f"src-{qtype}.gguf", qtype)
    run = lambda *a: subprocess.run([sys.executable, "-m", "ternary_rs", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=300)
    inspected = run("inspect", str(out))
    assert inspected.returncode == 0, inspected.stderr
    assert "really ternary: yes" in inspected.stdout, inspected.stdout
    verified = run("verify", str(out))
    assert verified.returncode == 0 and "OK" in verified.stdout, verified.stdout + verified.stderr
    assert "warning" not in verified.stdout, verified.stdout
    # plan on the source counts exactly what convert writes (the embedding is ternary in both).
    want = _served_bytes_from_headers(out)
    assert ternary_rs.plan(src)["weights"] == ternary_rs.plan(out)["weights"] == want


# ------------------------------------------------------------------------------------------------------
# MTP layers (``nextn_predict_layers``; ``blk.N.nextn.*`` after the decoder blocks)
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    return build_bonsai2_tiny(tmp_path_factory.mktemp("bonsai2_mtp") / "hf", block_size=128, mtp_layers=1)


def test_mtp_layers_convert_to_vllm_names(tiny_mtp, tmp_path):
    """``block_count`` 5 = 4 decoder + 1 MTP block: blk.4.* → mtp.layers.0.*, blk.4.nextn.{eh_proj, enorm,
    hnorm, shared_head_norm} → mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm}; ternary stays
    ternary (bit-exact), norms lose their +1."""
    src = write_prism_gguf(tiny_mtp, tmp_path / "mtp.gguf", "PTQ1_0")
    md = ternary_rs.open(src).metadata
    assert md["qwen35.block_count"] == 5 and md["qwen35.nextn_predict_layers"] == 1
    out = ternary_rs.convert(src, tmp_path / "out", progress=False)
    cfg = json.loads((Path(out) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and cfg["mtp_num_hidden_layers"] == 1
    assert cfg["layer_types"] == tiny_mtp.config["layer_types"]
    got = read_all(out)
    _ternary_matches(tiny_mtp, got, 128)
    for name, want in tiny_mtp.dense.items():
        np.testing.assert_allclose(got[name], want, atol=2e-6 * max(1.0, float(np.abs(want).max())), err_msg=name)
    assert {k for k in got if k.startswith("mtp.")} == {
        n[: -len(".weight")] + s for n in tiny_mtp.stored if n.startswith("mtp.") for s in (".qweight", ".scales")
    } | {n for n in tiny_mtp.dense if n.startswith("mtp.")}
    had = cfg["quantization_config"]["hadamard"]["layers"]
    assert {k for k in had if k.startswith("mtp.")} == {
        n[: -len(".weight")] for n in tiny_mtp.rotated_names if n.startswith("mtp.")}


def test_dedicated_mtp_embedding_refused(tiny_mtp, tmp_path):
    """``blk.L.nextn.embed_tokens``: vLLM's qwen3_5_mtp shares the main embedding; refuse, naming the tensor."""
    write_prism_gguf(tiny_mtp, tmp_path / "dedicated.gguf", "PQ2_0",
                     copies={"blk.4.nextn.embed_tokens.weight": "model.embed_tokens.weight"})
    with pytest.raises(ternary_rs.TernaryError, match=r"blk\.4\.nextn\.embed_tokens"):
        ternary_rs.convert(tmp_path / "dedicated.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------------
# A ternary_rs Bonsai 2 checkpoint back to a qwen35 GGUF (issue 16 item 5)
# ------------------------------------------------------------------------------------------------------


def _gguf_py(path):
    """gguf-py's reader of ``path``: metadata fields and tensor infos (it cannot build tensors of type ids it
    does not know, 142 / 143), plus each tensor's raw bytes at the offsets it parsed."""
    import gguf

    class InfoOnly(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            self.data_start = start_offs
            self.tensor_fields = fields

    r = InfoOnly(str(path))
    raw = np.fromfile(path, dtype=np.uint8)
    infos = {}
    names = [bytes(f.parts[1]).decode() for f in r.tensor_fields]
    starts = [r.data_start + int(f.parts[5][0]) for f in r.tensor_fields]
    ends = sorted(starts[1:] + [raw.size])
    for f, name, start in zip(r.tensor_fields, names, starts):
        _, _, n_dims, dims, type_id, _ = f.parts
        end = min(e for e in ends if e > start)
        infos[name] = (tuple(int(d) for d in dims[::-1]), int(type_id[0]), raw[start:end])
    return r.fields, infos


def _block_bytes(type_id, shape):
    per = {142: 34 / 128, 143: 28 / 128, 0: 4}[type_id]
    return int(np.prod(shape) * per)


@pytest.mark.parametrize("qtype,variant", [("PQ2_0", "mtp"), ("PTQ1_0", "plain"), ("PQ2_0", "tied")])
def test_checkpoint_converts_back_to_a_qwen35_gguf(tiny, tiny_mtp, tiny_tied, tmp_path, qtype, variant):
    """GGUF (reference writer) → vLLM dir → GGUF → vLLM dir. The GGUF ternary_rs writes is read with
    gguf-py: the same qwen35.* hyper-parameters and prism.hadamard.* description as the reference file, the
    same tensors (names, shapes, type ids) and the same bytes (ssm_a = −exp(log(−A)) to float32 rounding);
    converting it again gives the first checkpoint."""
    model = {"mtp": tiny_mtp, "plain": tiny, "tied": tiny_tied}[variant]
    src = write_prism_gguf(model, tmp_path / "ref.gguf", qtype)
    first = ternary_rs.convert(src, tmp_path / "v1", progress=False)
    back = ternary_rs.convert(first, tmp_path / "back.gguf", to="gguf", gguf_type=qtype, progress=False)
    ref_fields, ref_tensors = _gguf_py(src)
    got_fields, got_tensors = _gguf_py(back)
    assert got_fields["general.architecture"].contents() == "qwen35"
    for key, field in ref_fields.items():
        if key.startswith(("qwen35.", "prism.hadamard.")):
            assert key in got_fields, key
            assert got_fields[key].contents() == field.contents(), key
    assert {k for k in got_fields if k.startswith("prism.hadamard.")} == {
        k for k in ref_fields if k.startswith("prism.hadamard.")}
    assert got_fields["tokenizer.ggml.tokens"].contents() == ref_fields["tokenizer.ggml.tokens"].contents()
    assert set(got_tensors) == set(ref_tensors)
    for name, (shape, tid, data) in ref_tensors.items():
        gshape, gtid, gdata = got_tensors[name]
        assert (gshape, gtid) == (shape, tid), name
        n = _block_bytes(tid, shape)
        if name.endswith(".ssm_a"):
            np.testing.assert_allclose(gdata[:n].view("<f4"), data[:n].view("<f4"), rtol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(gdata[:n], data[:n], err_msg=name)
    again = ternary_rs.convert(back, tmp_path / "v2", progress=False)
    a, b = read_all(first), read_all(again)
    assert set(a) == set(b)
    for k in a:
        if k.endswith("A_log"):
            np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)
        else:
            np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    ca = json.loads((Path(first) / "config.json").read_text())
    cb = json.loads((Path(again) / "config.json").read_text())
    assert ca["quantization_config"] == cb["quantization_config"]
    for key in ("num_hidden_layers", "layer_types", "tie_word_embeddings", "rope_parameters", "vocab_size",
                "mtp_num_hidden_layers"):
        assert ca.get(key) == cb.get(key), key


def test_checkpoint_to_gguf_on_the_command_line(tiny, converted, tmp_path):
    """The real command: a Bonsai 2 checkpoint (model_type qwen3_5_text) → PTQ1_0 GGUF, no refusal."""
    import subprocess
    import sys

    dst = tmp_path / "bonsai2-PTQ1_0.gguf"
    proc = subprocess.run([sys.executable, "-m", "ternary_rs", "convert", str(converted["PQ2_0"]), str(dst),
                           "--to", "gguf", "--gguf-type", "PTQ1_0", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    f = ternary_rs.open(dst)
    assert f.metadata["general.architecture"] == "qwen35"
    assert {i.type for n, i in f.tensors.items() if n.endswith("ffn_down.weight")} == {"PTQ1_0"}
    assert f.metadata["prism.hadamard.block_size"] == tiny.block_size


def test_checkpoint_to_gguf_refuses_a_lossy_group(tiny_g64, tmp_path):
    """PQ2_0 / PTQ1_0 are g128: a g64 checkpoint with distinct pair scales cannot be written losslessly."""
    ckpt = ternary_rs.convert(write_prism_gguf(tiny_g64, tmp_path / "g64.gguf", "Q2_0"), tmp_path / "v",
                              progress=False)
    with pytest.raises(ternary_rs.TernaryError, match="merge groups of 64"):
        ternary_rs.convert(ckpt, tmp_path / "out.gguf", to="gguf", progress=False)
    assert not (tmp_path / "out.gguf").exists()


def test_mlx_pack_to_gguf(tiny, tmp_path):
    """The Bonsai 2 MLX pack converts to the same ternary GGUF tensors as the reference PQ2_0 file."""
    mlx = write_mlx_pack(tiny, tmp_path / "mlx")
    out = ternary_rs.convert(mlx, tmp_path / "mlx.gguf", to="gguf", gguf_type="PQ2_0", progress=False)
    _, got = _gguf_py(out)
    _, want = _gguf_py(write_prism_gguf(tiny, tmp_path / "ref.gguf", "PQ2_0"))
    assert set(got) == set(want)
    for name, (shape, tid, data) in want.items():
        if tid == 142:
            assert got[name][:2] == (shape, tid), name
            np.testing.assert_array_equal(got[name][2][:_block_bytes(tid, shape)], data[:_block_bytes(tid, shape)])
