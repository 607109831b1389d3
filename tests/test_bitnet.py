"""BitNet b1.58 (``BitNetForCausalLM``): conversion from every source and the activation numerics.

References (none of them ternary_rs code): transformers' own BitNet — ``pack_weights`` / ``unpack_weights``,
``BitLinear``, ``AutoBitLinear``, ``WeightQuant`` (``transformers/integrations/bitnet.py``) and the model
loaded by ``from_pretrained``; gguf-py (writer, quantizers, reader); bitnet.cpp's I2_S layout written from
docs/formats.md#i2_s in ``tests/support/bitnet_model.py``; ``tests/support/contract_writer.py``'s NumPy unpacking. The vLLM
engines serving these checkpoints are in ``tests/test_bitnet_vllm.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' BitNet quantizer refuses to load without it

import ternary_rs
from support.bitnet_model import LINEAR_SUFFIXES, build_tiny_bitnet, load_reference, write_bitnet_gguf
from support.contract_writer import unpack_codes_lsb_first
from ternary_rs.serving import ops
from ternary_rs.sinks.checkpoint import ConversionError

CLI = [sys.executable, "-m", "ternary_rs"]


def read_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a converted checkpoint (safetensors' own torch reader; keeps bf16)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def trits_of(qweight: torch.Tensor) -> np.ndarray:
    return unpack_codes_lsb_first(qweight.numpy()).astype(np.int8) - 1


def assert_same_values(a: dict, b: dict) -> None:
    """Same tensor names and values (floats compared after widening: a GGUF stores norms as F32)."""
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name], b[name]
        if x.is_floating_point():
            assert torch.equal(x.float(), y.float()), name
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("bitnet")


@pytest.fixture(scope="module")
def packed_auto(root):
    """Like microsoft/bitnet-b1.58-2B-4T: autobitlinear, offline, bf16, tied."""
    return build_tiny_bitnet(root / "auto", linear_class="autobitlinear", dtype="bfloat16", seed=3)


@pytest.fixture(scope="module")
def packed_bitlinear(root):
    """transformers' default BitLinear (reciprocal weight_scale), bf16, untied, with attention biases."""
    return build_tiny_bitnet(root / "bitlinear", linear_class="bitlinear", dtype="bfloat16", seed=4,
                             tie_word_embeddings=False, attention_bias=True)


@pytest.fixture(scope="module")
def master(root):
    """Like microsoft/bitnet-b1.58-2B-4T-bf16: the same model as ``packed_auto`` before packing."""
    return build_tiny_bitnet(root / "master", packed=False, dtype="bfloat16", seed=3)


