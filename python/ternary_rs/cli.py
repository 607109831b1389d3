"""The ``ternary-rs`` command: ``convert``, ``inspect``, ``verify``, ``plan``, ``demo``.

Exit status (also in ``--help``): 0 success; 1 failure (a conversion failed, ``verify`` found a problem,
``plan`` does not fit, a file is missing or unreadable); 2 usage error; 130 interrupted (Ctrl-C or
SIGTERM; nothing half-written is left); 141 the output pipe was closed (``| head``), as other tools do.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import signal
import sys
import threading

from ._core import GROUP_SIZES, TernaryError, __version__

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 130, 141

EXIT_STATUS_HELP = """\
exit status:
  0    success
  1    failure: a conversion failed, verify found a problem, plan does not fit,
       or a file is missing or unreadable
  2    usage error (bad or missing arguments)
  130  interrupted (Ctrl-C or SIGTERM); nothing half-written is left behind
  141  the output pipe was closed (for example `ternary-rs inspect x | head`)"""

GGUF_TYPES = ("TQ2_0", "TQ1_0", "PQ2_0", "PTQ1_0", "STQ1_0")

# Library messages name Python keywords; the command line names its flags instead.
_PYTHON_TO_FLAGS = (
    (r"\bpass requantize=True\b", "pass --requantize"),
    (r"\bor ternarize\(\) to requantize\b", "or pass --requantize"),
    (r"\brequantize=True\b", "--requantize"),
    (r"\bgroup_size=(\d+)", r"--group-size \1"),
    (r"\bgroup_size\b", "--group-size"),
    (r"\bgguf_type\b", "--gguf-type"),
    (r"\bshard_size\b", "--shard-size"),
    (r"\buse_transformers=False\b", "--no-transformers"),
    (r"\bforce=True\b", "--force"),
    (r"\bdiscard_edits=True\b", "--discard-edits"),
    (r"\bgpu_memory\b", "--gpu-memory"),
    (r"\bkv_dtype\b", "--kv-dtype"),
)


def cli_wording(text: str) -> str:
    """A library message as the command line shows it: flags, not Python keywords."""
    for pattern, flag in _PYTHON_TO_FLAGS:
        text = re.sub(pattern, flag, text)
    return text


def _fail(message: str) -> int:
    print(f"ternary-rs: {cli_wording(message)}", file=sys.stderr)
    return EXIT_FAIL


# ------------------------------------------------------------------------------------------ formatting
def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _count(n: int | None) -> str:
    """Parameter counts as people say them: 812, 1.23 K, 45.6 M, 27.3 B."""
    if n is None:
        return "-"
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return str(n)


def _num(x: float | None) -> str:
    """A statistic with 5 significant digits (scales are fp16: 3-4 digits are all there is)."""
    return "-" if x is None else f"{x:.5g}"


def _print_inspect(r: dict, with_table: bool) -> None:
    c = r["config"]
    vocab = c.get("vocab_size")
    vocab_note = f" (rows of {c['vocab_size_from']})" if c.get("vocab_size_from") else ""
    print(f"{r['path']}: {r['format']}, architecture {r['architecture']}")
    print(f"  hidden {c.get('hidden_size')}, layers {c.get('num_hidden_layers')}, heads "
          f"{c.get('num_attention_heads')} / kv {c.get('num_key_value_heads')}, head_dim {c.get('head_dim')}, "
          f"ffn {c.get('intermediate_size')}, vocab {vocab}{vocab_note}, context {c.get('max_position_embeddings')}")
    print(f"  {r['tensors']} tensors, {_count(r['parameters'])} parameters, {_bytes(r['bytes'])}, "
          f"{r['bits_per_weight'] or 0:.3f} bits/weight overall"
          + (f", {r['linear_bits_per_weight']:.3f} for linear weights" if r["linear_bits_per_weight"] else ""))
    print("  by type:")
    for typ, t in sorted(r["by_type"].items(), key=lambda kv: -kv[1]["bytes"]):
        print(f"    {typ:>10}: {t['tensors']:5d} tensors {_count(t['params']):>10} params {_bytes(t['bytes']):>12}")
    t = r["ternary"]
    print(f"  ternary: {t['tensors']} tensors ({_count(t['parameters'])} params), group sizes {t['group_sizes']}")
    h = r.get("hadamard")
    if h:
        extra = f", {h['inverse_weights']} inverse-rotated" if h.get("inverse_weights") else ""
        tied = ", tied output head" if h.get("tied_output") else ""
        print(f"  Hadamard rotation ({h['source']}): block {h.get('block_size')}, {h.get('rotated_weights')} "
              f"rotated weights{extra}{tied}, version {h.get('version')}")
    if t["scales"]:
        s = t["scales"]
        print(f"  scales: {s['count']} values, min {_num(s['min'])}, max {_num(s['max'])}, mean |s| "
              f"{_num(s['mean_abs'])}, NaN {s['nan']}, Inf {s['inf']}, zero {s['zero']}")
    dense = [e for e in r.get("tensor_table", []) if e["kind"] == "dense-ternary"]
    if dense:
        sampled = f" (first {t['sampled_rows']} rows checked)" if t.get("sampled_rows") else ""
        g = min(e["group_size"] for e in dense)
        print(f"  {len(dense)} float tensors hold exactly ternary values{sampled}: `convert` stores them at "
              f"{2 + 16 / g:.3f} bits/weight (group {g})")
    if r["is_ternary"] is None:
        n = len(t["unchecked_float_linear_weights"])
        print(f"  really ternary: not checked ({n} float linear weights; --scan reads their values)")
    else:
        n = len(r.get("problems", []))
        why = f" ({n} problem{'s' if n != 1 else ''} below)" if not r["is_ternary"] and n else ""
        print(f"  really ternary: {'yes' if r['is_ternary'] else 'NO'}{why}")
    if r.get("level") == "header":
        print("  (headers only; --scan reads every byte for scale statistics and code checks)")
    for p in r.get("problems", []):
        print(f"  problem: {p}")
    for w in r.get("warnings", []):
        print(f"  warning: {w}")
    if with_table:
        _print_tensor_table(r["tensor_table"])


def _print_tensor_table(entries: list[dict]) -> None:
    rows = [(e["name"], e["type"], "x".join(map(str, e["shape"])) or "-", _count(e["params"]), _bytes(e["bytes"]),
             8 * e["bytes"] / e["params"] if e["params"] else 0.0, e["kind"], str(e["group_size"] or "-"))
            for e in entries]
    head = ("tensor", "type", "shape", "params", "bytes", "bits/w", "kind", "group")
    widths = [max(len(head[i]), *(len(str(r[i])) if i != 5 else 6 for r in rows)) for i in range(len(head))]
    print()
    print("  " + "  ".join(h.ljust(w) if i in (0, 1, 2, 6) else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for r in rows:
        cells = [r[0], r[1], r[2], r[3], r[4], f"{r[5]:.3f}", r[6], r[7]]
        print("  " + "  ".join(c.ljust(w) if i in (0, 1, 2, 6) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(cells, widths))))


def _print_plan(p: dict) -> None:
    print(f"{p['path']}: {p['architecture']}, group {p['group_size']}")
    rows = [("weights", p["weights"]), (f"KV cache ({p['context']} ctx x {p['concurrency']} seqs, "
            f"{p['kv_cache_per_token']} B/token, {p['attention_layers']} attention layers)", p["kv_cache"]),
            ("recurrent state", p["state_per_sequence"] * p["concurrency"]),
            ("activations", p["activations"]), ("runtime overhead", p["overhead"]),
            ("total", p["total"]), (f"usable ({p['gpu_memory_utilization']:.0%} of {_bytes(p['gpu_memory'])})",
                                    p["usable_memory"])]
    for name, v in rows:
        print(f"  {name:<70} {_bytes(v):>12}")
    print(f"  fits: {'yes' if p['fits'] else 'NO'} (headroom {_bytes(p['headroom'])})")
    if not p.get("weights_fit", True):
        if p["weights"] > p["usable_memory"]:
            print(f"  nothing fits: the weights alone ({_bytes(p['weights'])}) exceed the usable "
                  f"{_bytes(p['usable_memory'])}, at any context; more --gpu-memory is needed")
        else:
            print(f"  nothing fits: the weights ({_bytes(p['weights'])}) with the runtime overhead and one forward "
                  f"step's activations need {_bytes(p['fixed_memory'])} before any KV cache, more than the usable "
                  f"{_bytes(p['usable_memory'])}; more --gpu-memory is needed at any context")
    elif p["max_context_at_concurrency"] == 0 and p["max_concurrency_at_context"] == 0:
        print(f"  largest: the weights fit, but no KV cache for even one token at concurrency {p['concurrency']}")
    else:
        print(f"  largest: {p['max_total_tokens']} tokens in KV cache -> context {p['max_context_at_concurrency']} "
              f"at concurrency {p['concurrency']}, or concurrency {p['max_concurrency_at_context']} at context "
              f"{p['context']}")
    for w in p.get("warnings", []):
        print(f"  warning: {cli_wording(w)}")


# ------------------------------------------------------------------------------------------ arguments
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _size(text: str) -> str:
    from .sinks.checkpoint import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _gpu_memory(text: str) -> str:
    from .inspection.planner import parse_gpu_memory

    try:
        parse_gpu_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


class _Help(argparse.RawDescriptionHelpFormatter):
    """The default after each option that has one, examples and exit status kept as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def _para(text: str) -> str:
    """A description wrapped for the terminal (the formatter keeps descriptions as written)."""
    import textwrap

    return textwrap.fill(text, width=100)


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines) + "\n\n" + EXIT_STATUS_HELP


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ternary-rs", formatter_class=_Help,
        description=_para("Load, convert and check ternary LLM checkpoints (GGUF TQ1_0/TQ2_0/Q2_0/PQ2_0/PTQ1_0/Q1_0/"
                    "STQ1_0/I2_S, BitNet and MLX safetensors, unpacked dense ternary) for vLLM and llama.cpp."),
        epilog=_examples("ternary-rs convert model.gguf out_dir",
                         "ternary-rs inspect model.gguf",
                         "ternary-rs verify out_dir",
                         "ternary-rs plan out_dir --gpu-memory 24 --context 8192",
                         "ternary-rs <command> --help     (options of one command)"))
    ap.add_argument("--version", action="version", version=f"ternary-rs {__version__}")
    ap.add_argument("-v", "--verbose", action="store_true", help="log timings and details to stderr")
    sub = ap.add_subparsers(dest="command", required=True, metavar="command")
    # -v also after the command (`ternary-rs convert -v a b`); SUPPRESS keeps one given before it.
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log timings and details to stderr")

    c = sub.add_parser(
        "convert", formatter_class=_Help, parents=[verbose], help="convert to a vLLM directory or a ternary GGUF",
        description=_para("Convert ternary checkpoints, streaming tensor by tensor. Output goes to a hidden sibling of "
                    "DST and is renamed into place only when complete; an existing DST is replaced only with "
                    "--force and only if ternary_rs wrote it. Several sources (or a glob) make a bulk job: DST is "
                    "a folder with one output per source, failures are reported at the end."),
        epilog=_examples("ternary-rs convert model.gguf out_dir                 # -> vLLM checkpoint",
                         "ternary-rs convert hf_dir/ model-PTQ1_0.gguf --gguf-type PTQ1_0   # -> GGUF (from the name)",
                         "ternary-rs convert 'models/*.gguf' converted/          # bulk job",
                         "ternary-rs convert model.gguf out.gguf --gguf-type TQ2_0 --requantize"))
    c.add_argument("src", nargs="+", help="GGUF, safetensors, *.index.json or Hugging Face directory (several or a "
                                          "glob = bulk job)")
    c.add_argument("dst", help="output: a vLLM directory, a .gguf file, or (bulk) a folder")
    c.add_argument("--to", choices=("vllm", "gguf"), default=None,
                   help="output kind (default: gguf when DST ends in .gguf, else vllm)")
    c.add_argument("--gguf-type", choices=GGUF_TYPES, type=str.upper, default=None,
                   help="ternary GGUF type, GGUF output only (default: the source's own type when it is one of "
                        "these, else TQ2_0 when lossless, else PQ2_0)")
    c.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                   help="scale group of the vLLM checkpoint (default: the smallest group of the source)")
    c.add_argument("--requantize", action="store_true",
                   help="allow a lossy regroup (re-ternarize with absmax) when a larger group or a GGUF type "
                        "cannot hold the weights exactly (STQ1_0: llama.cpp's STQ1_0 quantizer); the output then "
                        "differs from the source")
    c.add_argument("--threads", type=_positive_int, default=None, help="worker threads (default: all cores)")
    c.add_argument("--shard-size", type=_size, default="5GB", help="largest safetensors shard (5GB = 5*10^9 bytes, "
                                                                  "2GiB = 2*2^30)")
    c.add_argument("--force", action="store_true", help="replace an existing destination that ternary_rs wrote "
                                                        "(never anything else)")
    c.add_argument("--discard-edits", action="store_true",
                   help="with --force: replace the output even where a file in it was changed since ternary_rs "
                        "wrote it (its SHA-256 no longer matches ternary_rs.json); those changes are lost")
    c.add_argument("--parents", action="store_true", help="create missing parent folders of DST")
    c.add_argument("--no-progress", action="store_true", help="no progress bar (never shown when stderr is not a "
                                                              "terminal)")
    c.add_argument("--ternarize", action="store_true",
                   help="ternarize dense float linear weights by the architecture's own convention (BitNet "
                        "master weights: per tensor by absmean, as transformers' WeightQuant); lossy, opt-in")
    c.add_argument("--no-transformers", action="store_true",
                   help="never import transformers: tokenizers the built-in rebuild does not cover (other than "
                        "byte-level BPE and Llama SentencePiece) then fail")

    i = sub.add_parser(
        "inspect", formatter_class=_Help, parents=[verbose], help="describe a checkpoint (headers only unless --scan)",
        description=_para("Format, architecture, tensor counts by type, parameters, bits per weight, group sizes, the "
                    "Hadamard rotation and config consistency, from the headers alone (fast on any size). --scan "
                    "also reads every byte: scale statistics, invalid codes, and whether float weights hold "
                    "exactly ternary values."),
        epilog=_examples("ternary-rs inspect model.gguf", "ternary-rs inspect out_dir --scan --tensors",
                         "ternary-rs inspect model.gguf --json | jq .by_type"))
    i.add_argument("path", nargs="+", help="GGUF, safetensors, *.index.json or model directory (several: one "
                                           "report each)")
    i.add_argument("--scan", action="store_true", help="read every byte for the full statistics")
    i.add_argument("--tensors", action="store_true", help="also print the per-tensor table (with --json: include it)")
    i.add_argument("--json", action="store_true", help="machine-readable output")

    v = sub.add_parser(
        "verify", formatter_class=_Help, parents=[verbose], help="check every byte; exit 1 on any problem",
        description=_para("Read every byte: NaN/Inf, all-zero or implausible scales, code 3, tensor bounds, config "
                    "consistency, the shard index, the tokenizer and (when there is a ternary_rs.json manifest) "
                    "the SHA-256 of every file. Says so when checksums could not be checked."),
        epilog=_examples("ternary-rs verify out_dir", "ternary-rs verify model.gguf --json"))
    v.add_argument("path", nargs="+", help="GGUF, safetensors, *.index.json or model directory (several: each is "
                                           "verified; exit 1 if any fails)")
    v.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser(
        "plan", formatter_class=_Help, parents=[verbose], help="memory budget for serving with vLLM; exit 1 if it does not fit",
        description=_para("Weights as vLLM holds them, KV cache, recurrent state, activations and runtime overhead "
                    "against the usable GPU memory (90%, vLLM's default), and the largest context x concurrency "
                    "that fits. GPU memory is in binary units as vendors and nvidia-smi count it: 24, 24G, 24GB "
                    "and 24GiB all mean 24 GiB."),
        epilog=_examples("ternary-rs plan out_dir", "ternary-rs plan model.gguf --gpu-memory 16 --context 32768 "
                         "--concurrency 4 --kv-dtype fp8"))
    p.add_argument("path", help="GGUF, safetensors, *.index.json or model directory")
    p.add_argument("--context", type=_positive_int, default=8192, help="tokens per sequence")
    p.add_argument("--concurrency", type=_positive_int, default=8, help="sequences served at once")
    p.add_argument("--gpu-memory", type=_gpu_memory, default="24", help="GPU memory; a bare number is GiB")
    p.add_argument("--kv-dtype", choices=("fp16", "fp8"), default="fp16", help="KV cache element type")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    s = sub.add_parser(
        "serve", formatter_class=_Help, help="convert once (cached) and start vLLM's OpenAI-compatible server",
        description=_para("Serve a ternary model (GGUF, Hugging Face / MLX directory, ternary_rs checkpoint) with "
                          "vLLM's OpenAI-compatible server. The model is converted once into a cache "
                          "($XDG_CACHE_HOME/ternary_rs); every option not listed here goes to vLLM (--host, "
                          "--port, --max-model-len, --tensor-parallel-size, ...; see python -m "
                          "vllm.entrypoints.openai.api_server --help)."),
        epilog=_examples("ternary-rs serve Bonsai-8B.gguf --port 8000 --max-model-len 8192",
                         "ternary-rs serve out_dir --dry-run"))
    s.add_argument("model", nargs="?", default="",
                   help="GGUF file (or a folder holding one), Hugging Face / MLX directory or ternary_rs checkpoint")
    s.add_argument("--cache-dir", help="cache folder (default: $XDG_CACHE_HOME/ternary_rs)")
    s.add_argument("--no-cache", action="store_true", help="convert into a temporary folder removed on exit")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--dry-run", action="store_true", help="convert (or reuse) and print the vLLM command only")
    s.add_argument("--clear-cache", action="store_true",
                   help="remove every cache entry no serve is using (then serve MODEL, if given)")
    s.add_argument("vllm_args", nargs=argparse.REMAINDER, help="options passed to vLLM's server")

    d = sub.add_parser("demo", formatter_class=_Help, parents=[verbose], help="run the whole pipeline on a small built-in example",
                       description=_para("Write a small synthetic ternary GGUF, inspect it, convert it and verify the "
                                   "result, in a few seconds; with --serve, then serve it with vLLM and print a "
                                   "completion."),
                       epilog=_examples("ternary-rs demo", "ternary-rs demo --keep /tmp/demo", "ternary-rs demo --serve"))
    d.add_argument("--keep", default=None, help="write the demo files here instead of a temporary folder")
    d.add_argument("--force", action="store_true",
                   help="with --keep: replace demo files an earlier demo wrote there (never a file of yours)")
    d.add_argument("--serve", action="store_true",
                   help="then serve the demo GGUF with `ternary-rs serve` (needs vLLM) and print a completion")
    ap.subcommands = {"convert": c, "inspect": i, "verify": v, "plan": p, "serve": s, "demo": d}
    return ap


