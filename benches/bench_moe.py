"""vLLM CPU decode of a ternary Mixture-of-Experts vs the same MoE in bf16 (and llama.cpp on its GGUF).

    python benches/bench_moe.py [--preset a3b-like|small] [--batches 1,8] [--tokens 64] [--eager]
        [--hidden 2048 --experts 32 --top-k 4 --expert-ffn 768 --layers 8 ...] [--workdir DIR]

Writes a synthetic ``Qwen3MoeForCausalLM`` — random ternary codes and fp16 scales (group 256) for every linear,
experts included, a dense bf16 router, tied ternary embeddings — as a ternary_rs checkpoint (one
``qweight``/``scales`` pair per expert), the same weights dequantized to a dense bf16 Hugging Face directory
and, when ``LLAMA_CPP_BIN`` names a llama.cpp build, a ``qwen3moe`` TQ2_0 GGUF (experts stacked as
llama.cpp stacks them; the same bytes). Each runs in its own vLLM process (tests/support/vllm_runner.py, bf16
activations); llama.cpp runs ``llama-bench -p 0 -n TOKENS`` (batch 1) with as many threads.

Printed per batch size (best of ``--repeats`` timed runs): decode tokens/s of each and the ternary/bf16
ratio; for batch 1 the bytes of weights a token reads (the experts actually routed to — ``top_k`` of them per layer — and all active
weights: experts + attention + router + lm_head) and the rate they are read at as a fraction of the
streaming read bandwidth measured in the same run (``torch.sum`` over 1 GiB, as benches/bench_cpu_op.py):
how close each engine is to the memory bound. Tokens/s do not depend on what the weights say, so random
ones measure what a trained model would; the router is random, so tokens spread over the experts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(ROOT / "benches"))

GROUP = 256  # TQ2_0's block: the GGUF holds the same weights
PRESETS = {
    # Qwen3-30B-A3B's per-layer expert shape at a third of its experts and a sixth of its layers (fits in RAM here).
    "a3b-like": dict(hidden=2048, experts=32, top_k=4, expert_ffn=768, layers=8, heads=16, kv_heads=4, head_dim=128,
                     vocab=32000),
    "small": dict(hidden=512, experts=8, top_k=2, expert_ffn=256, layers=2, heads=8, kv_heads=2, head_dim=64,
                  vocab=4096),
}


def _ternary(rng, n: int, k: int):
    """Random canonical ternary weight (no code 3) and its bf16 dequantization."""
    import torch

    q = rng.integers(0, 256, size=(n, k // 4), dtype=np.uint8)
    q &= ~((q & (q >> 1) & 0x55) << 1)
    s = rng.uniform(0.01, 0.03, size=(n, k // GROUP)).astype(np.float16)
    codes = ((q[:, :, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(n, k).astype(np.float32)
    w = torch.from_numpy((codes - 1.0) * np.repeat(s.astype(np.float32), GROUP, axis=1)).to(torch.bfloat16)
    return q, s, w


def _tq2(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """TQ2_0 blocks of a canonical weight, as the byte rows gguf-py's writer takes ([N, K/256·66])."""
    import ternary_rs

    data = ternary_rs.encode(ternary_rs.TernaryTensor(q, s, GROUP), "TQ2_0")
    return np.frombuffer(memoryview(data), dtype=np.uint8).reshape(q.shape[0], -1)