# ---------------------------------------------------------------------------------------------------
# numerics of the op's BitNet mode against transformers' BitLinear / AutoBitLinear
# ---------------------------------------------------------------------------------------------------
def test_op_int8_token_mode_equals_transformers_bitlinear():
    """``activations=INT8_TOKEN`` is transformers' BitNet forward (float32: both classes), including a token
    whose max|x| is under the 1e-5 clamp and exact .5 ties (round half to even)."""
    from transformers.integrations.bitnet import AutoBitLinear, BitLinear, pack_weights

    torch.manual_seed(0)
    n, k, g = 96, 512, 128
    trits = torch.randint(-1, 2, (n, k)).float()
    ws = 2.0 ** -5  # exact in fp16: the comparison is of the numerics, not of a scale rounding
    auto = AutoBitLinear(k, n, bias=False, online_quant=False)
    bitlinear = BitLinear(k, n, bias=True, dtype=torch.float32)
    bias = torch.randn(n)
    with torch.no_grad():
        auto.weight.copy_(trits)
        auto.weight_scale.fill_(ws)
        bitlinear.weight.copy_(pack_weights(trits.to(torch.int8).clone()))
        bitlinear.weight_scale.fill_(1.0 / ws)
        bitlinear.bias.copy_(bias)
    x = torch.randn(9, k)
    x[3] *= 1e-7                                        # max|x| < 1e-5: the clamp decides the scale
    x[4] = torch.arange(k) % 7 - 3.0                    # max 3: scale 127/3, products exact
    x[5] = 0.0
    x[5, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])    # scale exactly 1: ties at .5
    qweight = torch.from_numpy(ternary_rs.pack_codes(trits.to(torch.int8).numpy()))
    scales = torch.full((n, k // g), ws, dtype=torch.float16)
    qk, sk = ops.prepare_weight(qweight, scales, g)
    with torch.no_grad():
        want_auto = auto(x)
        want_bitlinear = bitlinear(x)
    got = ops.ternary_linear(x, qk, sk, n, k, g, None, ops.INT8_TOKEN)
    got_bias = ops.ternary_linear(x, qk, sk, n, k, g, bias, ops.INT8_TOKEN)
    # Same integer products; only the f32 order of the final multiplications differs.
    tol = dict(rtol=1e-6, atol=1e-6 * float(want_auto.abs().max()))
    torch.testing.assert_close(got, want_auto, **tol)
    torch.testing.assert_close(got_bias, want_bitlinear, **tol)
    # The global default does not matter: the mode is asked for explicitly.
    from ternary_rs.serving import _ops_cpu

    with _ops_cpu.kernel_options(int8=False):
        assert torch.equal(ops.ternary_linear(x, qk, sk, n, k, g, None, ops.INT8_TOKEN), got)


# ---------------------------------------------------------------------------------------------------
# transformers' packed checkpoints (both weight_scale conventions)
# ---------------------------------------------------------------------------------------------------
def _reference_linears(model) -> dict[str, tuple[torch.Tensor, float]]:
    """``{weight name: (trits, magnitude)}`` exactly as transformers' loaded modules compute with them."""
    from transformers.integrations.bitnet import AutoBitLinear, BitLinear, unpack_weights

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, BitLinear):  # y = (x_q @ W_t.T) / (s_x · weight_scale)
            out[name + ".weight"] = (unpack_weights(m.weight, dtype=torch.float32), 1.0 / float(m.weight_scale))
        elif isinstance(m, AutoBitLinear):  # offline: F.linear(ActQuant(x), W_t) · weight_scale
            out[name + ".weight"] = (m.weight.detach().float(), float(m.weight_scale))
    return out


@pytest.mark.parametrize("which", ["autobitlinear", "bitlinear"])
def test_packed_checkpoint_converts_to_the_weights_transformers_uses(which, packed_auto, packed_bitlinear, root):
    src = packed_auto if which == "autobitlinear" else packed_bitlinear
    out = ternary_rs.convert(src, root / f"conv-{which}", progress=False)
    model = load_reference(src, "bfloat16")
    linears = _reference_linears(model)
    assert len(linears) == 7 * 2
    ours = read_checkpoint(out)
    for name, (trits, magnitude) in linears.items():
        prefix = name[: -len(".weight")]
        np.testing.assert_array_equal(trits_of(ours[prefix + ".qweight"]), trits.numpy().astype(np.int8), err_msg=name)
        scales = ours[prefix + ".scales"]
        assert scales.dtype == torch.float16 and scales.shape == (trits.shape[0], trits.shape[1] // 128)
        assert torch.all(scales == np.float16(magnitude)), name  # one scale per tensor, fp16-rounded
    state = model.state_dict()
    for name, t in ours.items():  # everything else is copied as it is
        if not name.endswith((".qweight", ".scales")):
            assert torch.equal(t, state[name].to(t.dtype)), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "bitnet" and cfg["architectures"] == ["BitNetForCausalLM"]
    assert cfg["quantization_config"]["quant_method"] == "ternary" and cfg["quantization_config"]["group_size"] == 128
    assert ternary_rs.verify(out).ok


# ---------------------------------------------------------------------------------------------------
# the bf16 master-weight variant: only when asked, exactly as WeightQuant
# ---------------------------------------------------------------------------------------------------
def test_master_weights_are_refused_unless_asked(master, root):
    dst = root / "master-refused"
    with pytest.raises(ConversionError, match="--ternarize"):
        ternary_rs.convert(master, dst, progress=False)
    assert not dst.exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []


def test_master_ternarized_like_weight_quant(master, packed_auto, root):
    from safetensors.torch import load_file
    from transformers.integrations.bitnet import WeightQuant

    out = ternary_rs.convert(master, root / "master-conv", ternarize=True, progress=False)
    ours = read_checkpoint(out)
    src = load_file(str(master / "model.safetensors"))
    n_linear = 0
    for name, w in src.items():
        if not name.endswith(LINEAR_SUFFIXES):
            assert torch.equal(ours[name], w), name
            continue
        n_linear += 1
        served = WeightQuant.apply(w)  # transformers' own (compiled) online ternarization, in bf16
        prefix = name[: -len(".weight")]
        trits = trits_of(ours[prefix + ".qweight"])
        np.testing.assert_array_equal(trits, torch.sign(served.float()).numpy().astype(np.int8), err_msg=name)
        magnitude = served.float().abs().max()
        assert torch.all(ours[prefix + ".scales"].float() == magnitude), name
    assert n_linear == 14
    # The same model packed offline (same seed, same formula) converts to the same checkpoint.
    assert_same_values(ours, read_checkpoint(ternary_rs.convert(packed_auto, root / "auto-conv", progress=False)))
    manifest = json.loads((out / "ternary_rs.json").read_text())
    assert "ternarize" in json.dumps(manifest)


@pytest.mark.parametrize("change, match", [
    ({"quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear",
                              "quantization_mode": "offline", "use_rms_norm": True}}, "use_rms_norm"),
    ({"quantization_config": {"quant_method": "bitnet", "linear_class": "fancylinear"}}, "linear_class"),
    ({"attention_bias": True}, "bias"),
])
def test_unsupported_bitnet_settings_are_refused(change, match, packed_auto, root):
    import shutil

    d = root / f"refuse-{match}"
    shutil.copytree(packed_auto, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=match):
        ternary_rs.convert(d, root / f"refuse-{match}-out", progress=False)
    assert not (root / f"refuse-{match}-out").exists()


# ---------------------------------------------------------------------------------------------------
# bitnet.cpp-style GGUFs
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("linear_type, arch", [("I2_S", "bitnet-b1.58"), ("I2_S", "bitnet"), ("TQ2_0", "bitnet"),
                                               ("TQ1_0", "bitnet"), ("F16", "bitnet")])
def test_bitnet_cpp_gguf_converts_to_the_same_checkpoint(linear_type, arch, packed_auto, root):
    gguf_path = write_bitnet_gguf(packed_auto, root / f"auto-{linear_type}-{arch}.gguf", linear_type, arch)
    from_hf = ternary_rs.convert(packed_auto, root / f"hf-{linear_type}-{arch}", progress=False)
    from_gguf = ternary_rs.convert(gguf_path, root / f"gguf-{linear_type}-{arch}", group_size=128, progress=False)
    assert_same_values(read_checkpoint(from_hf), read_checkpoint(from_gguf))
    a = json.loads((from_hf / "config.json").read_text())
    b = json.loads((from_gguf / "config.json").read_text())
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps", "hidden_act",
                "tie_word_embeddings", "max_position_embeddings", "quantization_config"):
        assert a.get(key) == b.get(key), key
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(from_hf).rope_parameters == AutoConfig.from_pretrained(from_gguf).rope_parameters
    text = "Ternary weights take one of three values: minus one, zero or plus one."
    tokens = [AutoTokenizer.from_pretrained(d)(text).input_ids for d in (from_hf, from_gguf)]
    assert tokens[0] == tokens[1]
    # A dense (F16) file's ternary values are only seen by reading them: --scan.
    r = ternary_rs.inspect(gguf_path, scan=linear_type == "F16")
    assert r["architecture"] == arch and r["is_ternary"] and not r["problems"] and not r["warnings"]


