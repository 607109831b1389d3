"""Soak test: vLLM's OpenAI server on a converted tiny ternary model under sustained concurrent load.

    python benches/soak.py [--model qwen3|bonsai2|DIR] [--duration 600] [--clients 64] [--out soak.json]
                           [--disconnect-share 0.1] [--bad-share 0.05] [--no-prefix-caching] [--seed 0]

Builds the model locally (``qwen3``: tests/support/models.py's tiny ternarized Qwen3; ``bonsai2``: the Bonsai 2
style Qwen3.5 hybrid of tests/support/bonsai2_model.py as PrismML's PQ2_0 GGUF), converts it with ``ternary_rs``
(or takes a converted DIR), starts ``vllm.entrypoints.openai.api_server`` on localhost with
``--enable-prefix-caching`` and drives it with ``--clients`` concurrent clients for ``--duration``
seconds. Each client loops over requests of mixed kinds:

* streaming completions and chat completions: one of a few long shared system prompts (the prefix cache's
  case) plus a random user text of 1–60 words, ``max_tokens`` 1–64 with ``ignore_eos``; the stream must
  end with ``[DONE]`` and its usage must report exactly ``max_tokens`` completion tokens (vLLM caps
  them at the context left: ``max_model_len − prompt_tokens``);
* ``--disconnect-share`` of them read a few chunks and drop the connection mid-stream;
* ``--bad-share`` are requests with bad parameters (negative ``max_tokens``, ``temperature`` or
  ``top_p`` out of range, ``n = 0``, an unknown model, no prompt, a prompt longer than the context…),
  which must be answered with a 4xx — for a streaming request, vLLM may instead open the stream (200)
  and send an error event whose code is a 4xx; that counts as refused and is reported as such.

It samples the server's resident memory (the API process and its engine children) every few seconds and
prints, and writes to ``--out`` as JSON: requests done per kind, the prefix cache's hit rate (vLLM's
/metrics), errors (anything other than a correct
stream or the expected 4xx; must be 0), p50/p99 latency and time to first token, tokens/s, and RSS after
warm-up, under full load (10% into the run), at the middle of the run, at the end and its maximum.
Exit status 1 on any error, on a bad request that was not refused with a 4xx, or when RSS grew by more
than ``--max-rss-growth`` (fraction; default 0.05) over the **second half** of the run. A leak keeps
growing; warm-up does not: on the hybrid (GDN) model RSS climbs for the first ~10 minutes as caches,
allocator arenas and compiled shapes fill in, then stays flat (measured: +7 % from 60 s to 780 s, then
±0.1 % to 1200 s), so growth from the 60-second point (``rss_growth_from_full_load``, also reported)
says nothing about leaks in a run of 10 minutes. Run ≥ 20 minutes for the hybrid model.
The short form is tests/test_soak.py. On a shared machine the latencies say little; errors and memory
growth are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ternary_rs.serving.health import ServerNotHealthy, free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))

SERVED_NAME = "soak"
# Per model: the context and the shared system prompt's length in words (~2.7 tokens each with the tiny
# tokenizers). Only whole KV blocks are cached, so the shared prefix must fill one: vLLM CPU's default
# block is 128 tokens (qwen3: a ~190-token prompt); for the hybrid qwen35 model vLLM raises the attention
# block to 640 tokens to match the GDN state page, more than the tiny model's 512 positions, so bonsai2
# runs with a 2048-token context (VLLM_ALLOW_LONG_MAX_MODEL_LEN: RoPE positions past the configured
# maximum are computed the same way) and a ~810-token system prompt.
MODEL_SETTINGS = {"qwen3": (512, 70), "bonsai2": (2048, 300)}
DEFAULT_SETTINGS = (512, 70)
MAX_USER_WORDS = 60
WORDS = ("ternary weights take one of three values minus one zero or plus one the quick brown fox jumps over the "
         "lazy dog a scale per group of weights restores the magnitude hello world this is a tiny model for "
         "testing vllm serves large language models fast on gpus and on cpus once upon a time").split()
# Set by configure().
MAX_MODEL_LEN = DEFAULT_SETTINGS[0]
SYSTEM_PROMPTS: list[str] = []


def configure(max_model_len: int, system_words: int) -> None:
    global MAX_MODEL_LEN, SYSTEM_PROMPTS
    MAX_MODEL_LEN = max_model_len
    SYSTEM_PROMPTS = [" ".join(random.Random(i).choices(WORDS, k=system_words)) for i in range(4)]
HEALTH_TIMEOUT_S = 900
RSS_SAMPLE_S = 5.0


# ------------------------------------------------------------------------------------------ model + server
def build_model(kind: str, work: Path) -> Path:
    import ternary_rs

    if kind == "qwen3":
        from support.models import build_tiny_model

        hf = work / "hf"
        build_tiny_model(hf, group_size=128, seed=0)
        return Path(ternary_rs.convert(hf, work / "qwen3-ternary", progress=False))
    if kind == "bonsai2":
        from support.bonsai2_model import build_bonsai2_tiny, write_prism_gguf

        tiny = build_bonsai2_tiny(work / "hf", block_size=128)
        src = write_prism_gguf(tiny, work / "bonsai2-tiny-PQ2_0.gguf", "PQ2_0")
        return Path(ternary_rs.convert(src, work / "bonsai2-ternary", progress=False))
    return Path(kind)


def chat_template_args(model: Path, work: Path) -> list[str]:
    """``--chat-template`` when the checkpoint has none (the tiny Bonsai 2 GGUF carries no template, unlike
    PrismML's real files): the tiny models' own ChatML template, from a file beside the checkpoint."""
    if (model / "chat_template.jinja").is_file():
        return []
    try:
        if json.loads((model / "tokenizer_config.json").read_text()).get("chat_template"):
            return []
    except (OSError, ValueError):
        pass
    from support.models import CHAT_TEMPLATE

    path = work / "chat_template.jinja"
    path.write_text(CHAT_TEMPLATE)
    return ["--chat-template", str(path)]


def start_server(model: Path, port: int, clients: int, prefix_caching: bool, log_path: Path,
                 extra: list[str]) -> subprocess.Popen:
    from support.vllm_runner import cpu_env

    saved = dict(os.environ)
    cpu_env(1)
    env = dict(os.environ)
    os.environ.clear()
    os.environ.update(saved)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's usual layout: engine in its own process
    env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # see MODEL_SETTINGS
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN),
           "--max-num-seqs", str(clients), "--enforce-eager", "--no-enable-log-requests"]
    if prefix_caching:
        cmd.append("--enable-prefix-caching")
    cmd += extra
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_server(proc: subprocess.Popen, base: str, log_path: Path) -> None:
    try:
        wait_healthy(proc, base, HEALTH_TIMEOUT_S, poll_s=2)
    except ServerNotHealthy as e:
        raise RuntimeError(f"{e}:\n{log_path.read_text()[-5000:]}") from None


def prefix_cache_stats(base: str) -> dict:
    """vLLM's prefix-cache counters from /metrics (tokens queried and hit since start)."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError as e:
        return {"error": str(e)}
    totals = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        for key in totals:
            if line.startswith(f"vllm:prefix_cache_{key}_total"):
                totals[key] += float(line.rsplit(" ", 1)[1])
    totals["hit_rate"] = totals["hits"] / totals["queries"] if totals["queries"] else None
    return totals


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (the API server and its engine)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


# ------------------------------------------------------------------------------------------ requests
def bad_request(rng: random.Random) -> tuple[str, str, dict]:
    """(name, endpoint, body) of a request the server must refuse with a 4xx."""
    prompt = "hello world"
    cases = [
        ("negative max_tokens", "/v1/completions", {"prompt": prompt, "max_tokens": -1}),
        ("temperature < 0", "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": -2}),
        ("top_p > 1", "/v1/completions", {"prompt": prompt, "max_tokens": 4, "top_p": 2.5}),
        ("n = 0", "/v1/completions", {"prompt": prompt, "max_tokens": 4, "n": 0}),
        ("unknown model", "/v1/completions", {"prompt": prompt, "max_tokens": 4, "model": "no-such-model"}),
        ("no prompt", "/v1/completions", {"max_tokens": 4}),
        ("prompt over the context", "/v1/completions",
         {"prompt": " ".join(WORDS * 40), "max_tokens": 4}),
        ("max_tokens over the context", "/v1/completions", {"prompt": prompt, "max_tokens": 10 * MAX_MODEL_LEN}),
        ("chat without messages", "/v1/chat/completions", {"max_tokens": 4}),
        ("chat message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}], "max_tokens": 4}),
        ("logprobs too many", "/v1/completions", {"prompt": prompt, "max_tokens": 4, "logprobs": 10**6}),
        ("max_tokens not a number", "/v1/completions", {"prompt": prompt, "max_tokens": "many"}),
    ]
    name, endpoint, body = rng.choice(cases)
    return name, endpoint, {"model": SERVED_NAME, "stream": rng.random() < 0.5, **body}


def good_request(rng: random.Random) -> tuple[str, str, dict, int]:
    system = rng.choice(SYSTEM_PROMPTS)
    user = " ".join(rng.choices(WORDS, k=rng.randint(1, MAX_USER_WORDS)))
    max_tokens = rng.randint(1, 64)
    common = {"model": SERVED_NAME, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
              "temperature": rng.choice((0.0, 0.7, 1.0)), "stream_options": {"include_usage": True}}
    if rng.random() < 0.5:
        return "completion", "/v1/completions", {**common, "prompt": system + "\n" + user}, max_tokens
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return "chat", "/v1/chat/completions", {**common, "messages": messages}, max_tokens


async def run_one(session, base: str, rng: random.Random, disconnect_share: float, bad_share: float) -> dict:
    import aiohttp

    roll = rng.random()
    t0 = time.perf_counter()
    if roll < bad_share:
        name, endpoint, body = bad_request(rng)
        try:
            async with session.post(base + endpoint, json=body) as r:
                text = (await r.read()).decode(errors="replace")
                status = r.status
        except aiohttp.ClientError as e:
            return {"kind": "bad", "case": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
        in_stream = status == 200 and body.get("stream") and _stream_error_code(text)
        if in_stream:
            status = in_stream
        ok = 400 <= status < 500
        return {"kind": "bad", "case": name, "ok": ok, "status": status, "in_stream": bool(in_stream),
                "error": None if ok else f"{name}: expected a 4xx, got {status}: {text[:200]!r}"}
    kind, endpoint, body, max_tokens = good_request(rng)
    disconnect = roll < bad_share + disconnect_share
    ttft = None
    usage = None
    done = False
    chunks = 0
    try:
        async with session.post(base + endpoint, json=body) as r:
            if r.status != 200:
                text = (await r.read())[:300]
                return {"kind": kind, "ok": False, "error": f"HTTP {r.status}: {text!r}"}
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if event.get("choices"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                if event.get("usage"):
                    usage = event["usage"]
                if disconnect and chunks >= 2:
                    r.close()  # drop the connection mid-stream; the server must cope
                    return {"kind": "disconnect", "ok": True, "latency": time.perf_counter() - t0}
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
        return {"kind": kind, "ok": False, "error": f"{type(e).__name__}: {e}"}
    latency = time.perf_counter() - t0
    if disconnect:  # the stream was too short to cut
        kind = "disconnect"
    if not done:
        return {"kind": kind, "ok": False, "error": "stream ended without [DONE]"}
    got = (usage or {}).get("completion_tokens")
    expected = min(max_tokens, MAX_MODEL_LEN - (usage or {}).get("prompt_tokens", 0))
    if got != expected:
        return {"kind": kind, "ok": False,
                "error": f"usage says {got} completion tokens, expected {expected} (max_tokens {max_tokens})"}
    return {"kind": kind, "ok": True, "latency": latency, "ttft": ttft, "tokens": got}


def _stream_error_code(text: str) -> int | None:
    """The HTTP-style code of the first error event of an SSE body, if it holds one."""
    for line in text.splitlines():
        if line.startswith("data:") and '"error"' in line:
            try:
                err = json.loads(line[5:])["error"]
                return int(err.get("code") or 0) or None
            except (ValueError, KeyError, TypeError, AttributeError):
                return None
    return None


async def load(base: str, clients: int, duration: float, seed: int, disconnect_share: float, bad_share: float,
               on_tick) -> list[dict]:
    import aiohttp

    results: list[dict] = []
    end = time.monotonic() + duration
    timeout = aiohttp.ClientTimeout(total=600)

    async def client(i: int):
        rng = random.Random(seed * 1000 + i)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < end:
                results.append(await run_one(session, base, rng, disconnect_share, bad_share))

    async def ticker():
        while time.monotonic() < end:
            on_tick(results)
            await asyncio.sleep(RSS_SAMPLE_S)

    await asyncio.gather(ticker(), *(client(i) for i in range(clients)))
    return results


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(results: list[dict], seconds: float, rss: list[tuple[float, int]], rss_start: int) -> dict:
    """Counts, latencies and memory. ``rss_growth`` is measured over the second half of the run (from
    the first sample past its middle to the end): the steady state, where a leak shows and warm-up has
    ended; ``rss_growth_from_full_load`` from the first sample past 10% of the run (at most 60 s in)."""
    by_kind: dict[str, int] = {}
    for r in results:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    good = [r for r in results if r["ok"] and r["kind"] in ("completion", "chat")]
    errors = [r for r in results if not r["ok"] and r["kind"] != "bad"]
    bad_not_refused = [r for r in results if r["kind"] == "bad" and not r["ok"]]
    lat = [r["latency"] for r in good]
    ttft = [r["ttft"] for r in good if r.get("ttft") is not None]
    rss_end = rss[-1][1] if rss else 0
    ramp = min(60.0, 0.1 * seconds)
    rss_loaded = next((v for t, v in rss if t >= ramp), rss_end)
    rss_mid = next((v for t, v in rss if t >= 0.5 * seconds), rss_end)
    return {
        "requests": len(results),
        "by_kind": by_kind,
        "errors": len(errors),
        "error_samples": sorted({r["error"] for r in errors})[:10],
        "bad_requests": by_kind.get("bad", 0),
        "bad_requests_not_4xx": len(bad_not_refused),
        "bad_not_4xx_samples": sorted({r["error"] for r in bad_not_refused})[:10],
        "bad_statuses": sorted({r.get("status") for r in results if r["kind"] == "bad" and r.get("status")}),
        "bad_refused_in_stream": sorted({r["case"] for r in results if r["kind"] == "bad" and r.get("in_stream")}),
        "latency_s": {"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99), "max": max(lat, default=None)},
        "ttft_s": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
        "completion_tokens": sum(r.get("tokens", 0) for r in good),
        "tokens_per_s": sum(r.get("tokens", 0) for r in good) / max(seconds, 1e-9),
        "seconds": seconds,
        "rss_mb": {"after_warmup": rss_start / 2**20, "under_load": rss_loaded / 2**20, "middle": rss_mid / 2**20,
                   "end": rss_end / 2**20, "max": max((v for _, v in rss), default=0) / 2**20},
        "rss_growth": (rss_end - rss_mid) / rss_mid if rss_mid else None,
        "rss_growth_from_full_load": (rss_end - rss_loaded) / rss_loaded if rss_loaded else None,
        "rss_timeline_mb": [(round(t, 1), round(v / 2**20, 1)) for t, v in rss],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3", help="qwen3, bonsai2, or a converted checkpoint directory")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--bad-share", type=float, default=0.05)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: per model, see MODEL_SETTINGS")
    ap.add_argument("--system-words", type=int, default=None, help="shared system prompt length in words")
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    max_len, system_words = MODEL_SETTINGS.get(args.model, DEFAULT_SETTINGS)
    configure(args.max_model_len or max_len, args.system_words or system_words)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ternary_soak_"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.model, work)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = work / "server.log"
    proc = start_server(model, port, args.clients, not args.no_prefix_caching, log_path,
                        chat_template_args(model, work))
    try:
        wait_server(proc, base, log_path)
        # Warm-up (first requests allocate caches), then the baseline memory.
        asyncio.run(load(base, min(4, args.clients), 3.0, args.seed + 99, 0.0, 0.0, lambda r: None))
        rss_start = tree_rss(proc.pid)
        rss: list[tuple[float, int]] = []
        t0 = time.monotonic()

        def tick(results):
            rss.append((time.monotonic() - t0, tree_rss(proc.pid)))
            print(f"[{rss[-1][0]:6.0f} s] {len(results)} requests, rss {rss[-1][1] / 2**20:.0f} MiB", flush=True)

        results = asyncio.run(load(base, args.clients, args.duration, args.seed, args.disconnect_share,
                                   args.bad_share, tick))
        seconds = time.monotonic() - t0
        rss.append((seconds, tree_rss(proc.pid)))
        with urllib.request.urlopen(base + "/health", timeout=30) as r:
            healthy = r.status == 200
        summary = summarize(results, seconds, rss, rss_start)
        summary.update(model=args.model, clients=args.clients, max_model_len=MAX_MODEL_LEN,
                       prefix_caching=not args.no_prefix_caching,
                       prefix_cache_tokens=prefix_cache_stats(base), healthy_after=healthy,
                       server_exit=proc.poll())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    shown = {k: v for k, v in summary.items() if k != "rss_timeline_mb"}
    print(json.dumps(shown, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    failed = (summary["errors"] or summary["bad_requests_not_4xx"] or not summary["healthy_after"]
              or (summary["rss_growth"] or 0) > args.max_rss_growth)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
