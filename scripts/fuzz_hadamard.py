"""Mutation fuzzer for the Bonsai 2 rotation parsers (target ``prism_hadamard`` of scripts/fuzz.sh).

    python3 scripts/fuzz_hadamard.py [--seconds 120] [--min-execs 1000000] [--artifacts DIR] [--seed 0]

The parsers are Python (``ternary_rs.core.hadamard.HadamardSpec``): ``from_prism`` reads GGUF
``prism.hadamard.*`` metadata (values as the GGUF reader returns them: ints, floats, bools, str, bytes,
lists), ``from_config`` the ``quantization_config["hadamard"]`` entry of a converted checkpoint (JSON
values). Each execution mutates a valid seed (PrismML's key set as tests/support/bonsai2_model.py writes it, and
its converted form) a few times — values replaced by other types and edge values, keys dropped or added,
lists cut, grown or nested — and parses it. Allowed outcomes: a spec, or ``ValidationError``. A spec must
survive ``to_config`` → ``from_config`` unchanged. Anything else (another exception, a parse slower than
``HANG_S``) is a finding: the input is pickled to ``--artifacts`` and reported. libFuzzer/atheris are
not used (atheris is not installed here and needs a compiled extension); this is a plain random
mutator, fast enough for 10⁶ executions in minutes.
"""

from __future__ import annotations

import argparse
import math
import pickle
import random
import signal
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from ternary_rs._core import ValidationError  # noqa: E402
from ternary_rs.core import hadamard as H  # noqa: E402

# A parse of these tiny inputs taking longer than this is a hang.
HANG_S = 2.0
EDGE_INTS = [0, 1, -1, 2, 3, 4, 7, 8, 16, 32, 1024, 4096, 2**16, 2**16 + 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1,
             2**63, 2**64, -(2**63), 10**30]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.0, -1.0, 1e308, float("inf"), float("-inf"), float("nan")]
EDGE_STRS = ["", "x", "grouped", "tiled", H.PRISM_TRANSFORM, H.PRISM_AXIS, H.PRISM_SIGN_MODES[0], "identity",
             "blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj", "\x00", "é" * 3]


def _tiny_spec_inputs():
    """PrismML keys for a tiny model (as bonsai2_model.prism_metadata writes them) and a resolver."""
    from support.bonsai2_model import gguf_name, prism_metadata

    rng = np.random.default_rng(0)
    hf = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
          "model.layers.1.linear_attn.out_proj.weight", "lm_head.weight"]
    widths = {hf[0]: 8, hf[1]: 16, hf[2]: 16, hf[3]: 8}
    fake = SimpleNamespace(block_size=4, signs={w: rng.choice(np.array([-1, 1], np.int8), size=w) for w in (8, 16)},
                           rotated_names=hf, inverse_names=["model.embed_tokens.weight"],
                           config={}, sign_mode="explicit", num_layers=2)
    kv = {k[len(H.PRISM_PREFIX):]: v for k, (v, _, _) in prism_metadata(fake).items()}
    by_gguf = {gguf_name(n, 2): (n[: -len(".weight")], widths.get(n, 8)) for n in hf + fake.inverse_names}

    def resolve(name):
        return by_gguf.get(name) if isinstance(name, str) else None

    def gdn_permute_for(module):
        if module.endswith("linear_attn.out_proj"):
            return H.GdnPermute("grouped", "tiled", 2, 1, 8)
        return None

    return kv, resolve, gdn_permute_for


