"""The ``ternary-rs`` command: ``convert``, ``inspect``, ``verify``, ``plan``, ``demo``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from ._core import GROUP_SIZES

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _print_inspect(r: dict) -> None:
    c = r["config"]
    print(f"{r['path']}: {r['format']}, architecture {r['architecture']}")
    print(f"  hidden {c.get('hidden_size')}, layers {c.get('num_hidden_layers')}, heads "
          f"{c.get('num_attention_heads')} / kv {c.get('num_key_value_heads')}, head_dim {c.get('head_dim')}, "
          f"ffn {c.get('intermediate_size')}, vocab {c.get('vocab_size')}")
    print(f"  {r['tensors']} tensors, {r['parameters'] / 1e9:.3f} B parameters, {_human(r['bytes'])}, "
          f"{r['bits_per_weight'] or 0:.3f} bits/weight overall"
          + (f", {r['linear_bits_per_weight']:.3f} for linear weights" if r["linear_bits_per_weight"] else ""))
    print("  by type:")
    for typ, t in sorted(r["by_type"].items(), key=lambda kv: -kv[1]["bytes"]):
        print(f"    {typ:>10}: {t['tensors']:5d} tensors {t['params'] / 1e6:12.2f} M params {_human(t['bytes']):>12}")
    t = r["ternary"]
    print(f"  ternary: {t['tensors']} tensors ({t['parameters'] / 1e6:.2f} M params), group sizes {t['group_sizes']}")
    if t["scales"]:
        s = t["scales"]
        print(f"  scales: {s['count']} values, min {s['min']}, max {s['max']}, mean |s| {s['mean_abs']}, "
              f"NaN {s['nan']}, Inf {s['inf']}, zero {s['zero']}")
    dense = [e for e in r.get("tensor_table", []) if e["kind"] == "dense-ternary"]
    if dense:
        sampled = f" (first {t['sampled_rows']} rows checked)" if t.get("sampled_rows") else ""
        g = min(e["group_size"] for e in dense)
        print(f"  {len(dense)} float tensors hold exactly ternary values{sampled}: `convert` stores them at "
              f"{2 + 16 / g:.3f} bits/weight (group {g})")
    print(f"  really ternary: {'yes' if r['is_ternary'] else 'NO'}")
    for p in r.get("problems", []):
        print(f"  problem: {p}")
    for w in r.get("warnings", []):
        print(f"  warning: {w}")


def _print_plan(p: dict) -> None:
    print(f"{p['path']}: {p['architecture']}, group {p['group_size']}")
    rows = [("weights", p["weights"]), (f"KV cache ({p['context']} ctx x {p['concurrency']} seqs, "
            f"{p['kv_cache_per_token']} B/token, {p['attention_layers']} attention layers)", p["kv_cache"]),
            ("recurrent state", p["state_per_sequence"] * p["concurrency"]),
            ("activations", p["activations"]), ("runtime overhead", p["overhead"]),
            ("total", p["total"]), (f"usable ({p['gpu_memory_utilization']:.0%} of {_human(p['gpu_memory'])})",
                                    p["usable_memory"])]
    for name, v in rows:
        print(f"  {name:<70} {_human(v):>12}")
    print(f"  fits: {'yes' if p['fits'] else 'NO'} (headroom {_human(p['headroom'])})")
    print(f"  largest: {p['max_total_tokens']} tokens in KV cache -> context {p['max_context_at_concurrency']} at "
          f"concurrency {p['concurrency']}, or concurrency {p['max_concurrency_at_context']} at context {p['context']}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ternary-rs", description="Load, convert and check ternary LLM checkpoints.")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert to a vLLM directory or a ternary GGUF")
    c.add_argument("src", nargs="+", help="GGUF, safetensors, *.index.json or HF directory (several or a glob = bulk)")
    c.add_argument("dst", help="output directory / GGUF file (bulk: a folder)")
    c.add_argument("--to", choices=("vllm", "gguf"), default="vllm")
    c.add_argument("--gguf-type", choices=("TQ2_0", "TQ1_0", "PQ2_0", "PTQ1_0"), type=str.upper)
    c.add_argument("--group-size", type=int, choices=GROUP_SIZES)
    c.add_argument("--threads", type=int)
    c.add_argument("--shard-size", default="5GB")
    c.add_argument("--force", action="store_true", help="replace an existing destination")
    c.add_argument("--no-progress", action="store_true")
    c.add_argument("--ternarize", action="store_true",
                   help="ternarize dense float linear weights by the architecture's own convention (BitNet "
                        "master weights: per tensor by absmean, as transformers' WeightQuant); lossy, opt-in")
    c.add_argument("--no-transformers", action="store_true",
                   help="GGUF sources: rebuild config.json/tokenizer with the built-in mapping instead of "
                        "transformers' GGUF loader (faster start; gpt2 BPE tokenizers only)")

    i = sub.add_parser("inspect", help="describe a checkpoint")
    i.add_argument("path")
    i.add_argument("--json", action="store_true")
    i.add_argument("--tensors", action="store_true", help="with --json: include the per-tensor table")

    v = sub.add_parser("verify", help="check every byte; non-zero exit on any problem")
    v.add_argument("path")
    v.add_argument("--json", action="store_true")

    p = sub.add_parser("plan", help="memory budget for serving")
    p.add_argument("path")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--gpu-memory", default="24GiB")
    p.add_argument("--kv-dtype", choices=("fp16", "fp8"), default="fp16")
    p.add_argument("--json", action="store_true")

    d = sub.add_parser("demo", help="run the whole pipeline on a small built-in example")
    d.add_argument("--keep", help="write the demo files here instead of a temporary folder")
    return ap


def _run(args) -> int:
    import importlib

    # the package's ``convert`` attribute is the function; the module holds the rest
    conv = importlib.import_module("ternary_rs.convert")

    if args.command == "convert":
        src = args.src if len(args.src) > 1 else args.src[0]
        try:
            out = conv.convert(src, args.dst, to=args.to, gguf_type=args.gguf_type, group_size=args.group_size,
                               threads=args.threads, shard_size=args.shard_size, force=args.force,
                               progress=not args.no_progress, use_transformers=not args.no_transformers,
                               ternarize=args.ternarize)
        except conv.BulkConversionError as e:
            for r in e.results:
                print(f"wrote {r}")
            print(f"ternary-rs: {e}", file=sys.stderr)
            return EXIT_FAIL
        for r in out if isinstance(out, list) else [out]:
            print(f"wrote {r}")
        return EXIT_OK
    if args.command == "inspect":
        r = conv.inspect(args.path)
        if args.json:
            if not args.tensors:
                r = {k: v for k, v in r.items() if k != "tensor_table"}
            print(json.dumps(r, indent=2, default=str))
        else:
            _print_inspect(r)
        return EXIT_OK
    if args.command == "verify":
        rep = conv.verify(args.path)
        print(json.dumps(rep.to_dict(), indent=2) if args.json else str(rep))
        return EXIT_OK if rep.ok else EXIT_FAIL
    if args.command == "plan":
        p = conv.plan(args.path, context=args.context, concurrency=args.concurrency,
                      gpu_memory=args.gpu_memory, kv_dtype=args.kv_dtype)
        print(json.dumps(p, indent=2)) if args.json else _print_plan(p)
        return EXIT_OK
    if args.command == "demo":
        from .demo import run_demo

        return EXIT_OK if run_demo(args.keep) else EXIT_FAIL
    return EXIT_USAGE


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="ternary-rs: %(message)s")
    # SIGTERM takes the same clean-up path as Ctrl-C (temporary outputs are removed).
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("ternary-rs: interrupted; no output was left behind", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"ternary-rs: {e}", file=sys.stderr)
        return EXIT_FAIL
    except Exception as e:  # noqa: BLE001 - TernaryError and friends: one clear line, no traceback
        from ._core import TernaryError

        if isinstance(e, TernaryError) or isinstance(e, OSError):
            print(f"ternary-rs: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_FAIL
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
