"""One rank of a 2-process vLLM tensor-parallel world (gloo, CPU) for tests/test_bitnet_vllm.py:

    python tests/support/bitnet_tp_worker.py --rank R --world 2 --init file:///tmp/x --inputs in.npz --out out_R.npz

Builds the end of a BitNet attention block the way ``ternary_rs.vllm.bitnet`` does — ``attn_sub_norm``
(:class:`~ternary_rs.vllm.bitnet.ShardedRMSNorm`) then ``o_proj`` (a ``RowParallelLinear`` with the ternary
method in BitNet's int8-per-token mode) — loads the *full* tensors from ``in.npz`` through vLLM's own weight
loaders (each rank keeps its K shard), feeds its slice of the attention output and writes the all-reduced
output. The ``__main__`` guard matters: vLLM may spawn helpers.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--init", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's CPU shared-memory communicator names its segments after this (its CPU worker sets it).
    os.environ.setdefault("VLLM_DIST_IDENT", "ternary-rs-test-" + os.path.basename(os.path.dirname(args.out)))

    import numpy as np
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.layers.linear import RowParallelLinear

    from ternary_rs.vllm.bitnet import ShardedRMSNorm, use_bitnet_activations
    from ternary_rs.vllm.config import TernaryConfig
    from ternary_rs.vllm.plugin import register

    register()
    data = dict(np.load(args.inputs))
    k, n, g = int(data["k"]), int(data["n"]), int(data["g"])
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(args.world, args.rank, args.init, args.rank, "gloo")
        ensure_model_parallel_initialized(args.world, 1)
        cfg = TernaryConfig.from_config({"quant_method": "ternary", "group_size": g})
        norm = ShardedRMSNorm(k, float(data["eps"]))
        o_proj = RowParallelLinear(k, n, bias=True, quant_config=cfg, prefix="model.layers.0.self_attn.o_proj",
                                   return_bias=False)
        use_bitnet_activations(o_proj)
        norm.weight.weight_loader(norm.weight, torch.from_numpy(data["norm_weight"]))
        o_proj.qweight.weight_loader(o_proj.qweight, torch.from_numpy(data["qweight"]))
        o_proj.scales.weight_loader(o_proj.scales, torch.from_numpy(data["scales"]))
        o_proj.bias.weight_loader(o_proj.bias, torch.from_numpy(data["bias"]))
        o_proj.quant_method.process_weights_after_loading(o_proj)
        assert o_proj.ternary_k_sharded and o_proj.ternary_in_features == k // args.world
        shard = k // args.world
        x = torch.from_numpy(data["x"])[:, args.rank * shard:(args.rank + 1) * shard].contiguous()
        with torch.no_grad():
            y = o_proj(norm(x))
    np.savez(args.out, y=y.numpy(), norm_weight_shard=norm.weight.detach().numpy())


if __name__ == "__main__":
    main()