def _random_value(rng: random.Random, gguf: bool, depth: int = 0):
    """A value the source could hold: GGUF reader values (``gguf``: ints, floats, bools, str, bytes, lists)
    or JSON values (ints, floats, bools, None, str, lists, objects)."""
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return rng.choice(EDGE_INTS)
    if kind == 1:
        return rng.randint(-300, 300)
    if kind == 2:
        return rng.choice(EDGE_FLOATS)
    if kind == 3:
        return rng.choice(EDGE_STRS)
    if kind == 4:
        return rng.choice([True, False, None] if not gguf else [True, False])
    if kind == 5:
        if gguf:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(4)))
        return rng.choice(EDGE_STRS)
    if kind == 6:
        return [rng.choice((-1, 1)) for _ in range(rng.choice((0, 1, 4, 8, 16, 24)))]
    if kind == 7:
        return [_random_value(rng, gguf, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 8 and not gguf:
        return {rng.choice(EDGE_STRS + ["from", "to", "width", "num_v_heads", "num_k_heads", "head_dim"]):
                _random_value(rng, gguf, depth + 1) for _ in range(rng.randrange(4))}
    return [rng.choice(EDGE_STRS) for _ in range(rng.randrange(3))]


def _copy(obj):
    """Deep copy of dicts/lists of immutable leaves (much faster than copy.deepcopy)."""
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def _containers(obj, out):
    """Append every dict and list inside ``obj`` (``obj`` included) to ``out``."""
    out.append(obj)
    for v in (obj.values() if isinstance(obj, dict) else obj):
        if isinstance(v, (dict, list)):
            _containers(v, out)
    return out


def mutate(obj, rng: random.Random, gguf: bool):
    """One random structural or value mutation of ``obj`` (a dict), in place."""
    c = rng.choice(_containers(obj, []))
    op = rng.randrange(8)
    if isinstance(c, dict):
        keys = list(c)
        if op == 0 or not keys:
            c[rng.choice(EDGE_STRS + ["version", "block_size", "layers", "extra", "gdn_permute"])] = \
                _random_value(rng, gguf)
        elif op == 1:
            del c[rng.choice(keys)]
        elif op == 2:  # a list value grows, shrinks or gets an odd element
            k = rng.choice(keys)
            if isinstance(c[k], list) and c[k]:
                c[k] = c[k][: rng.randrange(len(c[k]))] if rng.random() < 0.5 else c[k] + [rng.choice(c[k])]
            else:
                c[k] = _random_value(rng, gguf)
        elif op == 3:  # swap two values
            if len(keys) > 1:
                a, b = rng.sample(keys, 2)
                c[a], c[b] = c[b], c[a]
        elif op == 4:  # a neighbour of an int
            k = rng.choice(keys)
            if isinstance(c[k], int) and not isinstance(c[k], bool):
                c[k] = c[k] + rng.choice((-1, 1, c[k], -2 * c[k]))
            else:
                c[k] = _random_value(rng, gguf)
        else:
            c[rng.choice(keys)] = _random_value(rng, gguf)
    else:
        if op == 0 or not c:
            c.append(_random_value(rng, gguf))
        elif op == 1:
            del c[rng.randrange(len(c))]
        elif op == 2:
            c[rng.randrange(len(c))] = _random_value(rng, gguf)
        elif op == 3:
            c.extend(c[: rng.randrange(len(c) + 1)])
        elif op == 4:
            i = rng.randrange(len(c))
            c[i] = -c[i] if isinstance(c[i], int) and not isinstance(c[i], bool) else _random_value(rng, gguf)
        else:
            c[rng.randrange(len(c))] = rng.choice((-1, 1, 0, 2, "1", 1.0, True))


def same_spec(a: H.HadamardSpec, b: H.HadamardSpec) -> bool:
    return (a.block_size == b.block_size and sorted(a.signs) == sorted(b.signs)
            and all(np.array_equal(a.signs[w], b.signs[w]) for w in a.signs)
            and dict(a.layers) == dict(b.layers) and tuple(a.inverse_embeddings) == tuple(b.inverse_embeddings))


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def run(seconds: float, min_execs: int, artifacts: Path | None, seed: int) -> int:
    kv, resolve, gdn_permute_for = _tiny_spec_inputs()
    base_spec = H.HadamardSpec.from_prism(kv, resolve, gdn_permute_for, "seed")
    cfg = base_spec.to_config()
    # The GGUF reader gives lists, never NumPy arrays; JSON gives plain values.
    kv = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in kv.items()}
    seeds = [("from_prism", kv), ("from_config", cfg)]
    rng = random.Random(seed)
    findings: dict[tuple, int] = {}
    execs = accepted = 0
    signal.signal(signal.SIGALRM, _alarm)
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= seconds and execs >= min_execs:
            break
        which, base = seeds[execs % 2]
        obj = _copy(base)
        for _ in range(1 + int(rng.expovariate(0.7))):
            mutate(obj, rng, gguf=which == "from_prism")
        execs += 1
        signal.setitimer(signal.ITIMER_REAL, HANG_S)
        try:
            if which == "from_prism":
                spec = H.HadamardSpec.from_prism(obj, resolve, gdn_permute_for, "fuzz")
            else:
                spec = H.HadamardSpec.from_config(obj, "fuzz")
            again = H.HadamardSpec.from_config(spec.to_config(), "fuzz")
            if not same_spec(spec, again):
                raise AssertionError("to_config -> from_config changed the spec")
            accepted += 1
        except ValidationError:
            pass
        except Exception as e:  # noqa: BLE001 - everything else is a finding
            frame = traceback.extract_tb(e.__traceback__)[-1]
            key = (which, type(e).__name__, Path(frame.filename).name, frame.lineno)
            if key not in findings:
                print(f"FINDING {which}: {type(e).__name__}: {e} at {key[2]}:{key[3]}\n  input: {obj!r}"[:2000],
                      flush=True)
                if artifacts is not None:
                    artifacts.mkdir(parents=True, exist_ok=True)
                    with open(artifacts / f"{which}-{type(e).__name__}-{key[2]}-{key[3]}.pickle", "wb") as f:
                        pickle.dump((which, obj), f)
            findings[key] = findings.get(key, 0) + 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    dt = time.monotonic() - start
    print(f"executions: {execs}")
    print(f"seconds: {math.ceil(dt)}")
    print(f"exec/s: {execs / dt:.0f}")
    print(f"accepted (valid after mutation): {accepted}")
    print(f"distinct findings: {len(findings)}")
    return len(findings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--min-execs", type=int, default=1_000_000)
    ap.add_argument("--artifacts", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sys.exit(1 if run(args.seconds, args.min_execs, args.artifacts, args.seed) else 0)


if __name__ == "__main__":
    main()
