"""vLLM CPU decode throughput: ternary checkpoint vs the same weights dense in bf16, side by side.

    python benches/bench_vllm.py [--hidden 1024 --intermediate 2816 --layers 8] [--batches 1,16]
                                 [--tokens 64] [--eager] [--workdir DIR]

Builds a synthetic ternarized Qwen3 (tests/models.py), writes its ternary checkpoint with the independent
contract writer (tests/contract_writer.py), and a dense bf16 HF directory by dequantizing that checkpoint
with NumPy; then runs each in its own vLLM process (tests/vllm_runner.py, bf16 activations) and prints
decode tokens/s per batch size and the ternary/bf16 ratio. Both runs use the same machine settings.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from contract_writer import dequantize, write_contract
from models import build_tiny_model


def write_dense_bf16(ternary_dir: Path, out_dir: Path) -> Path:
    """HF bf16 checkpoint with every ternary tensor dequantized (W = (c - 1) · scale)."""
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((ternary_dir / "config.json").read_text())
    g = config.pop("quantization_config")["group_size"]
    config["torch_dtype"] = "bfloat16"
    tensors = {}
    for f in sorted(ternary_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    dense = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            w = dequantize(t, tensors[prefix + ".scales"], g)
            dense[prefix + ".weight"] = torch.from_numpy(w).to(torch.bfloat16)
        elif not name.endswith(".scales"):
            dense[name] = torch.from_numpy(np.asarray(t, dtype=np.float32)).to(torch.bfloat16)
    save_file(dense, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in ternary_dir.iterdir():
        if f.suffix in (".json", ".jinja") and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out_dir / f.name)
    return out_dir


def run(model_dir: Path, out: Path, batches: str, tokens: int, eager: bool) -> list[dict]:
    cmd = [sys.executable, str(TESTS / "vllm_runner.py"), "--model", str(model_dir), "--out", str(out),
           "--dtype", "bfloat16", "--bench-batch", batches, "--bench-tokens", str(tokens), "--max-model-len", "512"]
    if eager:
        cmd.append("--eager")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"vLLM run failed for {model_dir}:\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())["bench"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (skip torch.compile)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vllm_"))
    hf, tern, dense = work / "hf", work / "ternary", work / "dense_bf16"
    heads = args.hidden // 64
    if not (tern / "config.json").exists():
        build_tiny_model(hf, group_size=args.group_size, hidden=args.hidden, intermediate=args.intermediate,
                         layers=args.layers, heads=heads, kv_heads=max(1, heads // 4), head_dim=64)
        write_contract(hf, tern, group_size=args.group_size)
        write_dense_bf16(tern, dense)

    params = sum(np.prod(v["shape"]) for v in _header_shapes(dense).values())
    ternary = run(tern, work / "ternary.json", args.batches, args.tokens, args.eager)
    bf16 = run(dense, work / "dense.json", args.batches, args.tokens, args.eager)
    mode = "eager" if args.eager else "compiled"
    print(f"vLLM CPU decode, synthetic Qwen3 {args.layers}x{args.hidden} (ffn {args.intermediate}), "
          f"{params / 1e6:.0f}M params, g={args.group_size}, {args.tokens} new tokens/request, {mode}")
    print(f"{'batch':>5} {'ternary tok/s':>14} {'bf16 tok/s':>11} {'ternary/bf16':>13}")
    for t, d in zip(ternary, bf16):
        print(f"{t['batch']:>5} {t['tok_per_s']:>14.1f} {d['tok_per_s']:>11.1f} {t['tok_per_s'] / d['tok_per_s']:>12.2f}x")


def _header_shapes(model_dir: Path) -> dict:
    import struct

    shapes = {}
    for f in model_dir.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        shapes.update({k: v for k, v in header.items() if k != "__metadata__"})
    return shapes


if __name__ == "__main__":
    main()