# ------------------------------------------------------------------------------------------ commands
def _convert(args, ap: argparse.ArgumentParser) -> int:
    from .convert import BulkConversionError, convert, output_kind
    from .sinks.checkpoint import check_disjoint, describe_error

    bulk = len(args.src) > 1 or any(glob.has_magic(s) for s in args.src)
    if not bulk:  # a destination that is or holds the source is refused before anything else
        check_disjoint(args.src, args.dst)
    try:
        kind = output_kind(args.dst, args.to, bulk)
    except TernaryError as e:
        ap.error(str(e))
    if args.gguf_type and kind != "gguf":
        ap.error(f"--gguf-type {args.gguf_type} applies to GGUF output only; add --to gguf or name the "
                 "destination *.gguf")
    if args.group_size is not None and kind == "gguf":
        from .convert import GGUF_GROUP_SIZE_MESSAGE

        ap.error(cli_wording(GGUF_GROUP_SIZE_MESSAGE.format(group_size=args.group_size)))
    src = args.src if len(args.src) > 1 else args.src[0]
    try:
        out = convert(src, args.dst, to=args.to, gguf_type=args.gguf_type, group_size=args.group_size,
                      threads=args.threads, shard_size=args.shard_size, force=args.force,
                      progress=not args.no_progress, use_transformers=not args.no_transformers,
                      requantize=args.requantize, parents=args.parents,
                      ternarize=args.ternarize, discard_edits=args.discard_edits)
    except BulkConversionError as e:
        for r in e.results:
            print(f"wrote {r}")
        print(f"ternary-rs: {len(e.failures)} of {len(e.failures) + len(e.results)} conversions failed:",
              file=sys.stderr)
        for path, err in e.failures:
            print(f"  {path}: {cli_wording(describe_error(err, path))}", file=sys.stderr)
        return EXIT_FAIL
    for r in out if isinstance(out, list) else [out]:
        print(f"wrote {r}")
    return EXIT_OK


