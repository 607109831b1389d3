"""``ternary-rs serve`` in subprocesses: refusals before any conversion (vLLM missing, not ternary, does not
fit), the conversion cache (reuse checked against the manifest, a changed source or a damaged entry
reconverted, a concurrent pair converting once), and end to end on CPU with vLLM itself: the built-in demo
GGUF served, ``/v1/completions`` and ``/v1/chat/completions`` answering, Ctrl-C stopping the server and its
engine, a second serve reusing the cache."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ternary_rs.demo import DEMO_SHAPE, demo_tokenizer, qwen3_metadata, write_demo_gguf
from ternary_rs.serving.health import free_port
from ternary_rs.serving.serve import split_args
from ternary_rs.sinks.checkpoint import SLEEP_ENV

CLI = [sys.executable, "-m", "ternary_rs", "serve"]
SERVER_START_TIMEOUT_S = 900
TESTS = Path(__file__).parent
CONVERTING = "into the cache:"  # ternary-rs: converting SRC into the cache: ENTRY


def run(*args, env=None, timeout=300):
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture()
def demo(tmp_path):
    src = tmp_path / "demo.gguf"
    write_demo_gguf(src)
    return tmp_path, src, tmp_path / "cache"


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir()) if cache.exists() else []


def test_own_options_are_separated_from_vllm_options():
    o = split_args("m.gguf", ["--port", "8001", "--no-cache", "--max-model-len=512", "--no-progress", "--host",
                              "0.0.0.0"])
    assert o.no_cache and not o.progress and o.vllm_args == ["--port", "8001", "--max-model-len=512", "--host", "0.0.0.0"]
    o = split_args("m.gguf", ["--cache-dir", "/x", "--tensor-parallel-size", "2"])
    assert o.cache_dir == Path("/x") and o.vllm_args == ["--tensor-parallel-size", "2"]
    assert split_args("m.gguf", ["--cache-dir=/y"]).cache_dir == Path("/y")


def test_model_given_twice_is_refused(demo):
    _, src, cache = demo
    r = run(src, "--model", src, "--cache-dir", cache)
    assert r.returncode == 1 and "not as --model" in r.stderr


def test_missing_vllm_is_reported_before_converting(demo, tmp_path):
    _, src, cache = demo
    # A sitecustomize that makes `vllm` unimportable, as in an environment without it.
    blocker = tmp_path / "no_vllm"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoVllm:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'vllm'\")\n"
        "sys.meta_path.insert(0, _NoVllm())\n")
    env = {"PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}
    r = run(src, "--cache-dir", cache, env=env)
    assert r.returncode == 1, r.stderr
    assert "vLLM is not installed" in r.stderr and "scripts/setup_env.sh" in r.stderr
    assert not cache.exists()  # nothing converted


def test_model_without_ternary_weights_is_refused(tmp_path):
    from ternary_rs.sinks.writers import GGUFWriter

    src, cache = tmp_path / "dense.gguf", tmp_path / "cache"
    s = DEMO_SHAPE
    tokens, types, merges = demo_tokenizer()
    rng = np.random.default_rng(0)
    w = GGUFWriter(src)
    for key, value, vtype in qwen3_metadata("dense", s, 1, 512, tokens, types, merges):
        w.add_metadata(key, value, vtype)
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    shapes = {"token_embd.weight": (len(tokens), s["hidden"]), "output_norm.weight": (s["hidden"],),
              "blk.0.attn_q.weight": (q, s["hidden"]), "blk.0.attn_k.weight": (kv, s["hidden"]),
              "blk.0.attn_v.weight": (kv, s["hidden"]), "blk.0.attn_output.weight": (s["hidden"], q),
              "blk.0.ffn_gate.weight": (s["intermediate"], s["hidden"]),
              "blk.0.ffn_up.weight": (s["intermediate"], s["hidden"]),
              "blk.0.ffn_down.weight": (s["hidden"], s["intermediate"]),
              "blk.0.attn_norm.weight": (s["hidden"],), "blk.0.ffn_norm.weight": (s["hidden"],),
              "blk.0.attn_q_norm.weight": (s["head_dim"],), "blk.0.attn_k_norm.weight": (s["head_dim"],)}
    data = {n: rng.standard_normal(shape).astype(np.float32) for n, shape in shapes.items()}
    for n, a in data.items():
        w.add_tensor_info(n, a.shape, "F32", a.nbytes)
    for n, a in data.items():
        w.write_tensor_data(n, a)
    w.close()
    r = run(src, "--cache-dir", cache)
    assert r.returncode == 1
    assert "holds no ternary weights" in r.stderr and "vllm serve" in r.stderr
    assert not cache.exists()


def test_model_that_does_not_fit_is_refused_with_the_plan(demo):
    _, src, cache = demo
    # (past the model's own context, which alone is refused: test_refuses_what_vllm_would_refuse)
    long = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    # KV space sized by serve, and the user's own VLLM_CPU_KVCACHE_SPACE (too small for one sequence)
    for env in (long, {**long, "VLLM_CPU_KVCACHE_SPACE": "1"}):
        r = run(src, "--cache-dir", cache, "--max-model-len", str(10**9), env=env)
        assert r.returncode == 1
        assert "does not fit" in r.stderr and "--max-model-len" in r.stderr and "ternary-rs plan" in r.stderr
        assert not cache.exists()
    assert "the 1 GiB VLLM_CPU_KVCACHE_SPACE you set" in r.stderr


def test_cache_is_reused_and_checked_against_the_manifest(demo):
    root, src, cache = demo
    first = run(src, "--cache-dir", cache, "--dry-run", "--port", "8123")
    assert first.returncode == 0, first.stderr
    assert CONVERTING in first.stderr
    (entry,) = _entries(cache)
    assert f"--model {entry}" in first.stdout and "--port 8123" in first.stdout
    assert "--served-model-name demo" in first.stdout
    manifest = json.loads((entry / "ternary_rs.json").read_text())
    assert [Path(s["path"]).resolve() for s in manifest["sources"]] == [src.resolve()]

    again = run(src, "--cache-dir", cache, "--dry-run")
    assert again.returncode == 0 and "reusing the cached conversion" in again.stderr
    assert CONVERTING not in again.stderr

    # A damaged entry (a file the manifest lists has another size) is converted again, in place.
    shard = next(entry.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])
    fixed = run(src, "--cache-dir", cache, "--dry-run")
    assert fixed.returncode == 0 and CONVERTING in fixed.stderr
    assert _entries(cache) == [entry]
    assert subprocess.run([sys.executable, "-m", "ternary_rs", "verify", str(entry)]).returncode == 0

    # A changed source is a different cache key: converted again, and the old entry (which can never be
    # reused) is removed with its lock files, so the cache does not grow with every edit of the source.
    write_demo_gguf(src, seed=7)
    changed = run(src, "--cache-dir", cache, "--dry-run")
    assert changed.returncode == 0 and CONVERTING in changed.stderr
    assert f"removed the cache entry {entry.name}" in changed.stderr
    (new_entry,) = _entries(cache)
    assert new_entry != entry and not any(p.name.startswith(entry.name) for p in cache.iterdir())


def test_clear_cache_keeps_entries_in_use(demo, tmp_path):
    import fcntl

    _, src, cache = demo
    other = tmp_path / "other.gguf"
    write_demo_gguf(other, seed=3)
    for model in (src, other):
        assert run(model, "--cache-dir", cache, "--dry-run").returncode == 0
    busy, idle = sorted(_entries(cache), key=lambda p: not p.name.startswith("demo"))
    with open(busy.with_name(busy.name + ".inuse"), "a+") as held:  # as a running serve holds it
        fcntl.flock(held, fcntl.LOCK_SH)
        r = subprocess.run([sys.executable, "-m", "ternary_rs", "serve", "--clear-cache", "--cache-dir", str(cache)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "removed 1 cache entry" in r.stderr and f"1 in use kept: {busy.name}" in r.stderr
    assert _entries(cache) == [busy] and not idle.exists()


def test_refuses_what_vllm_would_refuse(demo, tmp_path):
    """Known failures are refused before converting, not after a minute of vLLM start-up."""
    _, src, cache = demo
    for args, words in ((["--max-model-len", "99999"], "exceeds the model's context of 2048"),
                        (["--tensor-parallel-size", "3"], "sizes that work: 1, 2, 4"),
                        (["--quantization", "fp8"], "--quantization fp8"),
                        (["--no-cache", "--dry-run"], "--no-cache removes the converted model")):
        r = run(src, "--cache-dir" if "--no-cache" not in args else "--no-progress",
                *([cache] if "--no-cache" not in args else []), "--dry-run", *args)
        assert r.returncode == 1 and words in r.stderr, (args, r.stderr)
    assert not cache.exists()
    # a GGUF without a tokenizer: vLLM could not start on it
    bare = tmp_path / "bare.gguf"
    _copy_without_tokenizer(src, bare)
    r = run(bare, "--cache-dir", cache, "--dry-run")
    assert r.returncode == 1 and "has no tokenizer" in r.stderr and "--skip-tokenizer-init" in r.stderr
    assert not cache.exists()
    r = run(bare, "--cache-dir", cache, "--dry-run", "--skip-tokenizer-init")
    assert r.returncode == 0, r.stderr


def _copy_without_tokenizer(src: Path, dst: Path) -> None:
    from ternary_rs.sinks.writers import GGUFWriter
    from ternary_rs.sources.reader import open as open_checkpoint

    with open_checkpoint(src) as f:
        w = GGUFWriter(dst)
        for key, value in f.metadata.items():
            if not key.startswith("tokenizer.") and key not in ("general.alignment",):
                w.add_metadata(key, value)
        infos = list(f.tensors.values())
        for info in infos:
            w.add_tensor_info(info.name, info.shape, info.type_id, info.nbytes)
        for info in infos:
            w.write_tensor_data(info.name, np.asarray(f.raw(info.name)))
        w.close()


def test_folder_holding_one_gguf_is_served_and_converted(demo, tmp_path):
    """How a downloaded GGUF repository looks: a folder with one GGUF (and a README)."""
    _, src, cache = demo
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "model.gguf").write_bytes(src.read_bytes())
    (repo / "README.md").write_text("a model card")
    r = run(repo, "--cache-dir", cache, "--dry-run")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    c = subprocess.run([sys.executable, "-m", "ternary_rs", "convert", str(repo), str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert c.returncode == 0, c.stderr
    assert subprocess.run([sys.executable, "-m", "ternary_rs", "verify", str(out)]).returncode == 0


def test_cpu_settings_are_chosen_and_the_users_win(demo):
    """On vLLM CPU: no core reserved on a small machine, the KV space sized from the plan (vLLM dies
    without one), all printed; a user's own variable is kept and reported as theirs."""
    _, src, cache = demo
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    r = subprocess.run(CLI + [str(src), "--cache-dir", str(cache), "--dry-run", "--max-model-len", "512"],
                       capture_output=True, text=True, timeout=300, env=clean)
    assert r.returncode == 0, r.stderr
    assert "vLLM CPU settings:" in r.stderr and "VLLM_CPU_KVCACHE_SPACE=" in r.stderr
    assert re.search(r"VLLM_CPU_KVCACHE_SPACE=\d+ ", r.stdout)  # the printed command carries them
    if (os.cpu_count() or 1) <= 4:
        assert "VLLM_CPU_NUM_OF_RESERVED_CPU=0 " in r.stdout
    mine = {**clean, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    r = subprocess.run(CLI + [str(src), "--cache-dir", str(cache), "--dry-run"], capture_output=True, text=True,
                       timeout=300, env=mine)
    assert r.returncode == 0, r.stderr
    assert "VLLM_CPU_KVCACHE_SPACE=2 (yours)" in r.stderr and "VLLM_CPU_NUM_OF_RESERVED_CPU=1 (yours)" in r.stderr
    assert "VLLM_CPU_KVCACHE_SPACE=" not in r.stdout  # nothing of ours overrides them
    r = subprocess.run(CLI + [str(src), "--cache-dir", str(cache), "--dry-run", "--kv-cache-memory-bytes", "1G"],
                       capture_output=True, text=True, timeout=300, env=clean)
    assert r.returncode == 0 and "VLLM_CPU_KVCACHE_SPACE" not in r.stdout + r.stderr


def test_dtype_choice_rule(tmp_path, monkeypatch):
    """bf16 compute for a float16 checkpoint where the CPU has native bf16 (not fp16); the checkpoint's
    dtype elsewhere; a --dtype of the user's is kept and only reported."""
    from ternary_rs.serving import cpu as cs
    from ternary_rs.vllm.plugin import dtype_hint

    def ckpt(name, config):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        return d

    fp16, bf16 = ckpt("fp16", {"dtype": "float16"}), ckpt("bf16", {"torch_dtype": "bfloat16"})
    nested = ckpt("nested", {"text_config": {"dtype": "float16"}})
    monkeypatch.setattr(cs, "bf16_gemm_is_native", lambda: True)
    for path in (fp16, nested):
        choice = cs.dtype_choice(path, None)
        assert (choice.name, choice.value, choice.flag, choice.by_user) == ("dtype", "bfloat16", "--dtype", False)
        assert cs.CpuSettings([choice]).args == ["--dtype", "bfloat16"] and cs.CpuSettings([choice]).env == {}
    assert cs.dtype_choice(bf16, None) is None and cs.dtype_choice(tmp_path / "missing", None) is None
    mine = cs.dtype_choice(fp16, "float16")
    assert mine.by_user and cs.CpuSettings([mine]).args == [] and "dtype=float16 (yours)" in mine.line()
    assert dtype_hint(SimpleNamespace(dtype=torch.float16)).line().startswith("dtype=float16 (this CPU has native bf16")
    assert dtype_hint(SimpleNamespace(dtype=torch.bfloat16)) is None
    monkeypatch.setattr(cs.platform, "machine", lambda: "aarch64")  # bf16 and fp16 both native there
    assert cs.dtype_choice(fp16, None) is None and dtype_hint(SimpleNamespace(dtype=torch.float16)) is None
    monkeypatch.setattr(cs.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cs, "bf16_gemm_is_native", lambda: False)
    assert cs.dtype_choice(fp16, None) is None and dtype_hint(SimpleNamespace(dtype=torch.float16)) is None


def test_serve_passes_the_dtype_choice(demo):
    """The printed vLLM command carries --dtype bfloat16 for the demo (a GGUF without BF16 tensors: a
    float16 config) exactly where this CPU has native bf16; a --dtype of the user's is passed as given."""
    from ternary_rs.serving import cpu as cs

    _, src, cache = demo
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    r = subprocess.run(CLI + [str(src), "--cache-dir", str(cache), "--dry-run"], capture_output=True, text=True,
                       timeout=300, env=clean)
    assert r.returncode == 0, r.stderr
    assert ("--dtype bfloat16" in r.stdout) == cs.bf16_not_fp16()
    assert ("dtype=bfloat16 (the checkpoint says float16" in r.stderr) == cs.bf16_not_fp16()
    r = subprocess.run(CLI + [str(src), "--cache-dir", str(cache), "--dry-run", "--dtype", "float16"],
                       capture_output=True, text=True, timeout=300, env=clean)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--dtype") == 1 and "--dtype float16" in r.stdout and "dtype=float16 (yours)" in r.stderr


def test_kv_space_rule():
    from ternary_rs.serving import cpu as cs

    gib = cs.GIB
    demo = TESTS / "_kv_rule_demo.gguf"
    write_demo_gguf(demo)
    try:
        space, why = cs.kv_cache_space(demo, max_model_len=512, max_num_seqs=None, available=20 * gib)
        assert space == cs.MIN_TARGET_BYTES and "20.0 GiB available" in why
        # little memory: what is left, in whole GiB, at least one sequence
        space, _ = cs.kv_cache_space(demo, max_model_len=512, max_num_seqs=None, available=int(4.5 * gib))
        assert space == 2 * gib
        with pytest.raises(cs.DoesNotFit, match="one 512-token sequence"):
            cs.kv_cache_space(demo, max_model_len=512, max_num_seqs=None, available=3 * gib)
        assert cs.reserved_cpus_choice({}, 2).value == "0" and cs.reserved_cpus_choice({}, 16) is None
        assert cs.reserved_cpus_choice({cs.RESERVED_ENV: "3"}, 2).by_user
        s = cs.choose(demo, env={}, kv_bytes_given=True, cores=2, available=20 * gib)
        assert s.kv_bytes is None and cs.KV_ENV not in s.env
        assert cs.BIND_ENV not in s.env and "VLLM_CPU_OMP_THREADS_BIND=auto" in s.summary()
        # tensor parallel on fewer NUMA nodes than ranks: one contiguous CPU range per rank
        assert cs.split_binding([0, 1], 2) == "0|1" and cs.split_binding(list(range(16)), 2) == "0-7|8-15"
        assert cs.split_binding([0, 1, 2, 4, 5], 2) == "0-2|4-5" and cs.split_binding([0, 2, 3], 1) == "0,2,3"
        tp2 = cs.bind_choice({}, 2, cpus=list(range(8)), nodes=1)
        assert tp2.value == "0-3|4-7" and not tp2.vllm_default and "NUMA" in tp2.why
        assert cs.bind_choice({}, 2, cpus=list(range(8)), nodes=2).vllm_default
        assert cs.bind_choice({cs.BIND_ENV: "0|1"}, 2).by_user
        s = cs.choose(demo, env={}, cores=2, available=20 * gib, tensor_parallel=2)
        assert s.env[cs.BIND_ENV] == cs.split_binding(cs._usable_cpu_ids(), 2) or cs._numa_nodes(cs._usable_cpu_ids()) > 1
    finally:
        demo.unlink()


def test_failure_cause_is_vllm_s_own_error():
    from ternary_rs.serving.serve import failure_cause

    lines = ["(EngineCore pid=1) ERROR 12-02 07:55:25 [core.py:1510] Traceback (most recent call last):",
             "(EngineCore pid=1) ERROR 12-02 07:55:25 [core.py:1510] ValueError: Available memory on node 0 (3.1/13.2 "
             "GiB) on kv cache allocation is less than requested",
             "Traceback (most recent call last):",
             "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]
    assert failure_cause(lines).startswith("ValueError: Available memory on node 0")
    assert failure_cause(["all fine"]) is None


def test_a_server_stuck_after_its_start_up_failed_is_stopped(monkeypatch, capsys):
    """vLLM logged that its engine failed to start but its process never exited (a CI run once sat 900 s
    so): ``serve`` stops the whole group after the grace period and reports vLLM's own cause, not a hang."""
    import psutil

    from ternary_rs.serving import serve as sv

    monkeypatch.setattr(sv, "STARTUP_FAILURE_GRACE_S", 1.0)
    monkeypatch.setattr(sv, "HEALTH_POLL_S", 0.2)
    stuck = ("import subprocess, sys, time\n"
             "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
             "print(child.pid, flush=True)\n"
             "print('(EngineCore pid=7) ERROR 12-07 07:55:25 [core.py:1510] EngineCore failed to start.', "
             "file=sys.stderr)\n"
             "print('(EngineCore pid=7) ERROR 12-07 07:55:25 [core.py:1510] ValueError: Available memory on node 0 "
             "is less than requested', file=sys.stderr, flush=True)\n"
             "time.sleep(600)\n")
    t0 = time.monotonic()
    code = sv.run_server([sys.executable, "-c", stuck], "demo", ["--port", str(free_port())])
    took = time.monotonic() - t0
    out, err = capsys.readouterr()
    assert code == 128 + signal.SIGINT, code  # stopped by the first signal of _stop's sequence
    assert took < 30, took
    assert "start-up failed and was still running 1 s later: stopping it" in err
    last = err.strip().splitlines()[-1]
    assert "before it answered" in last and last.endswith("ValueError: Available memory on node 0 is less than "
                                                          "requested"), last
    grandchild = int(out.split()[0])
    time.sleep(0.5)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_xdg_cache_home_and_no_cache(demo):
    root, src, _ = demo
    xdg = root / "xdg"
    r = run(src, "--dry-run", env={"XDG_CACHE_HOME": str(xdg)})
    assert r.returncode == 0, r.stderr
    assert len(_entries(xdg / "ternary_rs")) == 1
    # --no-cache with --dry-run would print a model folder removed when the command ends: refused
    # (the --no-cache conversion itself runs in `demo --serve`, test_demo_serve_prints_a_served_completion)
    r = run(src, "--dry-run", "--no-cache", env={"XDG_CACHE_HOME": str(root / "xdg2")})
    assert r.returncode == 1 and "--no-cache removes the converted model" in r.stderr
    assert not (root / "xdg2").exists()


def test_concurrent_serves_convert_once(demo):
    _, src, cache = demo
    env = {**os.environ, SLEEP_ENV: "0.1"}  # a slow conversion, so the two really overlap
    procs = [subprocess.Popen(CLI + [str(src), "--cache-dir", str(cache), "--dry-run", "--no-progress"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    errs = [e for _, e in outs]
    assert sum(CONVERTING in e for e in errs) == 1, errs
    waited = next(e for e in errs if CONVERTING not in e)
    assert "waiting for it" in waited and "reusing the cached conversion" in waited
    assert outs[0][0] == outs[1][0]  # the same checkpoint and command
    assert len(_entries(cache)) == 1


# ------------------------------------------------------------------------------------------ with vLLM
def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        return json.loads(r.read())


def _cpu_env() -> dict:
    sys.path.insert(0, str(TESTS))
    from support.vllm_runner import cpu_env

    saved = dict(os.environ)
    try:
        cpu_env(1)
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as `vllm serve` runs: engine in its own process
    return env


class Server:
    """``ternary-rs serve`` running in the background, its output in a log file."""

    def __init__(self, src: Path, cache: Path, log: Path, env: dict | None = None):
        import psutil

        self.port = free_port()
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            CLI + [str(src), "--cache-dir", str(cache), "--no-progress", "--host", "127.0.0.1", "--port",
                   str(self.port), "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "4"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env if env is not None else {**os.environ, **_cpu_env()})
        self.children: list = []
        deadline = time.time() + SERVER_START_TIMEOUT_S
        while "ternary-rs: serving" not in self.text():
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited {self.proc.returncode}:\n{self.text()[-6000:]}")
            if time.time() > deadline:
                self.stop()
                pytest.fail("serve did not become ready:\n" + self.text()[-6000:])
            time.sleep(2)
        self.children = psutil.Process(self.proc.pid).children(recursive=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=signal.SIGINT) -> int:
        """Ctrl-C as a user would (or another signal)."""
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self.log.close()
        return code


@pytest.mark.vllm
@pytest.mark.slow
def test_serve_demo_gguf_end_to_end(tmp_path):
    pytest.importorskip("vllm")
    import psutil

    src, cache = tmp_path / "demo.gguf", tmp_path / "cache"
    write_demo_gguf(src)
    # As a new user starts it: no VLLM_CPU_* variable (vLLM CPU alone would die for want of a KV space).
    new_user = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    server = Server(src, cache, tmp_path / "serve1.log", env=new_user)
    try:
        text = server.text()
        assert "vLLM CPU settings:" in text and "VLLM_CPU_KVCACHE_SPACE=" in text
        assert CONVERTING in text
        assert f"serving 'demo' at http://127.0.0.1:{server.port}/v1" in text
        r = _post(server.base + "/v1/completions", {"model": "demo", "prompt": "the", "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True})
        assert r["model"] == "demo" and r["usage"]["completion_tokens"] == 8
        assert isinstance(r["choices"][0]["text"], str)
        chat = _post(server.base + "/v1/chat/completions", {
            "model": "demo", "messages": [{"role": "user", "content": "the"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True})
        assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] == 6
    finally:
        code = server.stop()
    assert code == 130, server.text()[-3000:]  # docs/cli.md: interrupted
    assert "vLLM stopped" in server.log_path.read_text()
    assert server.children and not [c for c in server.children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

    # The second serve of the same file reuses the cache and answers too.
    server = Server(src, cache, tmp_path / "serve2.log")
    try:
        text = server.text()
        assert "reusing the cached conversion" in text and CONVERTING not in text
        r = _post(server.base + "/v1/completions", {"model": "demo", "prompt": "the", "max_tokens": 4,
                                                   "temperature": 0, "ignore_eos": True})
        assert r["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop(signal.SIGTERM) == 130  # what a process manager sends
    assert "vLLM stopped" in server.log_path.read_text()
    assert len(_entries(cache)) == 1


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_failure_prints_its_cause_and_a_signal_stops_start_up(tmp_path):
    """vLLM's 170-line traceback used to end in "exited with code 1": its own one-line cause is printed.
    SIGTERM to the serve process alone (a service manager) during start-up stops vLLM and its engine
    promptly, with the documented status 130."""
    pytest.importorskip("vllm")
    import psutil

    src, cache = tmp_path / "demo.gguf", tmp_path / "cache"
    write_demo_gguf(src)
    env = {**os.environ, **_cpu_env(), "VLLM_CPU_KVCACHE_SPACE": "100000"}  # the user's own, far too large
    r = subprocess.run(CLI + [str(src), "--cache-dir", str(cache), "--no-progress", "--port", str(free_port()),
                              "--max-model-len", "256", "--enforce-eager"],
                       capture_output=True, text=True, timeout=SERVER_START_TIMEOUT_S, env=env)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "ternary-rs: vLLM exited with code" in last and "ValueError: " in last and "memory" in last, last

    log = tmp_path / "startup.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(CLI + [str(src), "--cache-dir", str(cache), "--no-progress", "--port",
                                       str(free_port()), "--max-model-len", "256", "--enforce-eager"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **_cpu_env()})
        deadline = time.time() + 300
        while "starting vLLM" not in log.read_text() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        time.sleep(5)  # vLLM is importing / loading
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, log.read_text()[-3000:]
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        took = time.time() - t0
    assert code == 130, log.read_text()[-3000:]
    assert took < 30, took
    time.sleep(1)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.vllm
@pytest.mark.slow
def test_plugin_chooses_cpu_settings_for_llm_users(tmp_path):
    """``vllm.LLM(checkpoint)`` with vLLM's defaults (no VLLM_CPU_* variable) starts and generates: the
    plugin sized the KV space (vLLM CPU alone refuses to start on a loaded machine)."""
    pytest.importorskip("vllm")
    src, ckpt = tmp_path / "demo.gguf", tmp_path / "ckpt"
    write_demo_gguf(src)
    assert subprocess.run([sys.executable, "-m", "ternary_rs", "convert", str(src), str(ckpt),
                           "--no-progress"]).returncode == 0
    script = tmp_path / "llm.py"
    script.write_text(
        "import os, sys\n"
        "if __name__ == '__main__':\n"
        "    from vllm import LLM, SamplingParams\n"
        "    llm = LLM(sys.argv[1], max_model_len=256, enforce_eager=True)\n"
        "    out = llm.generate(['the'], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "    print('GENERATED', len(out[0].outputs[0].token_ids), os.environ.get('VLLM_CPU_NUM_OF_RESERVED_CPU'))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    r = subprocess.run([sys.executable, str(script), str(ckpt)], capture_output=True, text=True,
                       timeout=SERVER_START_TIMEOUT_S, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "ternary_rs: vLLM CPU settings:" in r.stdout + r.stderr
    expected_reserved = "0" if (os.cpu_count() or 1) <= 4 else "None"
    assert f"GENERATED 4 {expected_reserved}" in r.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_serve_prints_a_served_completion():
    """The README's first command ends with this."""
    pytest.importorskip("vllm")
    r = subprocess.run([sys.executable, "-m", "ternary_rs", "demo", "--serve"], capture_output=True, text=True,
                       timeout=SERVER_START_TIMEOUT_S, env={**os.environ, **_cpu_env()})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify: OK" in r.stdout and "5. serve: ternary-rs serve" in r.stdout
    assert "   text: " in r.stdout and " tokens in " in r.stdout and "tokens/s" in r.stdout
    assert not [line for line in r.stdout.splitlines() if "api_server" in line]  # vLLM's log stays out of it


def test_plugin_cpu_defaults_respect_the_users_settings(demo, monkeypatch):
    """``apply_cpu_defaults`` on a stand-in config: a ternary model gets the KV space and the reserved
    cores; ``--kv-cache-memory-bytes``, a variable of the user's, or a model of another quantization are
    left alone; a model it cannot plan is left to vLLM (never an error)."""
    from types import SimpleNamespace

    from ternary_rs.vllm.plugin import apply_cpu_defaults

    _, src, _ = demo
    for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND"):
        # setenv first so monkeypatch restores the variable's absence too: what apply_cpu_defaults writes
        # must not leak into later tests' vLLM subprocesses (a leaked bind once broke every TP=2 test)
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)

    def config(quant="ternary", kv_bytes=None, model=src):
        return SimpleNamespace(
            quant_config=SimpleNamespace(get_name=lambda: quant),
            model_config=SimpleNamespace(model=str(model), max_model_len=256),
            cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_memory_bytes=kv_bytes),
            scheduler_config=SimpleNamespace(max_num_seqs=8))

    c = config()
    layer_names_before = os.environ.get("VLLM_USE_LAYERNAME")
    apply_cpu_defaults(c)
    assert c.cache_config.kv_cache_memory_bytes and c.cache_config.kv_cache_memory_bytes % (1 << 30) == 0
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # set on the config, so a later variable still wins
    if (os.cpu_count() or 1) <= 4:
        assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    # vLLM's own default binding is reported, never written: a written "auto" would contradict a TP run
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    # read by vLLM when imported: written now it would reach only the processes vLLM starts
    assert os.environ.get("VLLM_USE_LAYERNAME") == layer_names_before
    c = config(kv_bytes=123)
    apply_cpu_defaults(c)
    assert c.cache_config.kv_cache_memory_bytes == 123
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    c = config()
    apply_cpu_defaults(c)
    assert c.cache_config.kv_cache_memory_bytes is None
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    for c in (config(quant="fp8"), config(model=src.parent / "missing")):
        apply_cpu_defaults(c)
        assert c.cache_config.kv_cache_memory_bytes is None


def test_cpp_wrapper_needs_string_layer_names_and_the_user_s_choice_wins(monkeypatch):
    """Inductor's C++ graph wrapper: ``serve`` starts vLLM with ``VLLM_USE_LAYERNAME=0`` (unless the user set
    it) and the plugin turns the wrapper on for a compiled model where layer names are strings; where they
    are vLLM's opaque objects (the wrapper cannot pass them: compiling would fail) it stays off with a hint;
    a ``cpp_wrapper`` of the user's is kept; nothing is chosen for an eager model."""
    from types import SimpleNamespace

    from ternary_rs.serving import cpu as cs
    from ternary_rs.vllm import plugin

    assert cs.layer_name_choice({}).value == "0" and cs.LAYER_NAME_ENV in cs.choose(
        TESTS / "missing.gguf", env={}, kv_bytes_given=True, cores=2, starts_vllm=True).env
    # inside vLLM (the plugin) the variable is too late: not chosen, not reported
    assert not [c for c in cs.choose(TESTS / "missing.gguf", env={}, kv_bytes_given=True, cores=2).choices
                if c.name == cs.LAYER_NAME_ENV]
    assert cs.layer_name_choice({cs.LAYER_NAME_ENV: "1"}).by_user

    def compiled(mode=3, **options):
        return SimpleNamespace(mode=mode, inductor_compile_config=dict(options))

    monkeypatch.setattr(plugin, "layer_names_are_strings", lambda: True)
    c = compiled()
    choice = plugin.cpp_wrapper_choice(c)
    assert choice.value == "True" and not choice.variable
    assert c.inductor_compile_config == {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
    c = compiled(cpp_wrapper=False)
    assert plugin.cpp_wrapper_choice(c).by_user and c.inductor_compile_config == {"cpp_wrapper": False}
    for eager in (compiled(mode=0), compiled(mode=None), None):
        assert plugin.cpp_wrapper_choice(eager) is None
    monkeypatch.setattr(plugin, "layer_names_are_strings", lambda: False)
    c = compiled()
    choice = plugin.cpp_wrapper_choice(c)
    assert c.inductor_compile_config == {} and choice.value == "False" and "VLLM_USE_LAYERNAME=0" in choice.why
    assert cs.CpuSettings([choice]).env == {}


def test_plugin_warm_up_pass_skips_the_products_only_for_ternary_with_explicit_kv(monkeypatch):
    """vLLM CPU's warm-up (one discarded forward pass of max_num_batched_tokens dummy tokens, to compile)
    runs the ternary ops as zeros for a ternary model whose KV space is explicit; another quantization, or
    a KV space vLLM will size from the resident memory after that pass, gets the real pass. Installed
    once however often the quant config is asked."""
    from types import SimpleNamespace

    from vllm.config import CompilationMode
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from ternary_rs import _core
    from ternary_rs.vllm.warm_up import install_cpu_warm_up_pass

    monkeypatch.setattr(CPUModelRunner, "warming_up_model", CPUModelRunner.warming_up_model)
    install_cpu_warm_up_pass()
    patched = CPUModelRunner.warming_up_model
    install_cpu_warm_up_pass()
    assert CPUModelRunner.warming_up_model is patched and patched._ternary_rs

    def runner(quant: str, kv_bytes):
        seen = []
        config = SimpleNamespace(
            quant_config=SimpleNamespace(get_name=lambda: quant),
            cache_config=SimpleNamespace(kv_cache_memory_bytes=kv_bytes),
            compilation_config=SimpleNamespace(mode=CompilationMode.VLLM_COMPILE, inductor_compile_config={}))
        return SimpleNamespace(vllm_config=config, profile_run=lambda: seen.append(_core.cpu_warm_up_pass())), seen

    for quant, kv_bytes, skipped in (("ternary", 1 << 30, True), ("ternary", None, False), ("fp8", 1 << 30, False)):
        r, seen = runner(quant, kv_bytes)
        CPUModelRunner.warming_up_model(r)
        assert seen == [skipped], (quant, kv_bytes)
        assert not _core.cpu_warm_up_pass()


def test_kv_space_counts_vllm_s_hybrid_pages(monkeypatch):
    """A hybrid model's sequence costs vLLM whole pages per layer group (SequenceSizes.vllm_bytes, checked
    against vLLM itself in test_qwen35_vllm.py), so the space is sized for that, and a user's setting that
    caps concurrency below max_num_seqs is reported. Numbers of the Bonsai 2 27B shape (48 Gated-DeltaNet +
    16 attention layers): there 1 GiB ran 4 of a batch of 8 short sequences at once without prefix caching,
    where state + KV alone would give 4.9."""
    from dataclasses import replace

    from ternary_rs.serving import cpu as cs

    gib = cs.GIB
    layer_state = 48 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 48 * 128) * 2  # fp32 recurrent + fp16 conv
    z = cs.SequenceSizes(context=1024, kv_per_token=2 * 16 * 4 * 256 * 2, state=48 * layer_state,
                         attention_layers=16, linear_layers=48, fixed=9 * gib)
    # The attention block grows in 128-token steps until one layer's block (4 KiB per token) holds one
    # layer's state (3.2 MB): 896 tokens; the state page is padded to that.
    page = 896 * 4096
    assert page - 128 * 4096 < layer_state <= page
    # 3 linear-attention groups of 16 layers + one attention group: 896-token blocks
    off = replace(z, paging=cs.Paging(mamba_align=False))
    assert off.vllm_bytes(1024) == 16 * page * (3 + 2)
    assert off.vllm_bytes(16) == 16 * page * (3 + 1)
    assert gib // off.vllm_bytes(16) == 4 and gib / (z.state + 16 * z.kv_per_token) > 4.8
    # prefix caching (vLLM's default): two state pages per linear-attention group
    assert z.vllm_bytes(1024) == 16 * page * (6 + 2)
    # a user's larger --block-size is the alignment
    big = replace(z, paging=cs.Paging(mamba_align=False, block_size=1024))
    assert big.vllm_bytes(1024) == 16 * 1024 * 4096 * (3 + 1)
    # a model without recurrent state: KV of whole 128-token blocks
    dense = cs.SequenceSizes(context=2048, kv_per_token=1000, state=0, attention_layers=28, linear_layers=0, fixed=0)
    assert dense.vllm_bytes(100) == 128_000 and dense.vllm_bytes(129) == 256_000

    monkeypatch.setattr(cs, "_sizes", lambda model, context, kv_dtype, available, paging: replace(z, paging=paging))
    # 16 sequences of 1024 tokens: 4.70 GB -> rounded up to 5 GiB, not down to 4
    space, why = cs.kv_cache_space("m", max_model_len=1024, max_num_seqs=16, available=22 * gib, paging=off.paging)
    assert space == 5 * gib and space // off.vllm_bytes(1024) >= 16
    assert why.endswith("margin, room for 16 sequences of 1024 tokens")
    # capped by the budget: the message says how many fit, not only the aim
    space, why = cs.kv_cache_space("m", max_model_len=1024, max_num_seqs=64, available=12 * gib, paging=off.paging)
    fits = space // off.vllm_bytes(1024)
    assert 0 < fits < 64 and f"room for about {fits} sequences of 1024 tokens, of the 64 aimed for" in why
    space, _ = cs.kv_cache_space("m", max_model_len=1024, max_num_seqs=32, available=22 * gib, paging=off.paging)
    assert space == 9 * gib  # 9.4 GB aimed for, rounded up; the budget's 9.7 GiB allows it
    # with prefix caching: 16 sequences take exactly 7 GiB
    space, _ = cs.kv_cache_space("m", max_model_len=1024, max_num_seqs=16, available=22 * gib)
    assert space == 7 * gib
    # the user's 1 GiB: kept, with the cap said
    s = cs.choose("m", env={cs.KV_ENV: "1"}, max_model_len=1024, max_num_seqs=8, cores=2, available=22 * gib,
                  paging=off.paging)
    assert "VLLM_CPU_KVCACHE_SPACE=1 (yours; room for about 3 sequences of 1024 tokens at once, fewer than " \
           "max_num_seqs 8: the rest wait)" in s.summary()
    s = cs.choose("m", env={cs.KV_ENV: "1"}, max_model_len=1024, max_num_seqs=8, cores=2, available=22 * gib)
    assert "room for about 2 sequences of 1024 tokens" in s.summary()
    s = cs.choose("m", env={cs.KV_ENV: "8"}, max_model_len=1024, max_num_seqs=8, cores=2, available=22 * gib)
    assert "VLLM_CPU_KVCACHE_SPACE=8 (yours)" in s.summary()
    with pytest.raises(cs.DoesNotFit, match="one 1024-token sequence"):
        cs.choose("m", env={cs.KV_ENV: "0.2"}, max_model_len=1024, max_num_seqs=8, cores=2, available=22 * gib)


def test_serve_reads_the_paging_arguments():
    """The vLLM arguments that change how a sequence is paged reach the KV sizing (serve._paging); the
    plugin reads the same from vLLM's cache configuration (vllm_paging)."""
    from types import SimpleNamespace

    from ternary_rs.serving.cpu import Paging
    from ternary_rs.serving.serve import _paging
    from ternary_rs.vllm.plugin import vllm_paging

    assert _paging([]) == Paging(mamba_align=True, block_size=None)
    assert _paging(["--no-enable-prefix-caching"]) == Paging(mamba_align=False)
    assert _paging(["--no-enable-prefix-caching", "--enable-prefix-caching"]).mamba_align
    assert _paging(["--mamba-cache-mode", "all"]) == Paging(mamba_align=False)
    assert _paging(["--no-enable-prefix-caching", "--mamba-cache-mode=align"]).mamba_align
    assert _paging(["--block-size", "256"]).block_size == 256

    def cache(**kw):
        return SimpleNamespace(**({"mamba_cache_mode": "none", "enable_prefix_caching": None, "block_size": 128,
                                   "user_specified_block_size": False} | kw))

    assert vllm_paging(cache()) == Paging(mamba_align=True, block_size=None)
    assert vllm_paging(cache(enable_prefix_caching=False)) == Paging(mamba_align=False)
    assert vllm_paging(cache(enable_prefix_caching=False, mamba_cache_mode="align")).mamba_align
    assert vllm_paging(cache(block_size=512, user_specified_block_size=True)).block_size == 512
    # the recurrent state's width: an explicit --mamba-ssm-cache-dtype, else what vLLM CPU makes of "auto"
    assert _paging(["--mamba-ssm-cache-dtype", "float32"]).recurrent_bytes == 4
    assert _paging(["--mamba-ssm-cache-dtype=bfloat16"]).recurrent_bytes == 2
    assert vllm_paging(cache(mamba_ssm_cache_dtype="float32")).recurrent_bytes == 4
    assert vllm_paging(cache(mamba_ssm_cache_dtype="auto")) == _paging([]) == Paging()


def test_recurrent_state_width_follows_vllm_cpu(monkeypatch, tmp_path):
    """vLLM CPU 0.32 keeps a Gated-DeltaNet model's recurrent state in the model dtype (bf16) unless the CPU
    has AVX512_BF16, where its platform resets "auto" to float32: the KV sizing halves the recurrent part of
    the planned (fp32) state on other CPUs (checked against vLLM's own concurrency in test_qwen35_vllm.py)."""
    from ternary_rs.serving import cpu as cs

    monkeypatch.setattr(cs, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert cs.recurrent_state_bytes() == 4 and cs.recurrent_state_bytes("bfloat16") == 2
    assert cs.Paging().recurrent_bytes == 4
    monkeypatch.setattr(cs, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert cs.recurrent_state_bytes() == 2 and cs.recurrent_state_bytes("float32") == 4
    monkeypatch.setattr(cs, "cpu_flags", lambda: None)
    assert cs.recurrent_state_bytes() == 4  # unknown: the larger

    plan = {"context": 256, "kv_cache_per_token": 512, "state_per_sequence": 3 * (262144 + 6144),
            "recurrent_state_per_sequence": 3 * 262144, "attention_layers": 1, "linear_attention_layers": 3,
            "total": 10 * cs.GIB, "kv_cache": 131072}
    import ternary_rs.inspection.planner as planner

    monkeypatch.setattr(planner, "plan", lambda *a, **k: plan)
    wide = cs._sizes(tmp_path, 256, "fp16", cs.GIB, cs.Paging(recurrent_bytes=4))
    narrow = cs._sizes(tmp_path, 256, "fp16", cs.GIB, cs.Paging(recurrent_bytes=2))
    assert wide.state == 3 * (262144 + 6144) and narrow.state == 3 * (131072 + 6144)
    assert wide.fixed == narrow.fixed  # weights, activations and runtime do not depend on it
    # the tiny qwen35 of test_qwen35_vllm.py at 1 GiB: vLLM reported 468 (fp32 state) and 780 (bf16 state)
    assert round(cs.GIB / wide.vllm_bytes(256)) == 468 and round(cs.GIB / narrow.vllm_bytes(256)) == 780


def test_a_context_too_long_for_the_machine_is_fitted_not_fatal(monkeypatch, tmp_path):
    """The 27B shape's own 262 144 tokens do not fit beside its weights in 22 GiB: `serve` without
    --max-model-len (or with -1 / auto, vLLM's "fit to memory") serves the longest length that fits and says
    so; a --max-model-len of the user's that does not fit is refused with that length; the plugin keeps
    its other settings and gives vLLM the budget's KV space (vLLM then names the length that fits)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from ternary_rs.serving import cpu as cs
    from ternary_rs.serving import serve as sv
    from ternary_rs.vllm.plugin import apply_cpu_defaults

    gib = cs.GIB
    layer_state = 48 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 48 * 128) * 2
    z = cs.SequenceSizes(context=262144, kv_per_token=2 * 16 * 4 * 256 * 2, state=48 * layer_state,
                         attention_layers=16, linear_layers=48, fixed=9 * gib)
    monkeypatch.setattr(cs, "_sizes", lambda model, context, kv_dtype, available, paging=None:
                        replace(z, context=context or 262144, paging=paging or cs.Paging()))
    monkeypatch.setattr(cs, "available_ram", lambda: 22 * gib)
    monkeypatch.setattr(cs, "usable_cores", lambda: 2)
    for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)

    space = cs.budget_space("m")
    assert space == 9 * gib  # 22 - 9 - 3.3 (15 % margin) GiB, whole GiB
    fit = cs.fitting_context("m", 262144)
    assert fit % 1024 == 0 and z.one_sequence_bytes(fit) <= space < z.one_sequence_bytes(fit + 1024)
    # vLLM holds one block of its pool back (16 layers x a 3.67 MB page here): 174080 tokens, which ignored
    # it, were refused by vLLM ("estimated maximum model length is 173824")
    assert z.one_sequence_bytes(fit) - z.vllm_bytes(fit) == 16 * 896 * 4096
    assert fit == 140288
    assert cs.fitting_context("m", 262144, space=2 * gib) < fit

    for args in ([], ["--max-model-len", "-1"], ["--max-model-len=auto"]):
        checked = sv._check_cpu(Path("m"), args, 262144, "fp16", fit=sv._max_model_len(args) is None)
        assert checked["max_model_len"] == fit and f"serving at --max-model-len {fit}" in checked["note"]
        assert checked["cpu_settings"].kv_bytes == space
    with pytest.raises(sv.ServeError, match=f"at most --max-model-len {fit} fits"):
        sv._check_cpu(Path("m"), ["--max-model-len", "200000"], 200000, "fp16")
    assert sv._without(["--max-model-len", "-1", "--port", "8", "--max-model-len=auto"], "--max-model-len") \
        == ["--port", "8"]

    c = SimpleNamespace(quant_config=SimpleNamespace(get_name=lambda: "ternary"),
                        model_config=SimpleNamespace(model="m", max_model_len=262144),
                        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_memory_bytes=None),
                        scheduler_config=SimpleNamespace(max_num_seqs=8))
    apply_cpu_defaults(c)
    assert c.cache_config.kv_cache_memory_bytes == space
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
