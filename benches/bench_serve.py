"""Serving under concurrency: ``ternary-rs serve`` (vLLM) vs upstream ``llama-server`` on the same GGUF.

    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin python benches/bench_serve.py [--preset 1.7b|27b]
        [--gguf FILE] [--clients 1,16,64] [--tokens 64] [--seconds 60] [--long-prompt 2048]
        [--workdir DIR] [--only ours|llama]

1. The model: ``--gguf FILE``, or a synthetic one of the preset's shape (random ternary codes; decode speed
   does not depend on what the weights say), written once into ``--workdir`` and reused:
   ``1.7b`` = Ternary-Bonsai-1.7B's shape (qwen3, hidden 2048, 28 layers; benches/bench_vllm.py's
   checkpoint converted with ``ternary-rs convert --to gguf --gguf-type TQ2_0``); ``27b`` = Bonsai 2's
   shape without the rotation (qwen35, hidden 5120, 64 layers, vocab 248 320; benches/bench_27b.py's
   checkpoint with a small trained tokenizer, converted the same way: ~7 GB, ~15 min to write here).
2. Each server in turn, started as a user would start it: ``ternary-rs serve GGUF`` with **no tuning
   variable** (every ``VLLM_CPU_*`` removed from the environment: what it chooses by itself is what is
   measured), and ``llama-server -m GGUF -np N`` (N = the number of clients, context N x per-client
   length, all cores).
3. Closed-loop clients: each of N threads sends a streaming ``/v1/completions`` request (distinct random
   16-token prompts, ``max_tokens`` ``--tokens``, greedy, ``ignore_eos``), waits for the last token, sends
   the next, for ``--seconds``. Reported per N: aggregate completion tokens/s over the window, request
   latency p50 / p99, time to first token p50 / p99, and the ratio ours / llama.cpp.
4. One ``--long-prompt``-token prompt (random ids, one client, after a warm-up): time to first token on
   both, i.e. prompt processing; the ratio llama.cpp / ours (> 1: ours is faster).

Goals (issue 23): >= 1.3x llama-server at 1 client, >= 3x at 16, >= 4x at 64. Timings on a shared
machine are not results: run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from ternary_rs.serving.health import ServerNotHealthy, free_port, wait_healthy

HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 1800
# Prompt token ids are drawn below this: inside every tokenizer these synthetic models carry.
PROMPT_ID_LIMIT = 300


# ------------------------------------------------------------------------------------------ models
def build_1p7b(work: Path) -> Path:
    gguf = work / "bonsai-1.7b-TQ2_0.gguf"
    if gguf.exists():
        return gguf
    sys.path.insert(0, str(HERE))
    import bench_vllm

    ckpt = work / "bonsai-1.7b"
    if not (ckpt / "config.json").exists():
        bench_vllm.write_synthetic(ckpt, None, bench_vllm.PRESETS["bonsai-1.7b"])
    _to_gguf(ckpt, gguf)
    return gguf


def build_27b(work: Path) -> Path:
    gguf = work / "bonsai2-27b-norot-TQ2_0.gguf"
    if gguf.exists():
        return gguf
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "tests"))
    import bench_27b

    from support.models import train_tokenizer

    ckpt = work / "bonsai2-27b-norot"
    if not (ckpt / "config.json").exists():
        bench_27b.build(ckpt, bench_27b.LAYERS, rotation=False)
        tok = train_tokenizer(ckpt)
        config = json.loads((ckpt / "config.json").read_text())
        config.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        (ckpt / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _to_gguf(ckpt, gguf)
    return gguf


def _to_gguf(src: Path, gguf: Path) -> None:
    # TQ2_0 holds one scale per 256 weights, the synthetic checkpoints one per 128: --requantize
    # re-ternarizes at group 256 (the weights change; the speed does not depend on them).
    subprocess.run([sys.executable, "-m", "ternary_rs", "convert", str(src), str(gguf), "--to", "gguf",
                    "--gguf-type", "TQ2_0", "--requantize", "--no-progress"], check=True)


# ------------------------------------------------------------------------------------------ servers
def wait_server(base: str, proc: subprocess.Popen, log: Path, timeout: float = START_TIMEOUT_S) -> float:
    """Seconds until ``base/health`` answers 200; exits with the log's tail if the server dies or is late."""
    try:
        return wait_healthy(proc, base, timeout)
    except ServerNotHealthy as e:
        if e.returncode is None:
            stop(proc)
        sys.exit(f"{e}:\n{log.read_text(errors='replace')[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_ours(gguf: Path, work: Path, max_len: int) -> tuple[subprocess.Popen, str, Path, float]:
    port = free_port()
    log = work / "serve-ternary_rs.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}  # no tuning: the defaults
    cmd = [sys.executable, "-m", "ternary_rs", "serve", str(gguf), "--no-progress", "--cache-dir",
           str(work / "serve-cache"), "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_len)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    return proc, base, log, wait_server(base, proc, log)


def start_llama(gguf: Path, work: Path, bin_dir: Path, slots: int, ctx_per_slot: int
                ) -> tuple[subprocess.Popen, str, Path, float]:
    port = free_port()
    log = work / f"llama-server-np{slots}.log"
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(os.cpu_count() or 1), "--no-warmup"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    return proc, base, log, wait_server(base, proc, log)


# ------------------------------------------------------------------------------------------ clients
def stream_completion(base: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """``(time to first token, total time, completion tokens)`` of one streaming request."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "n_predict": max_tokens}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, tokens = None, 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("text") is not None):
                tokens += 1
                if first is None:
                    first = time.perf_counter() - t0
    return (first if first is not None else float("nan")), time.perf_counter() - t0, tokens


def closed_loop(base: str, model: str, clients: int, tokens: int, seconds: float, seed: int) -> dict:
    results: list[tuple[float, float, int, float]] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(i: int) -> None:
        rng = np.random.default_rng([seed, i])
        while time.perf_counter() < deadline:
            prompt = [int(x) for x in rng.integers(3, PROMPT_ID_LIMIT, 16)]
            ttft, total, n = stream_completion(base, model, prompt, tokens)
            with lock:
                results.append((ttft, total, n, time.perf_counter()))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    lats = [r[1] for r in results]
    return {"clients": clients, "requests": len(results), "wall_s": wall,
            "tok_per_s": sum(r[2] for r in results) / wall,
            "latency_p50": _pct(lats, 50), "latency_p99": _pct(lats, 99),
            "ttft_p50": _pct(ttfts, 50), "ttft_p99": _pct(ttfts, 99)}


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def long_prompt_ttft(base: str, model: str, length: int, seed: int) -> float:
    rng = np.random.default_rng([seed, 7])
    stream_completion(base, model, [int(x) for x in rng.integers(3, PROMPT_ID_LIMIT, 64)], 2)  # warm-up
    prompt = [int(x) for x in rng.integers(3, PROMPT_ID_LIMIT, length)]
    return stream_completion(base, model, prompt, 1)[0]


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("1.7b", "27b"), default="1.7b")
    ap.add_argument("--gguf", type=Path, help="serve this GGUF instead of the preset's synthetic one")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_serve"))
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--long-prompt", type=int, default=2048, help="prompt tokens of the TTFT test (0: skip)")
    ap.add_argument("--only", choices=("ours", "llama"), default=None)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    clients = [int(c) for c in args.clients.split(",")]
    gguf = args.gguf or (build_1p7b if args.preset == "1.7b" else build_27b)(args.workdir)
    model = gguf.stem
    bin_dir = Path(os.environ.get("LLAMA_CPP_BIN", ""))
    if args.only != "ours" and not (bin_dir / "llama-server").is_file():
        sys.exit("set LLAMA_CPP_BIN to a llama.cpp build/bin with llama-server (scripts/build_llama_cpp.sh), or "
                 "pass --only ours")
    per_client = 16 + args.tokens + 16
    max_len = max(args.long_prompt + 64, 512)
    rows: dict[str, dict] = {}
    print(f"model {gguf} ({gguf.stat().st_size / 1e9:.2f} GB), {os.cpu_count()} CPUs, clients {clients}, "
          f"{args.tokens} tokens per request, {args.seconds:.0f} s per point", flush=True)
    if args.only != "llama":
        proc, base, log, up = start_ours(gguf, args.workdir, max_len)
        chosen = [line for line in log.read_text().splitlines() if "vLLM CPU settings" in line]
        print(f"ternary-rs serve ready after {up:.0f} s; {chosen[0] if chosen else ''}", flush=True)
        try:
            closed_loop(base, model, 1, 8, 5.0, seed=99)  # warm-up (first requests compile)
            for n in clients:
                rows[f"ours {n}"] = r = closed_loop(base, model, n, args.tokens, args.seconds, seed=n)
                _print_row("ternary-rs serve", r)
            if args.long_prompt:
                rows["ours long"] = {"ttft": long_prompt_ttft(base, model, args.long_prompt, 1)}
                print(f"  ternary-rs serve: {args.long_prompt}-token prompt, time to first token "
                      f"{rows['ours long']['ttft']:.2f} s", flush=True)
        finally:
            stop(proc)
    if args.only != "ours":
        for n in clients:
            proc, base, log, up = start_llama(gguf, args.workdir, bin_dir, n, per_client)
            try:
                closed_loop(base, model, 1, 8, 5.0, seed=99)
                rows[f"llama {n}"] = r = closed_loop(base, model, n, args.tokens, args.seconds, seed=n)
                _print_row(f"llama-server -np {n}", r)
            finally:
                stop(proc)
        if args.long_prompt:
            proc, base, log, up = start_llama(gguf, args.workdir, bin_dir, 1, args.long_prompt + 64)
            try:
                rows["llama long"] = {"ttft": long_prompt_ttft(base, model, args.long_prompt, 1)}
                print(f"  llama-server: {args.long_prompt}-token prompt, time to first token "
                      f"{rows['llama long']['ttft']:.2f} s", flush=True)
            finally:
                stop(proc)
    if args.only is None:
        print("\nratio ternary-rs serve / llama-server (aggregate tok/s; goals 1.3x at 1, 3x at 16, 4x at 64):")
        for n in clients:
            o, ll = rows[f"ours {n}"], rows[f"llama {n}"]
            print(f"  {n:3d} clients: {o['tok_per_s']:7.1f} vs {ll['tok_per_s']:7.1f} tok/s = "
                  f"{o['tok_per_s'] / ll['tok_per_s']:.2f}x; TTFT p50 {o['ttft_p50']:.2f} vs {ll['ttft_p50']:.2f} s")
        if args.long_prompt:
            o, ll = rows["ours long"]["ttft"], rows["llama long"]["ttft"]
            print(f"  {args.long_prompt}-token prompt TTFT: {o:.2f} vs {ll:.2f} s = llama.cpp / ours {ll / o:.2f}x")
    (args.workdir / "bench_serve.json").write_text(json.dumps(rows, indent=2))


def _print_row(label: str, r: dict) -> None:
    print(f"  {label:22s} {r['clients']:3d} clients: {r['tok_per_s']:7.1f} tok/s, {r['requests']:4d} requests, "
          f"latency p50 {r['latency_p50']:.2f} / p99 {r['latency_p99']:.2f} s, TTFT p50 {r['ttft_p50']:.2f} / "
          f"p99 {r['ttft_p99']:.2f} s", flush=True)


if __name__ == "__main__":
    main()
