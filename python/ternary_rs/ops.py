"""Torch custom ops of ternary_rs — the one place the op is defined.

Contract (stable; the vLLM backend codes against it):

* ``prepare_weight(qweight, scales, group_size) -> (qweight_k, scales_k)`` — called once per layer from
  ``process_weights_after_loading``. Takes the canonical tensors (``uint8 [N, K/4]``, ``float16 [N, K/g]``)
  on the target device and returns them in the layout of that device's kernel (opaque to callers).
* ``torch.ops.ternary_rs.ternary_linear(x, qweight_k, scales_k, out_features, in_features, group_size,
  bias=None, activations=0)`` — ``y[..., N] = x[..., K] @ W.T (+ bias)`` for bf16/fp16/fp32 ``x``; output
  dtype = ``x.dtype``. ``activations`` picks the activation numerics: 0 auto (the device default), 1 exact
  (f32 sums), 2 int8 per token and weight group, 3 int8 per token (BitNet b1.58's ``activation_quant``);
  see ``_ops_cpu`` for the error bounds.

The schema and the fake implementation (for ``torch.compile(fullgraph=True)``) are defined here. Both
device kernels are registered natively with the dispatcher from Rust, so a call runs no Python: the CPU
one by ``_ops_cpu.register_native`` (on torch's intra-op thread pool), the CUDA one by
``_ops_cuda.register_native`` (on the current stream). Where that cannot be done (a torch without the
stable C ABI, a build without CUDA kernels) the same kernels run through Python
(``NATIVE_CPU_UNAVAILABLE`` / ``NATIVE_CUDA_UNAVAILABLE`` say why).
"""

from __future__ import annotations

import logging

import torch

from . import _ops_cpu, _ops_cuda

LIB = "ternary_rs"
OP_NAME = f"{LIB}::ternary_linear"
SCHEMA = (
    "ternary_linear(Tensor x, Tensor qweight, Tensor scales, int out_features, int in_features, "
    "int group_size, Tensor? bias=None, int activations=0) -> Tensor"
)
AUTO, EXACT, INT8_GROUP, INT8_TOKEN = _ops_cpu.AUTO, _ops_cpu.EXACT, _ops_cpu.INT8_GROUP, _ops_cpu.INT8_TOKEN

log = logging.getLogger("ternary_rs.ops")


def prepare_weight(qweight: torch.Tensor, scales: torch.Tensor, group_size: int):
    """Permute canonical tensors once into the layout of the kernel for their device."""
    if qweight.device.type == "cuda":
        return _ops_cuda.prepare_weight(qweight, scales, group_size)
    return _ops_cpu.prepare_weight(qweight, scales, group_size)


def _fake(x, qweight, scales, out_features, in_features, group_size, bias=None, activations=0):
    return x.new_empty((*x.shape[:-1], out_features))


def _define() -> tuple[str | None, str | None]:
    """Define the op once per process; returns why the CPU and the CUDA kernel are not native (None if
    they are)."""
    global _LIBRARY
    _LIBRARY = torch.library.Library(LIB, "FRAGMENT")  # kept alive: dropping it removes the op
    _LIBRARY.define(SCHEMA)
    torch.library.register_fake(OP_NAME, _fake, lib=_LIBRARY)
    why_cpu = _ops_cpu.register_native()
    if why_cpu is not None:
        log.warning("ternary_rs: native CPU op registration unavailable (%s); using the Python path", why_cpu)
        torch.library.impl(OP_NAME, "cpu", _ops_cpu.ternary_linear, lib=_LIBRARY)
    why_cuda = _ops_cuda.register_native()
    if why_cuda is not None:
        if torch.cuda.is_available():  # on a CPU-only machine the Python path only reports errors
            log.warning("ternary_rs: native CUDA op registration unavailable (%s); using the Python path", why_cuda)
        torch.library.impl(OP_NAME, "cuda", _ops_cuda.ternary_linear, lib=_LIBRARY)
    return why_cpu, why_cuda


_LIBRARY: torch.library.Library | None = None
NATIVE_CPU_UNAVAILABLE, NATIVE_CUDA_UNAVAILABLE = _define()
"""Why the CPU / the CUDA kernel runs through Python (None: it is registered natively)."""


def ternary_linear(x, qweight, scales, out_features, in_features, group_size, bias=None, activations=AUTO):
    """``torch.ops.ternary_rs.ternary_linear`` (a convenience alias)."""
    return torch.ops.ternary_rs.ternary_linear(x, qweight, scales, out_features, in_features, group_size, bias,
                                               activations)