def test_dense_ternary_gguf_with_inexact_scale_needs_ternarize(packed_auto, root):
    """llama.cpp's F32 BitNet GGUF holds ``t · a`` with an f32 ``a`` that fp16 cannot hold: kept dense, the
    model would lose BitNet's int8 activations, so it is refused unless --ternarize (trits kept, a -> fp16)."""
    odd = lambda a: a * (1 + 2.0 ** -13)  # noqa: E731 - not an fp16 value, but rounds to a's fp16 value
    gguf_path = write_bitnet_gguf(packed_auto, root / "auto-F32.gguf", "F32", "bitnet", magnitude_of=odd)
    with pytest.raises(ConversionError, match="--ternarize"):
        ternary_rs.convert(gguf_path, root / "f32-refused", progress=False)
    assert not (root / "f32-refused").exists()
    out = read_checkpoint(ternary_rs.convert(gguf_path, root / "f32-ternarized", ternarize=True, progress=False))
    assert_same_values(out, read_checkpoint(ternary_rs.convert(packed_auto, root / "f32-ref", progress=False)))


def test_hf_bitnet_to_gguf_and_back(packed_auto, root):
    """GGUF output uses llama.cpp's BitNet names (read back by gguf-py's reader) and loses nothing."""
    import gguf

    out = ternary_rs.convert(packed_auto, root / "auto.gguf", to="gguf", gguf_type="TQ2_0", progress=False)
    reader = gguf.GGUFReader(str(out))
    names = {t.name for t in reader.tensors}
    assert "blk.0.attn_sub_norm.weight" in names and "blk.1.ffn_sub_norm.weight" in names
    assert "output.weight" not in names  # tied
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "bitnet"
    back = ternary_rs.convert(out, root / "auto-back", group_size=128, progress=False)
    assert_same_values(read_checkpoint(ternary_rs.convert(packed_auto, root / "auto-direct", progress=False)),
                       read_checkpoint(back))


