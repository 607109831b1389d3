"""plan: numbers checked against the arithmetic written out here for the tiny Qwen3 shape."""

from __future__ import annotations

import json

import pytest

import ternary_rs
from support.models import build_tiny_model

pytest.importorskip("torch")

GiB = 2**30


@pytest.fixture(scope="module")
def vllm_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    build_tiny_model(root / "hf", arch="qwen3", group_size=128)
    out = root / "vllm"
    ternary_rs.convert(root / "hf", out, progress=False)
    return out


def _expected_weights(vocab: int, g: int = 128) -> int:
    hidden, inter, layers, head_dim = 256, 512, 2, 64
    linear = [(vocab, hidden), (vocab, hidden)]  # embed_tokens, lm_head (ternary)
    for _ in range(layers):
        linear += [(256, hidden), (128, hidden), (128, hidden), (hidden, 256),  # q k v o
                   (inter, hidden), (inter, hidden), (hidden, inter)]             # gate up down
    ternary = sum(n * k // 4 + n * (k // g) * 2 for n, k in linear)
    norms = layers * (2 * hidden + 2 * head_dim) + hidden  # fp16 params, 2 bytes each
    return ternary + 2 * norms


def test_plan_matches_hand_arithmetic(vllm_dir):
    vocab = json.loads((vllm_dir / "config.json").read_text())["vocab_size"]
    p = ternary_rs.plan(vllm_dir, context=4096, concurrency=3, gpu_memory="2GiB", kv_dtype="fp16")
    assert p["weights"] == _expected_weights(vocab)
    kv_per_token = 2 * 2 * 2 * 64 * 2          # K+V · layers · kv_heads · head_dim · fp16
    assert p["kv_cache_per_token"] == kv_per_token == 1024
    assert p["kv_cache"] == kv_per_token * 4096 * 3
    act_fixed = 8192 * (4 * 256 + 2 * 512 + 4 * 64 + 2 * 2 * 64) * 2
    assert p["activations"] == act_fixed + 3 * vocab * 8
    usable = int(2 * GiB * 0.9)
    total = p["weights"] + GiB + p["activations"] + p["kv_cache"]
    assert p["usable_memory"] == usable and p["total"] == total
    assert p["fits"] == (total <= usable)
    free = usable - p["weights"] - GiB - act_fixed
    assert p["max_total_tokens"] == (free - 3 * vocab * 8) // kv_per_token
    assert p["max_context_at_concurrency"] == min(p["max_total_tokens"] // 3, 512)  # max_position_embeddings
    assert p["max_concurrency_at_context"] == free // (kv_per_token * 4096 + vocab * 8)
    fp8 = ternary_rs.plan(vllm_dir, context=4096, concurrency=3, gpu_memory="2GiB", kv_dtype="fp8")
    assert fp8["kv_cache_per_token"] == 512
    small = ternary_rs.plan(vllm_dir, context=4096, concurrency=3, gpu_memory="1GiB")
    assert not small["fits"] and small["max_total_tokens"] == 0


def test_plan_hybrid_counts_only_attention_layers(vllm_dir, tmp_path):
    import shutil

    d = tmp_path / "hybrid"
    shutil.copytree(vllm_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    (d / "config.json").write_text(json.dumps(cfg))
    p = ternary_rs.plan(d, context=1000, concurrency=2, gpu_memory="80GB")
    assert p["attention_layers"] == 1
    assert p["kv_cache_per_token"] == 2 * 1 * 2 * 64 * 2
    state = 1 * (4 * 32 * 16 * 4 + (4 - 1) * (2 * 2 * 32 + 4 * 16) * 2)
    assert p["state_per_sequence"] == state
    assert p["fits"]