def write_synthetic(tern: Path, dense: Path, gguf_path: Path | None, c: dict, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file

    from support.gguf_models import train_qwen2_tokenizer

    rng = np.random.default_rng(seed)
    for d in (tern, dense):
        d.mkdir(parents=True, exist_ok=True)
    train_qwen2_tokenizer(tern)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tern))
    h, e_ffn, hd = c["hidden"], c["expert_ffn"], c["head_dim"]
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": h,
        "intermediate_size": 3 * h, "moe_intermediate_size": e_ffn, "num_experts": c["experts"],
        "num_experts_per_tok": c["top_k"], "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"],
        "head_dim": hd, "vocab_size": c["vocab"], "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "tie_word_embeddings": True, "hidden_act": "silu", "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id, "bos_token_id": None, "torch_dtype": "bfloat16",
    }
    typed = []  # GGUF tensors, llama.cpp's names
    import gguf

    tq2, f32 = gguf.GGMLQuantizationType.TQ2_0, gguf.GGMLQuantizationType.F32
    weight_map_t, weight_map_d = {}, {}
    shards = c["layers"] + 1
    for si in range(shards):
        shard = f"model-{si + 1:05d}-of-{shards:05d}.safetensors"
        t_tensors, d_tensors = {}, {}

        def ternary(name, n, k, t_tensors=t_tensors, d_tensors=d_tensors):
            q, s, w = _ternary(rng, n, k)
            t_tensors[name + ".qweight"], t_tensors[name + ".scales"] = torch.from_numpy(q), torch.from_numpy(s)
            d_tensors[name + ".weight"] = w
            return q, s

        if si == 0:
            q, s = ternary("model.embed_tokens", c["vocab"], h)
            typed.append(("token_embd.weight", _tq2(q, s), tq2))
            t_tensors["model.norm.weight"] = d_tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
            typed.append(("output_norm.weight", np.ones(h, np.float32), f32))
        else:
            i = si - 1
            p = f"model.layers.{i}."
            q_rows, kv_rows = c["heads"] * hd, c["kv_heads"] * hd
            for proj, gname, n, k in (("q_proj", "attn_q", q_rows, h), ("k_proj", "attn_k", kv_rows, h),
                                      ("v_proj", "attn_v", kv_rows, h), ("o_proj", "attn_output", h, q_rows)):
                typed.append((f"blk.{i}.{gname}.weight", _tq2(*ternary(p + "self_attn." + proj, n, k)), tq2))
            stacks: dict[str, list] = {"gate_proj": [], "up_proj": [], "down_proj": []}
            for e in range(c["experts"]):
                for proj, (n, k) in (("gate_proj", (e_ffn, h)), ("up_proj", (e_ffn, h)), ("down_proj", (h, e_ffn))):
                    stacks[proj].append(_tq2(*ternary(f"{p}mlp.experts.{e}.{proj}", n, k)))
            for proj in stacks:  # llama.cpp's ffn_{gate,up,down}_exps: [n_expert, N, K/256·66] bytes
                typed.append((f"blk.{i}.ffn_{proj[:-len('_proj')]}_exps.weight", np.stack(stacks[proj]), tq2))
            router = torch.from_numpy(rng.standard_normal((c["experts"], h)).astype(np.float32) * 0.02)
            router = router.to(torch.bfloat16)
            t_tensors[p + "mlp.gate.weight"] = d_tensors[p + "mlp.gate.weight"] = router
            typed.append((f"blk.{i}.ffn_gate_inp.weight", router.float().numpy(), f32))
            for norm, gname, size in (("input_layernorm", "attn_norm", h), ("post_attention_layernorm", "ffn_norm", h),
                                      ("self_attn.q_norm", "attn_q_norm", hd), ("self_attn.k_norm", "attn_k_norm", hd)):
                ones = torch.ones(size, dtype=torch.bfloat16)
                t_tensors[p + norm + ".weight"] = d_tensors[p + norm + ".weight"] = ones
                typed.append((f"blk.{i}.{gname}.weight", np.ones(size, np.float32), f32))
        save_file(t_tensors, str(tern / shard), metadata={"format": "pt"})
        save_file(d_tensors, str(dense / shard), metadata={"format": "pt"})
        weight_map_t.update(dict.fromkeys(t_tensors, shard))
        weight_map_d.update(dict.fromkeys(d_tensors, shard))
    for d, wm, qc in ((tern, weight_map_t, True), (dense, weight_map_d, False)):
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}, indent=1))
        cfg = dict(config)
        if qc:
            cfg["quantization_config"] = {"quant_method": "ternary", "format_version": 1, "group_size": GROUP,
                                          "scale_dtype": "float16", "modules_not_converted": []}
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tern.iterdir():
        if f.suffix in (".json", ".jinja") and f.name not in ("config.json", "model.safetensors.index.json"):
            (dense / f.name).write_bytes(f.read_bytes())
    if gguf_path is not None:
        from support.moe_model import write_gguf_tensors

        write_gguf_tensors(tern, config, typed, gguf_path)


def bytes_per_token(c: dict) -> dict[str, dict[str, float]]:
    """Weight bytes one decoded token reads (batch 1): the routed experts, and all active weights."""
    h, f, hd, L = c["hidden"], c["expert_ffn"], c["head_dim"], c["layers"]
    tern = lambda n, k: n * k / 4 + n * (k // GROUP) * 2  # noqa: E731  codes + fp16 scales
    bf16 = lambda n, k: n * k * 2  # noqa: E731
    attn = [(c["heads"] * hd, h), (c["kv_heads"] * hd, h), (c["kv_heads"] * hd, h), (h, c["heads"] * hd)]
    out = {}
    for name, size in (("ternary", tern), ("bf16", bf16)):
        experts = L * c["top_k"] * (2 * size(f, h) + size(h, f))
        rest = L * (sum(size(n, k) for n, k in attn) + bf16(c["experts"], h)) + size(c["vocab"], h)
        out[name] = {"experts": experts, "all": experts + rest}
    return out


def run_vllm(model_dir: Path, out: Path, batches: str, tokens: int, eager: bool, repeats: int) -> dict:
    """One engine; every batch size timed ``repeats`` times, the best run kept (a shared machine's noise
    only ever slows a run down)."""
    sizes = [int(b) for b in batches.split(",")]
    cmd = [sys.executable, str(TESTS / "support" / "vllm_runner.py"), "--model", str(model_dir), "--out", str(out),
           "--dtype", "bfloat16", "--bench-batch", ",".join(str(b) for b in sizes for _ in range(repeats)),
           "--bench-tokens", str(tokens), "--max-model-len", str(512 + tokens)]
    if eager:
        cmd.append("--eager")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"vLLM run failed for {model_dir}:\n{proc.stderr[-6000:]}")
    result = json.loads(out.read_text())
    result["runs"] = result["bench"]
    result["bench"] = [max((r for r in result["runs"] if r["batch"] == b), key=lambda r: r["tok_per_s"]) for b in sizes]
    return result


