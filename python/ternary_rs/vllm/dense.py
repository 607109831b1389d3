"""A ternary model's dense layers on CPUs whose torch has no native bf16 GEMM.

Ternary checkpoints keep some layers dense: BitNet's and Falcon3's embeddings and tied ``lm_head``
(128 256 × 2560 in BitNet b1.58 2B4T), Qwen3.5's small ``in_proj_ba``. vLLM CPU multiplies them with
oneDNN, which refuses bf16 without AVX512_BF16 / AMX (Zen 2/3, AVX2-only laptops, older AVX-512 Xeons);
vLLM then falls back to torch's ``F.linear``, whose bf16 GEMM there converts element by element: ~1 GB/s of
weight from 4 tokens up. On such CPUs the dense layers of a ternary model run
``torch.ops.ternary_rs.dense_linear`` instead (``half_linear`` in the Rust core: the weight streamed once
per call and widened in registers, f32 sums). EPYC Zen 2, 2 threads, 2048 → 151 936 (a 1.7B model's head;
``benches/bench_dense.py``): 21.6 ms instead of 43.3 at one token (93 % of the streaming bandwidth), 96.8 ms
instead of 626.6 at 16. Where torch's bf16 GEMM is native, and off the CPU, vLLM's own path stays.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from ..serving import hugepages, ops
from ..serving.cpu import bf16_gemm_is_native

HALF_DTYPES = (torch.bfloat16, torch.float16)
# Set on a weight Parameter once route_to_dense_kernel has moved it to huge pages.
_ON_HUGE_PAGES = "_ternary_rs_on_huge_pages"


def takes_dense_kernel(weight: torch.Tensor | None) -> bool:
    """Whether a dense layer with this weight runs ``ternary_rs.dense_linear``: a 2-D bf16 / f16 CPU weight
    (vLLM has not packed it away for a kernel of its own), on a CPU without native bf16 GEMM, with the
    native kernel registered."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dtype in HALF_DTYPES
        and weight.dim() == 2
        and weight.numel() > 0
        and ops.NATIVE_DENSE_UNAVAILABLE is None
        and not bf16_gemm_is_native()
    )


def dense_cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``layer.cpu_linear`` of a routed layer (vLLM's CPU GEMM hook): anything but activations of the
    weight's half dtype takes torch's linear."""
    if x.dtype != weight.dtype or weight.dtype not in HALF_DTYPES:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.ternary_rs.dense_linear(x, weight, bias)


def route_to_dense_kernel(layer: torch.nn.Module) -> bool:
    """Point vLLM's CPU GEMM hook of ``layer`` at :func:`dense_cpu_linear` where
    :func:`takes_dense_kernel`; whether it did."""
    if not takes_dense_kernel(getattr(layer, "weight", None)):
        return False
    if hugepages.available() and not getattr(layer.weight, _ON_HUGE_PAGES, False):
        # The kernel streams the weight once per call: on 2 MiB pages (hugepages.py). Through ``.data``,
        # so a tied embedding that shares this Parameter moves with it (once: the mark travels with it).
        layer.weight.data = hugepages.copy_of(layer.weight.data)
        setattr(layer.weight, _ON_HUGE_PAGES, True)
    layer.cpu_linear = dense_cpu_linear
    return True


class DenseLinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized linear method; after loading, :func:`route_to_dense_kernel`."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        route_to_dense_kernel(layer)


class DenseEmbeddingMethod(UnquantizedEmbeddingMethod):
    """vLLM's unquantized embedding method (the lookup stays vLLM's); a dense ``lm_head``'s product goes
    through :func:`route_to_dense_kernel`."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        route_to_dense_kernel(layer)
