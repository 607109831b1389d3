"""Upstream llama.cpp for the tests: binaries and its reference converter, from ``scripts/build_llama_cpp.sh``.

``LLAMA_CPP_BIN`` names the folder of binaries (``DEST/build/bin``); the reference converter
``convert_hf_to_gguf.py`` (with its ``conversion/`` package and ``gguf-py``) is looked for in
``LLAMA_CPP_CONVERT_DIR``, else ``DEST`` (two levels above the binaries), where the script puts it, else
``.cache/llama_cpp_converter`` in the repository, where ``scripts/fetch_llama_cpp_converter.sh`` puts the
converter alone (plain Python, no build; ``scripts/setup_env.sh`` runs it, so CI has it).
Tests that need either skip when it is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

COMPLETION_TIMEOUT_S = 300
CONVERT_TIMEOUT_S = 600
# Where scripts/fetch_llama_cpp_converter.sh puts the converter by default.
FETCHED_CONVERTER = Path(__file__).resolve().parents[2] / ".cache" / "llama_cpp_converter"

# Runs llama.cpp's converter with its own gguf-py, once per job of a JSON list (one process, so torch and
# the converter are imported once); a job may pin tokenizer.ggml.pre. The converter picks the pre-tokenizer
# by hashing the tokenization of a test string against published models: a tokenizer trained on a few test
# sentences matches none of them, so the test says which regex family it built. Optionally
# (``quantize_embeddings``) token_embd / output are quantized like every other weight instead of the F16 the
# converter writes for them in a TQ1_0 / TQ2_0 file (ModelBase.prepare_tensors): its ``tensor_force_quant``
# hook answering True means "quantize with the file type".
_CONVERT_WRAPPER = r"""
import json, runpy, sys
from pathlib import Path
root, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
sys.path.insert(0, str(root))
sys.path.insert(1, str(root / "gguf-py"))
from conversion import base
default_pre, default_force_quant = base.TextModel.get_vocab_base_pre, base.ModelBase.tensor_force_quant
def tensor_force_quant(self, name, new_name, bid, n_dims):
    if new_name in ("token_embd.weight", "output.weight"):
        return True
    return default_force_quant(self, name, new_name, bid, n_dims)
for job in jobs:
    pre = job["pre"]
    base.TextModel.get_vocab_base_pre = (lambda self, tokenizer: pre) if pre else default_pre
    base.ModelBase.tensor_force_quant = tensor_force_quant if job["quantize_embeddings"] else default_force_quant
    sys.argv = [str(root / "convert_hf_to_gguf.py")] + job["argv"]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def bin_dir() -> Path | None:
    value = os.environ.get("LLAMA_CPP_BIN")
    return Path(value) if value else None


def convert_dir() -> Path | None:
    value = os.environ.get("LLAMA_CPP_CONVERT_DIR")
    if value:
        return Path(value)
    b = bin_dir()
    if b is not None:
        return b.parent.parent
    return FETCHED_CONVERTER if (FETCHED_CONVERTER / "convert_hf_to_gguf.py").is_file() else None


def require_binary(name: str = "llama-completion") -> Path:
    b = bin_dir()
    if b is None:
        pytest.skip("LLAMA_CPP_BIN is not set (build llama.cpp with scripts/build_llama_cpp.sh DEST, then "
                    "export LLAMA_CPP_BIN=DEST/build/bin)")
    exe = b / name
    if not exe.is_file():
        pytest.fail(f"LLAMA_CPP_BIN={b} has no {name}")
    return exe


def require_converter() -> Path:
    d = convert_dir()
    if d is None:
        pytest.skip("no llama.cpp converter: run scripts/fetch_llama_cpp_converter.sh (or set LLAMA_CPP_BIN / "
                    "LLAMA_CPP_CONVERT_DIR; scripts/build_llama_cpp.sh puts convert_hf_to_gguf.py next to the "
                    "build folder)")
    if not (d / "convert_hf_to_gguf.py").is_file():
        pytest.fail(f"{d} has no convert_hf_to_gguf.py")
    return d


@dataclass
class ConvertJob:
    """One ``convert_hf_to_gguf.py hf_dir --outtype outtype --outfile out [extra…]`` run (see ``_CONVERT_WRAPPER``
    for ``tokenizer_pre`` and ``quantize_embeddings``)."""

    hf_dir: Path
    out: Path
    outtype: str
    tokenizer_pre: str = ""
    extra: tuple[str, ...] = ()
    quantize_embeddings: bool = False


