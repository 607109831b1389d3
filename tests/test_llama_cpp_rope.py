"""RoPE scaling in GGUF output, against llama.cpp's own converter and in **real upstream llama.cpp**
(skipped unless ``LLAMA_CPP_BIN`` is set; see ``tests/support/llama_cpp.py``).

For each rope type ``convert_hf_to_gguf.py`` handles for ``LlamaModel`` and ``Qwen3Model`` — ``llama3``
(llama: a ``rope_freqs.weight`` tensor; qwen3: nothing), ``linear`` and ``yarn`` (keys), written both as
transformers 5 saves it (``rope_parameters``) and as transformers-4-era files do (``rope_scaling`` +
top-level ``rope_theta``, Llama-3.1's own config.json layout) — our GGUF from the Hugging Face directory
must equal the converter's TQ2_0 file key for key and byte for byte (``rope_freqs`` included), and
``llama-completion`` must print the same greedy text. Without the fix the files had no
``rope.scaling.*`` keys and no ``rope_freqs``: llama.cpp then silently runs an unscaled rope.

Also a GGUF → GGUF conversion keeps ``rope_freqs`` (it used to be dropped as "derived").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ternary_rs
from support.gguf_models import build_model
from support.llama_cpp import complete, gguf_contents, reference_convert, require_binary, require_converter

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, minus one"
REFERENCE_PRE = {"llama": "", "qwen3": "qwen2"}
OWN_KEYS = ("ternary_rs.version",)
# original_max_position_embeddings 64 with head_dim 64 and theta 5e5: llama3 factors of 1, 8 and the
# smooth ramp between them all occur.
ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
             "beta_slow": 1.0, "attention_factor": 1.2, "rope_theta": 1000000.0},
}
# (architecture, rope type, config layout): each type once per architecture, each layout for both
# rope-type spellings (``rope_type`` / ``type``), Llama-3.1's and Qwen3's own layouts included.
CASES = [("llama", "llama3", "rope_parameters"), ("llama", "llama3", "rope_scaling"),
         ("llama", "linear", "rope_scaling"), ("llama", "yarn", "rope_parameters"),
         ("qwen3", "yarn", "rope_scaling"), ("qwen3", "linear", "rope_parameters"),
         ("qwen3", "llama3", "rope_parameters")]


def _to_transformers4_layout(hf: Path) -> None:
    """``rope_parameters`` -> ``rope_scaling`` (``type`` for linear/yarn, as old files spell it) plus a
    top-level ``rope_theta``."""
    config = json.loads((hf / "config.json").read_text())
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    if params["rope_type"] in ("linear", "yarn"):
        params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params
    (hf / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    require_binary()
    require_converter()
    return tmp_path_factory.mktemp("rope")


def _assert_same_file(ours: Path, ref: Path) -> dict:
    meta_o, tens_o = gguf_contents(ours)
    meta_r, tens_r = gguf_contents(ref)
    diff = {k for k in set(meta_o) | set(meta_r) if k not in OWN_KEYS and meta_o.get(k) != meta_r.get(k)}
    assert not diff, {k: (str(meta_r.get(k))[:200], str(meta_o.get(k))[:200]) for k in sorted(diff)}
    assert tens_o.keys() == tens_r.keys()
    for name in tens_r:
        assert tens_o[name][:2] == tens_r[name][:2], name
        assert tens_o[name][2] == tens_r[name][2], f"{name}: bytes differ"
    return {"meta": meta_o, "tensors": tens_o}


@pytest.mark.parametrize("arch,rope,layout", CASES)
def test_rope_scaling_matches_llama_cpp_converter(root, arch, rope, layout):
    name = f"{arch}-{rope}-{layout}"
    hf = build_model(root / name / "hf", arch, config_extra={"rope_parameters": dict(ROPES[rope])})
    if layout == "rope_scaling":
        _to_transformers4_layout(hf)
    ref = reference_convert(hf, root / name / "ref.gguf", "tq2_0", REFERENCE_PRE[arch])
    ours = root / name / "ours.gguf"
    ternary_rs.convert(hf, ours, to="gguf", gguf_type="TQ2_0", progress=False)
    got = _assert_same_file(ours, ref)
    meta, tensors = got["meta"], got["tensors"]
    # the converter wrote what we expect it to (so the equality above is about rope scaling)
    if rope == "llama3":
        assert ("rope_freqs.weight" in tensors) is (arch == "llama")
        assert f"{arch}.rope.scaling.type" not in meta
    else:
        assert meta[f"{arch}.rope.scaling.type"][1] == rope
        assert meta[f"{arch}.rope.scaling.factor"][1] == ROPES[rope]["factor"]
    if rope == "yarn":
        assert meta[f"{arch}.rope.scaling.original_context_length"][1] == 128
        assert meta[f"{arch}.rope.scaling.yarn_attn_factor"][1] == pytest.approx(1.2)
    assert complete(ours, PROMPT) == complete(ref, PROMPT)


def test_gguf_to_gguf_keeps_rope_freqs(root):
    hf = build_model(root / "g2g" / "hf", "llama", config_extra={"rope_parameters": dict(ROPES["llama3"])})
    ref = reference_convert(hf, root / "g2g" / "ref.gguf", "tq2_0")
    assert "rope_freqs.weight" in gguf_contents(ref)[1]
    back = root / "g2g" / "back.gguf"
    ternary_rs.convert(ref, back, to="gguf", gguf_type="TQ2_0", progress=False)
    _assert_same_file(back, ref)
    assert complete(back, PROMPT) == complete(ref, PROMPT)