def _inspect_one(args, path: str) -> tuple[int, object]:
    from .inspection.report import inspect

    r = inspect(path, scan=args.scan)
    if args.json:
        if not args.tensors:
            r = {k: v for k, v in r.items() if k != "tensor_table"}
    else:
        _print_inspect(r, args.tensors)
    # inspect describes, and says so when what it found is wrong: a problem (the ones verify fails on)
    # exits 1, like verify and plan, so a script cannot take a broken file for a good one.
    return (EXIT_FAIL if r.get("problems") else EXIT_OK), r


def _verify_one(args, path: str) -> tuple[int, object]:
    from .inspection.report import verify

    rep = verify(path)
    if not args.json:
        print(cli_wording(str(rep)))
    return (EXIT_OK if rep.ok else EXIT_FAIL), rep.to_dict()


def _each_path(args, one) -> int:
    """inspect / verify of one or several paths: each reported (an unreadable one as an error line, and the
    others still), exit 1 if any failed. ``--json`` prints one object, or a list of them for several paths."""
    from .sinks.checkpoint import describe_error

    status, results = EXIT_OK, []
    for n, path in enumerate(args.path):
        if n and not args.json:
            print()
        try:
            rc, result = one(args, path)
        except (OSError, ValueError, KeyError, TernaryError) as e:
            if len(args.path) == 1:
                raise
            print(f"ternary-rs: {cli_wording(describe_error(e))}", file=sys.stderr)
            rc, result = EXIT_FAIL, {"path": path, "error": describe_error(e)}
        status = max(status, rc)
        results.append(result)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2, default=str))
    return status


