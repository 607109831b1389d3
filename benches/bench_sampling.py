"""Top-k / top-p masking on CPU: ternary_rs's selection (``serving/sampling.py``) against vLLM's sort-based
``apply_top_k_top_p_pytorch``, side by side in one run.

    python benches/bench_sampling.py [--vocab 151936,248320] [--rows 1,16,64] [--threads 2] [--rounds 5]

Per vocabulary, rows and setting (top-p 0.95 alone; top-k 20 with top-p 0.95, Qwen3's generation_config
defaults, which vLLM applies to every request that sets none): milliseconds per call of each (minimum over
interleaved rounds, each on a fresh copy of the same f32 logits, ``randn · 3``), the speed-up, and whether
both kept the same tokens. Needs vLLM (its sampler module) installed.
"""

from __future__ import annotations

import argparse
import time

import torch

from ternary_rs.serving import sampling

SETTINGS = {"top-p 0.95": (None, 0.95), "top-k 20 + top-p 0.95": (20, 0.95)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="151936,248320")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.set_num_threads(args.threads)
    import ternary_rs

    ternary_rs.set_num_threads(args.threads)
    print(f"{'vocab':>7} {'rows':>4} {'setting':>22} {'vLLM ms':>9} {'ours ms':>9} {'x':>6}  same kept set")
    for vocab in map(int, args.vocab.split(",")):
        for rows in map(int, args.rows.split(",")):
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab + rows)) * 3
            for name, (k, p) in SETTINGS.items():
                kk = None if k is None else torch.full((rows,), k)
                pp = torch.full((rows,), p)

                def theirs(x):
                    return apply_top_k_top_p_pytorch(x, kk, pp, allow_cpu_sync=True)

                def ours(x):
                    assert sampling.mask_top_k_top_p_(x, kk, pp)
                    return x

                best = {"vllm": float("inf"), "ours": float("inf")}
                kept = {}
                for _ in range(args.rounds):
                    for side, fn in (("vllm", theirs), ("ours", ours)):
                        x = logits.clone()
                        t0 = time.perf_counter()
                        out = fn(x)
                        best[side] = min(best[side], time.perf_counter() - t0)
                        kept[side] = torch.isfinite(out)
                same = torch.equal(kept["vllm"], kept["ours"])
                print(f"{vocab:>7} {rows:>4} {name:>22} {best['vllm'] * 1e3:9.2f} {best['ours'] * 1e3:9.2f} "
                      f"{best['vllm'] / best['ours']:6.1f}  {same}", flush=True)


if __name__ == "__main__":
    main()
