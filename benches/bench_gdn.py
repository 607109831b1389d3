"""The Gated DeltaNet decode step on CPU: ternary_rs's one call (``ternary_rs.vllm.gdn_decode``, kernel
``rust/ternary-core/src/gdn.rs``) against vLLM CPU's own ``_cpu_gdn_attention_nonspec`` (its Python
around its C++ convolution update and fused delta rule), side by side in one run.

    python benches/bench_gdn.py [--batch 1,4,16] [--threads 2] [--budget 2]

Bonsai 2 / Qwen3.5-27B's GDN widths (16 key / 48 value heads of 128, convolution width 4, 10 240 channels),
vLLM's cache layouts (bf16 windows ``[slots, 3, channels]``, f32 state ``[slots, 48, 128, 128]``), as many
slots as needed to keep the states past the last-level cache (a model has 48 such layers), each decode
step on the next slots. Both sides get the same layer object and metadata and run the same step
(``timed_together`` of benches/bench_cpu_op.py: interleaved runs of calls). Reported: µs per layer and
step, the state bytes read and written per second and their fraction of the streaming read bandwidth
(``torch.sum`` over 1 GiB, measured in the same run), the speed-up, and the largest output difference
against a float64 recurrence (ours and vLLM's, from one step on the same inputs).

Timings on a shared machine are not results: run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_op import stream_bandwidth, timed_together  # noqa: E402

KEY_HEADS, VALUE_HEADS, HEAD_DIM, WIDTH = 16, 48, 128, 4
STATE_BYTES = VALUE_HEADS * HEAD_DIM * HEAD_DIM * 4  # per slot
PAST_CACHE_BYTES = int(os.environ.get("GDN_BENCH_BYTES", 768 << 20))  # the states a step cycles through, read and written


def build(batch: int):
    """A layer as vLLM CPU holds it (packed convolution weight and its plain copy) and its caches."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    g = torch.Generator().manual_seed(batch)
    key_dim, value_dim = KEY_HEADS * HEAD_DIM, VALUE_HEADS * HEAD_DIM
    channels = 2 * key_dim + value_dim
    slots = max(2 * batch, PAST_CACHE_BYTES // STATE_BYTES)
    plain = (torch.randn(channels, WIDTH, generator=g) * 0.5).bfloat16()
    conv1d = types.SimpleNamespace(weight=torch.nn.Parameter(plain.view(channels, 1, WIDTH).clone(),
                                                             requires_grad=False), bias=None)
    if torch.cpu._is_avx512_bf16_supported():  # as vLLM CPU's load does
        conv1d._cpu_unpacked_conv_weight = plain
        conv1d.weight.data = ops.causal_conv1d_weight_pack(plain.contiguous())
    layer = types.SimpleNamespace(
        tp_size=1, num_k_heads=KEY_HEADS, num_v_heads=VALUE_HEADS, head_k_dim=HEAD_DIM, head_v_dim=HEAD_DIM,
        key_dim=key_dim, value_dim=value_dim, activation="silu", conv1d=conv1d,
        A_log=torch.randn(VALUE_HEADS, generator=g), dt_bias=torch.randn(VALUE_HEADS, generator=g).bfloat16(),
        kv_cache=[torch.randn(slots, WIDTH - 1, channels, generator=g).bfloat16(),
                  torch.randn(slots, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=g) * 0.1])
    layer.rearrange_mixed_qkv = QwenGatedDeltaNetAttention.rearrange_mixed_qkv.__get__(layer)
    # the qkvz projection's output and ba's, viewed as forward_cpu hands them over
    qkvz = (torch.randn(batch, channels + value_dim, generator=g) * 2).bfloat16()
    ba = (torch.randn(batch, 2 * VALUE_HEADS, generator=g) * 2).bfloat16()
    b, a = ba.chunk(2, dim=-1)
    return layer, qkvz[:, :channels], b, a, slots


def metadata(batch: int, first_slot: int, slots: int):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    idx = (torch.arange(batch, dtype=torch.int32) + first_slot) % slots
    return GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=batch, num_decode_tokens=batch, num_spec_decodes=0,
        num_spec_decode_tokens=0, num_actual_tokens=batch, non_spec_state_indices_tensor=idx,
        non_spec_query_start_loc=torch.arange(batch + 1, dtype=torch.int32))


def float64_error(layer, mixed_qkv, b, a, run) -> float:
    """Largest |output − float64 recurrence| of one step by ``run`` on slot 0 .. batch (caches restored)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ternary_rs.vllm.gdn_decode import layer_params
    from test_gdn_decode import Step, reference

    batch = mixed_qkv.shape[0]
    saved = [t.clone() for t in layer.kv_cache]
    meta = metadata(batch, 0, layer.kv_cache[1].shape[0])
    out = torch.zeros(batch, VALUE_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    run(layer, meta, mixed_qkv, b, a, out)
    state = saved[1].view(saved[1].shape[0], VALUE_HEADS, HEAD_DIM, HEAD_DIM)  # read as vLLM's kernels do
    step = Step(KEY_HEADS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, WIDTH, layer_params(layer), mixed_qkv, a, b,
                meta.non_spec_state_indices_tensor, saved[0], False, state)
    want = reference(step)[0]
    layer.kv_cache = saved
    return (out.double() - want).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timing per batch size")
    args = ap.parse_args()
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as vllm_gdn
    from vllm.model_executor.layers.mamba import mamba_utils

    import ternary_rs
    from ternary_rs.vllm.gdn_decode import fast_nonspec

    if mamba_utils.is_conv_state_dim_first():
        sys.exit("this bench builds vLLM's default (SD) convolution cache layout: unset VLLM_SSM_CONV_STATE_LAYOUT")
    torch.set_num_threads(args.threads)
    ternary_rs.set_num_threads(args.threads)
    vllm_side = getattr(vllm_gdn._cpu_gdn_attention_nonspec, "__wrapped__", vllm_gdn._cpu_gdn_attention_nonspec)
    ours_side = fast_nonspec(vllm_side)
    bw = stream_bandwidth(args.threads)
    print(f"{args.threads} threads, streaming read {bw:.1f} GB/s; GDN layer: {KEY_HEADS} key / {VALUE_HEADS} value "
          f"heads of {HEAD_DIM}, width {WIDTH}, f32 state {STATE_BYTES / 2**20:.0f} MiB per sequence")
    print(f"{'batch':>5} {'vLLM us':>9} {'ours us':>9} {'x':>6} {'ours state GB/s':>16} {'% bw':>6} "
          f"{'err vs f64 (vLLM / ours)':>26}")
    for batch in map(int, args.batch.split(",")):
        layer, mixed_qkv, b, a, slots = build(batch)
        steps = slots // batch
        metas = [metadata(batch, i * batch, slots) for i in range(steps)]
        out = torch.zeros(batch, VALUE_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        sides = {name: ((lambda i, f=f: f(layer, metas[i], mixed_qkv, b, a, out)), steps, None)
                 for name, f in (("vllm", vllm_side), ("ours", ours_side))}
        times = timed_together(sides, args.budget)
        v, o = times["vllm"][0], times["ours"][0]
        gbs = 2 * batch * STATE_BYTES / o / 1e9
        errs = [float64_error(layer, mixed_qkv, b, a, f) for f in (vllm_side, ours_side)]
        print(f"{batch:>5} {v * 1e6:>9.1f} {o * 1e6:>9.1f} {v / o:>6.2f} {gbs:>16.1f} {100 * gbs / bw:>5.0f}% "
              f"{errs[0]:>13.2e} / {errs[1]:.2e}", flush=True)


if __name__ == "__main__":
    main()