# ---------------------------------------------------------------------------------------------------
# inspect / verify / plan
# ---------------------------------------------------------------------------------------------------
def test_inspect_verify_plan_know_bitnet(packed_auto, master, root):
    gguf_path = write_bitnet_gguf(packed_auto, root / "plan-I2_S.gguf", "I2_S", "bitnet-b1.58")
    converted = ternary_rs.convert(packed_auto, root / "plan-conv", progress=False)
    cfg = json.loads((packed_auto / "config.json").read_text())
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv_dim = cfg["num_key_value_heads"] * hidden // cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    shapes = [(hidden, hidden), (kv_dim, hidden), (kv_dim, hidden), (hidden, hidden),
              (inter, hidden), (inter, hidden), (hidden, inter)]
    ternary_bytes = layers * sum(n * k // 4 + n * k // 128 * 2 for n, k in shapes)
    dense_params = vocab * hidden + hidden + layers * (3 * hidden + inter)  # embed, norm, 4 norms per layer
    for path in (packed_auto, gguf_path, converted, master):
        r = ternary_rs.inspect(path)
        assert r["architecture"] in ("bitnet", "bitnet-b1.58") and not r["problems"], (path, r["problems"])
        if path == master:
            assert not r["is_ternary"] and any("--ternarize" in w for w in r["warnings"])
        else:
            assert r["is_ternary"] and not r["warnings"], (path, r["warnings"])  # dense embeddings by design
            assert r["ternary"]["tensors"] == 7 * layers
        assert ternary_rs.verify(path).ok
        p = ternary_rs.plan(path, context=256, concurrency=2, gpu_memory="1GiB")
        assert p["weights"] == ternary_bytes + 2 * dense_params, path
        assert p["kv_cache_per_token"] == 2 * layers * kv_dim * 2


def test_cli_converts_master_weights_only_with_ternarize(master, root):
    dst = root / "cli-master"
    r = subprocess.run(CLI + ["convert", str(master), str(dst), "--no-progress"], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ))
    assert r.returncode == 1 and "--ternarize" in r.stderr and not dst.exists(), r.stderr
    r = subprocess.run(CLI + ["convert", str(master), str(dst), "--no-progress", "--ternarize"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert subprocess.run(CLI + ["verify", str(dst)], capture_output=True, timeout=300).returncode == 0
