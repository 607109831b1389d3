"""``ternary_rs.ops``: the stable public name of the torch custom ops (defined in :mod:`ternary_rs.serving.ops`,
which documents the contract). Importing it registers ``torch.ops.ternary_rs.*``."""

from .serving.ops import (  # noqa: F401 - re-exported
    AUTO,
    EXACT,
    FWHT_OP_NAME,
    FWHT_SCHEMA,
    INT8_GROUP,
    INT8_TOKEN,
    MOE_OP_NAME,
    MOE_SCHEMA,
    NATIVE_CPU_UNAVAILABLE,
    NATIVE_CUDA_UNAVAILABLE,
    NATIVE_FWHT_UNAVAILABLE,
    OP_NAME,
    SCHEMA,
    fwht,
    prepare_stacked,
    prepare_weight,
    ternary_linear,
)