def _run(args, ap: argparse.ArgumentParser) -> int:
    ap = getattr(ap, "subcommands", {}).get(args.command, ap)  # usage errors show the command's own usage
    if args.command == "convert":
        return _convert(args, ap)
    if args.command == "inspect":
        return _each_path(args, _inspect_one)
    if args.command == "verify":
        return _each_path(args, _verify_one)
    if args.command == "plan":
        from .inspection.planner import plan

        p = plan(args.path, context=args.context, concurrency=args.concurrency, gpu_memory=args.gpu_memory,
                 kv_dtype=args.kv_dtype)
        if args.json:
            print(json.dumps(p, indent=2))
        else:
            _print_plan(p)
        return EXIT_OK if p["fits"] else EXIT_FAIL
    if args.command == "serve":
        from .serving.serve import serve, split_args

        own = (["--cache-dir", args.cache_dir] if args.cache_dir else []) + [
            flag for flag, on in (("--no-cache", args.no_cache), ("--no-progress", args.no_progress),
                                  ("--dry-run", args.dry_run), ("--clear-cache", args.clear_cache)) if on]
        if not args.model and not args.clear_cache:
            ap.error("serve: a MODEL is required (a GGUF file, a model folder or a ternary_rs checkpoint)")
        return serve(split_args(args.model, own + list(args.vllm_args)))
    if args.command == "demo":
        from .demo import run_demo

        return EXIT_OK if run_demo(args.keep, serve=args.serve, force=args.force) else EXIT_FAIL
    return EXIT_USAGE


