"""vLLM CPU decode throughput: a ternary checkpoint vs the same weights dense in bf16, side by side.

    python benches/bench_vllm.py --preset bonsai-1.7b [--batches 1,8,16] [--tokens 64] [--eager]
        [--string-layer-names]
    python benches/bench_vllm.py [--hidden 1024 --intermediate 2816 --layers 8 ...] [--workdir DIR]

Writes a synthetic ternary Qwen3 checkpoint (random codes and fp16 scales, streamed tensor by tensor: a
1.7B model never sits in memory) in the checkpoint contract, and the same weights dequantized to a dense
bf16 Hugging Face directory; then runs each in its own vLLM process (tests/support/vllm_runner.py, bf16
activations, the same machine settings) and prints, per batch size, decode tokens/s and the
ternary/bf16 ratio, plus each engine's start-up time (model load + compile + warm-up).

``bonsai-1.7b`` is Ternary-Bonsai-1.7B's shape: Qwen3, hidden 2048, ffn 6144, 28 layers, 16/8 heads of
128, vocab 151936, tied embeddings, group 128. Tokens/s do not depend on what the weights say, so random
ones measure the same thing as the real model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

PRESETS = {
    "bonsai-1.7b": dict(hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, head_dim=128,
                        vocab=151936, tied=True, group_size=128),
    "small": dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, head_dim=64, vocab=32000,
                  tied=True, group_size=128),
}


def _linear_shapes(c: dict) -> list[tuple[str, tuple[int, int]]]:
    h, ffn, hd = c["hidden"], c["intermediate"], c["head_dim"]
    out = []
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj", (c["heads"] * hd, h)), (p + "self_attn.k_proj", (c["kv_heads"] * hd, h)),
                (p + "self_attn.v_proj", (c["kv_heads"] * hd, h)), (p + "self_attn.o_proj", (h, c["heads"] * hd)),
                (p + "mlp.gate_proj", (ffn, h)), (p + "mlp.up_proj", (ffn, h)), (p + "mlp.down_proj", (h, ffn))]
    return out


def write_synthetic(tern: Path, dense: Path | None, c: dict, seed: int = 0) -> int:
    """Both checkpoints (``dense=None``: the ternary one only), one safetensors shard per layer; returns the
    parameter count."""
    import torch
    from safetensors.torch import save_file

    from support.models import train_tokenizer

    g = c["group_size"]
    rng = np.random.default_rng(seed)
    for d in (tern, dense):
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(tern)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": c["hidden"],
        "intermediate_size": c["intermediate"], "num_hidden_layers": c["layers"],
        "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"], "head_dim": c["head_dim"],
        "vocab_size": c["vocab"], "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": c["tied"], "hidden_act": "silu", "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id, "bos_token_id": None, "torch_dtype": "bfloat16",
    }

    def ternary(n: int, k: int):
        q = rng.integers(0, 256, size=(n, k // 4), dtype=np.uint8)
        q &= ~((q & (q >> 1) & 0x55) << 1)  # no code 3
        s = rng.uniform(0.01, 0.03, size=(n, k // g)).astype(np.float16)
        codes = ((q[:, :, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(n, k).astype(np.float32)
        w = torch.from_numpy((codes - 1.0) * np.repeat(s.astype(np.float32), g, axis=1)).to(torch.bfloat16)
        return torch.from_numpy(q), torch.from_numpy(s), w

    weight_map_t, weight_map_d, params = {}, {}, 0
    groups: list[list[tuple[str, tuple]]] = [[("model.embed_tokens", (c["vocab"], c["hidden"]))]]
    linears = _linear_shapes(c)
    per_layer = 7
    groups += [linears[i:i + per_layer] for i in range(0, len(linears), per_layer)]
    for si, group in enumerate(groups):
        shard = f"model-{si + 1:05d}-of-{len(groups):05d}.safetensors"
        t_tensors, d_tensors = {}, {}
        for name, (n, k) in group:
            q, s, w = ternary(n, k)
            t_tensors[name + ".qweight"], t_tensors[name + ".scales"] = q, s
            d_tensors[name + ".weight"] = w
            params += n * k
        if si > 0:
            p = f"model.layers.{si - 1}."
            for norm, size in (("input_layernorm", c["hidden"]), ("post_attention_layernorm", c["hidden"]),
                               ("self_attn.q_norm", c["head_dim"]), ("self_attn.k_norm", c["head_dim"])):
                t_tensors[p + norm + ".weight"] = d_tensors[p + norm + ".weight"] = torch.ones(size, dtype=torch.bfloat16)
        if si == len(groups) - 1:
            t_tensors["model.norm.weight"] = d_tensors["model.norm.weight"] = torch.ones(c["hidden"], dtype=torch.bfloat16)
        save_file(t_tensors, str(tern / shard), metadata={"format": "pt"})
        if dense is not None:
            save_file(d_tensors, str(dense / shard), metadata={"format": "pt"})
        weight_map_t.update(dict.fromkeys(t_tensors, shard))
        weight_map_d.update(dict.fromkeys(d_tensors, shard))
    for d, wm, qc in ((tern, weight_map_t, True), (dense, weight_map_d, False)):
        if d is None:
            continue
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}, indent=1))
        cfg = dict(config)
        if qc:
            cfg["quantization_config"] = {"quant_method": "ternary", "format_version": 1, "group_size": g,
                                          "scale_dtype": "float16", "modules_not_converted": []}
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tern.iterdir() if dense is not None else ():
        if f.suffix in (".json", ".jinja") and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dense / f.name)
    return params


def run(model_dir: Path, out: Path, batches: str, tokens: int, eager: bool, max_len: int,
        string_layer_names: bool = False) -> dict:
    cmd = [sys.executable, str(TESTS / "support" / "vllm_runner.py"), "--model", str(model_dir), "--out", str(out),
           "--dtype", "bfloat16", "--bench-batch", batches, "--bench-tokens", str(tokens),
           "--max-model-len", str(max_len)]
    if eager:
        cmd.append("--eager")
    env = {**os.environ, "VLLM_USE_LAYERNAME": "0"} if string_layer_names else None
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        sys.exit(f"vLLM run failed for {model_dir}:\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    for key, default in PRESETS["small"].items():
        if key != "tied":
            ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {default}")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (skip torch.compile)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--only", choices=("ternary", "bf16"), default=None)
    ap.add_argument("--string-layer-names", action="store_true",
                    help="VLLM_USE_LAYERNAME=0, as `ternary-rs serve` starts vLLM: the plugin then runs the "
                         "ternary model's compiled graph through inductor's C++ wrapper (docs/cli.md)")
    args = ap.parse_args()
    c = dict(PRESETS[args.preset or "small"])
    for key in c:
        v = getattr(args, key, None)
        if v is not None:
            c[key] = v

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vllm_"))
    tern, dense = work / "ternary", work / "dense_bf16"
    if not (tern / "config.json").exists() or not (dense / "config.json").exists():
        params = write_synthetic(tern, dense, c)
    else:
        params = sum(n * k for _, (n, k) in _linear_shapes(c)) + c["vocab"] * c["hidden"]
    max_len = 512 + args.tokens
    res = {}
    for name, d in (("ternary", tern), ("bf16", dense)):
        if args.only in (None, name):
            res[name] = run(d, work / f"{name}.json", args.batches, args.tokens, args.eager, max_len,
                            args.string_layer_names)
    mode = "eager" if args.eager else "compiled" + (", C++ graph wrapper" if args.string_layer_names else "")
    print(f"vLLM CPU decode, synthetic Qwen3 {c['layers']}x{c['hidden']} (ffn {c['intermediate']}, vocab "
          f"{c['vocab']}), {params / 1e9:.2f}B linear+embedding params, g={c['group_size']}, "
          f"{args.tokens} new tokens/request, {mode}")
    for name, r in res.items():
        print(f"  {name}: engine start-up (load + compile + warm-up) {r['load_s']:.1f} s")
    if len(res) == 2:
        print(f"{'batch':>5} {'ternary tok/s':>14} {'bf16 tok/s':>11} {'ternary/bf16':>13}")
        for t, d in zip(res["ternary"]["bench"], res["bf16"]["bench"]):
            print(f"{t['batch']:>5} {t['tok_per_s']:>14.2f} {d['tok_per_s']:>11.2f} "
                  f"{t['tok_per_s'] / d['tok_per_s']:>12.2f}x")
    else:
        for name, r in res.items():
            for b in r["bench"]:
                print(f"{name} batch {b['batch']}: {b['tok_per_s']:.2f} tok/s")
    (work / "summary.json").write_text(json.dumps({"config": c, "results": res}, indent=2))


if __name__ == "__main__":
    main()