def reference_convert_many(jobs: list[ConvertJob]) -> list[Path]:
    """Run llama.cpp's own writer for every job, in one process; returns the output paths."""
    root = require_converter()
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use its own gguf-py, not the installed one
    spec = [{"pre": j.tokenizer_pre, "quantize_embeddings": j.quantize_embeddings,
             "argv": [str(j.hf_dir), "--outtype", j.outtype, "--outfile", str(j.out), *j.extra]} for j in jobs]
    proc = subprocess.run([sys.executable, "-c", _CONVERT_WRAPPER, str(root), json.dumps(spec)],
                          capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S, env=env, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"convert_hf_to_gguf.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [j.out for j in jobs]


def reference_convert(hf_dir: Path, out: Path, outtype: str, tokenizer_pre: str = "", extra: tuple[str, ...] = (),
                      quantize_embeddings: bool = False) -> Path:
    """``convert_hf_to_gguf.py hf_dir --outtype outtype --outfile out [extra…]`` (llama.cpp's own writer);
    ``quantize_embeddings``: token_embd / output in ``outtype`` too (see ``_CONVERT_WRAPPER``)."""
    return reference_convert_many([ConvertJob(hf_dir, out, outtype, tokenizer_pre, tuple(extra),
                                              quantize_embeddings)])[0]


# llama-completion's logger (which also prints the generated text) is an async queue that is never flushed
# at exit (common/log.cpp: "this design may cause logs to be lost if not flushed before the program
# exits"), so a run can lose its tail. The queue is FIFO and the program's last message is "\n\n": an output
# ending with it is complete; otherwise the run is repeated.
COMPLETION_ATTEMPTS = 8


def complete(gguf_path: Path, prompt: str, n_predict: int = 24) -> bytes:
    """Greedy ``llama-completion`` output (prompt echo + generated text) on CPU, one thread, fixed seed."""
    exe = require_binary("llama-completion")
    # -no-cnv: plain completion even when the file has a chat template
    cmd = [str(exe), "-m", str(gguf_path), "-p", prompt, "-n", str(n_predict), "--temp", "0", "--top-k", "1",
           "--seed", "0", "-t", "1", "-c", "256", "--no-warmup", "-ngl", "0", "-no-cnv", "--simple-io"]
    for _ in range(COMPLETION_ATTEMPTS):
        # bytes: a random tiny model emits partial UTF-8 sequences
        proc = subprocess.run(cmd, capture_output=True, timeout=COMPLETION_TIMEOUT_S, check=False,
                              stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                                 f"{proc.stderr[-4000:].decode(errors='replace')}")
        if proc.stdout.endswith(b"\n\n"):
            return proc.stdout[: -len(b"\n\n")]
    raise AssertionError(f"{' '.join(cmd)}: output incomplete in {COMPLETION_ATTEMPTS} runs; last: {proc.stdout!r}")


SERVER_START_TIMEOUT_S = 120


def _post(url: str, body: dict) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=COMPLETION_TIMEOUT_S) as r:
        return json.loads(r.read())


@dataclass
class Greedy:
    """A greedy ``llama-server`` run: prompt token ids, generated token ids, and per generated token the
    log-probability lead of the chosen token over the runner-up (how close that step was to a tie)."""

    prompt: list[int]
    tokens: list[int]
    margins: list[float]


def greedy_tokens(gguf_path: Path, prompt: str, n_predict: int = 24) -> Greedy:
    """Greedy generation by ``llama-server`` (CPU, one thread), as token ids.

    Token ids rather than text: a model whose vocabulary is padded (``[PAD{i}]`` tokens, type UNUSED) may
    generate padding tokens, which llama.cpp detokenizes to nothing, so text would hide a difference.
    The end-of-generation token is ignored so that every run generates ``n_predict`` tokens."""
    from ternary_rs.serving.health import ServerNotHealthy, free_port, wait_healthy

    exe = require_binary("llama-server")
    port = free_port()
    cmd = [str(exe), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-c", "256",
           "-np", "1", "-ngl", "0", "--no-warmup", "--seed", "0"]
    import tempfile

    log_file = tempfile.TemporaryFile()  # not a pipe: the server's start-up log would fill it and block it
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(proc, base, SERVER_START_TIMEOUT_S, poll_s=0.2)
        except ServerNotHealthy as e:
            log_file.seek(0)
            raise AssertionError(f"{' '.join(cmd)}: {e}:\n{log_file.read()[-4000:].decode(errors='replace')}") from None
        prompt_ids = _post(base + "/tokenize", {"content": prompt, "add_special": True})["tokens"]
        out = _post(base + "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0,
                                           "top_k": 1, "seed": 0, "ignore_eos": True, "cache_prompt": False,
                                           "return_tokens": True, "samplers": ["top_k"], "n_probs": 2})
        margins = []
        for step in out["completion_probabilities"]:
            top = sorted((t["logprob"] for t in step["top_logprobs"]), reverse=True)
            margins.append(top[0] - top[1])
        return Greedy(list(prompt_ids), list(out["tokens"]), margins)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_file.close()


def gguf_contents(path: Path) -> tuple[dict, dict]:
    """``(metadata {key: (type names, value)}, tensors {name: (type, shape, bytes)})`` read with gguf-py."""
    import gguf

    r = gguf.GGUFReader(str(path))
    meta = {f.name: (tuple(t.name for t in f.types), f.contents()) for f in r.fields.values()
            if not f.name.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape), t.data.tobytes()) for t in r.tensors}
    return meta, tensors