def _exit_interrupted(e: BaseException | None = None) -> int:
    done = list(getattr(e, "results", None) or [])
    if done:  # a bulk job: the outputs finished before the interrupt are complete and stay
        for r in done:
            print(f"wrote {r}")
        print(f"ternary-rs: interrupted while converting {e.current}; {len(done)} output"
              f"{'s' if len(done) != 1 else ''} written before it {'were' if len(done) != 1 else 'was'} kept "
              f"({', '.join(map(str, done))}), nothing of {e.current} was left behind", file=sys.stderr)
    else:
        print("ternary-rs: interrupted; no output was left behind", file=sys.stderr)
    if threading.active_count() > 1:
        # The staging output is already removed; a worker still finishing a tensor or a hash would
        # make the interpreter wait for it at exit (it joins such threads). Its work is discarded.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)
    return EXIT_INTERRUPTED


def main(argv=None) -> int:
    """Run the command (``argv`` defaults to ``sys.argv[1:]``); returns the exit status."""
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="ternary-rs: %(message)s")
    # SIGTERM takes the same clean-up path as Ctrl-C (temporary outputs are removed).
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    stdout, sys.stdout = sys.stdout, _NamedStdout(sys.stdout)
    try:
        status = _run(args, ap)
        sys.stdout.flush()  # a full disk behind `> file` fails here, not unnamed at exit
        return status
    except KeyboardInterrupt as e:
        return _exit_interrupted(e)
    except BrokenPipeError:
        # The reader went away (| head): stop quietly, and keep Python from complaining at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE
    except (OSError, ValueError, KeyError, TernaryError) as e:
        from .sinks.checkpoint import describe_error

        return _fail(describe_error(e))
    finally:
        sys.stdout = stdout
        signal.signal(signal.SIGTERM, previous)


class _NamedStdout:
    """sys.stdout whose write errors name it: ``standard output: no space left on device`` (``> /dev/full``),
    not a bare errno. A closed pipe stays a BrokenPipeError (exit 141)."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _named(self, e: OSError) -> OSError:
        return type(e)(e.errno, e.strerror, "standard output") if e.errno is not None else e

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            raise self._named(e) from None

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as e:
            raise self._named(e) from None