def run_llama_bench(gguf_path: Path, tokens: int, threads: int) -> float | None:
    exe = Path(os.environ["LLAMA_CPP_BIN"]) / "llama-bench"
    proc = subprocess.run([str(exe), "-m", str(gguf_path), "-p", "0", "-n", str(tokens), "-t", str(threads),
                           "-r", "3", "-o", "json"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"llama-bench failed ({proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
        return None
    runs = json.loads(proc.stdout[proc.stdout.index("["):])
    return float(runs[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="a3b-like")
    for key, default in PRESETS["a3b-like"].items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"a3b-like: {default}")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (the best is printed)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (skip torch.compile)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    c = dict(PRESETS[args.preset])
    for key in c:
        v = getattr(args, key, None)
        if v is not None:
            c[key] = v
    if c["hidden"] % GROUP or c["expert_ffn"] % GROUP or (c["heads"] * c["head_dim"]) % GROUP:
        sys.exit(f"hidden, expert-ffn and heads*head-dim must be multiples of {GROUP} (TQ2_0 blocks)")

    from bench_cpu_op import stream_bandwidth

    threads = len(os.sched_getaffinity(0))
    bandwidth = stream_bandwidth(threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_moe_"))
    tern, dense, gguf_path = work / "ternary", work / "dense_bf16", work / "moe-TQ2_0.gguf"
    with_llama = bool(os.environ.get("LLAMA_CPP_BIN"))
    if not (tern / "config.json").exists() or (with_llama and not gguf_path.exists()):
        write_synthetic(tern, dense, gguf_path if with_llama else None, c)
    res = {name: run_vllm(d, work / f"{name}.json", args.batches, args.tokens, args.eager, args.repeats)
           for name, d in (("ternary", tern), ("bf16", dense))}
    llama = run_llama_bench(gguf_path, args.tokens, threads) if with_llama else None

    mode = "eager" if args.eager else "compiled"
    active = c["layers"] * (c["top_k"] * 3 * c["expert_ffn"] * c["hidden"])
    print(f"vLLM CPU decode, synthetic Qwen3-MoE {c['layers']} layers x hidden {c['hidden']}, {c['experts']} experts "
          f"(top-{c['top_k']}, expert ffn {c['expert_ffn']}), heads {c['heads']}/{c['kv_heads']}x{c['head_dim']}, "
          f"vocab {c['vocab']} (tied), g={GROUP}; {active / 1e6:.0f}M routed expert params/token; {args.tokens} new "
          f"tokens/request, {mode}, {threads} threads")
    print(f"streaming read bandwidth ({threads} threads): {bandwidth:.1f} GB/s")
    for name, r in res.items():
        print(f"  {name}: engine start-up (load + compile + warm-up) {r['load_s']:.1f} s")
    llama_col = f" {'llama.cpp tok/s':>16}" if with_llama else ""
    print(f"{'batch':>5} {'ternary tok/s':>14} {'bf16 tok/s':>11} {'ternary/bf16':>13}{llama_col}")
    for t, d in zip(res["ternary"]["bench"], res["bf16"]["bench"]):
        extra = ""
        if with_llama:
            extra = f" {llama:>16.2f}" if t["batch"] == 1 and llama is not None else f" {'-':>16}"
        ratio = t["tok_per_s"] / d["tok_per_s"]
        print(f"{t['batch']:>5} {t['tok_per_s']:>14.2f} {d['tok_per_s']:>11.2f} {ratio:>12.2f}x{extra}")
    per_token = bytes_per_token(c)
    one = {name: next((b["tok_per_s"] for b in r["bench"] if b["batch"] == 1), None) for name, r in res.items()}
    if llama is not None:
        one["llama.cpp"], per_token["llama.cpp"] = llama, per_token["ternary"]  # TQ2_0: 2.06 bits, as ours
    print("batch 1, weight bytes read per token and their read rate vs the streaming bandwidth:")
    for name, rate in one.items():
        if rate is None:
            continue
        b = per_token[name]
        print(f"  {name:>9}: experts {b['experts'] / 1e6:7.1f} MB/token -> {b['experts'] * rate / 1e9:6.2f} GB/s "
              f"({100 * b['experts'] * rate / 1e9 / bandwidth:5.1f} %); all active {b['all'] / 1e6:7.1f} MB/token -> "
              f"{b['all'] * rate / 1e9:6.2f} GB/s ({100 * b['all'] * rate / 1e9 / bandwidth:5.1f} %)")
    (work / "summary.json").write_text(json.dumps(
        {"config": c, "bandwidth_GBps": bandwidth, "results": res, "llama_cpp_tok_per_s": llama,
         "bytes_per_token": per_token}, indent=2))
    print(f"(files in {work})")


if __name__ == "__main__":
    main()
