"""Try to load each checkpoint in vLLM (CPU) and record what happened, for tests/test_vllm_hostile.py.

    python tests/vllm_load_probe.py OUT.json DIR [DIR ...]

For each directory, in order, one ``vllm.LLM(...)`` in this process (engine in-process) and, if it loads,
one greedy token: OUT.json gets ``[{"model", "ok", "error", "text"}]``, rewritten after every case so a
crash keeps the earlier results. ``error`` is ``"<type>: <message>"`` of the exception and its causes.
The ``__main__`` guard is required: vLLM may start processes with ``spawn``.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback


def describe(e: BaseException) -> str:
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def main() -> None:
    out_path, models = sys.argv[1], sys.argv[2:]
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from vllm_runner import cpu_env

    cpu_env(1)
    from vllm import LLM, SamplingParams

    results = []
    for model in models:
        entry = {"model": model, "ok": False, "error": None, "text": None}
        try:
            llm = LLM(model=model, max_model_len=128, enforce_eager=True, dtype="float32", max_num_seqs=4, seed=0)
            out = llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            entry.update(ok=True, text=out[0].outputs[0].text)
            del llm
        except BaseException as e:  # noqa: BLE001 - recording every outcome is the point
            entry["error"] = describe(e)
            entry["traceback"] = traceback.format_exc()[-4000:]
        gc.collect()
        results.append(entry)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
