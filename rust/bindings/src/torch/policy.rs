//! The global CPU-kernel settings the Python side sets and how an op call's `activations` argument
//! resolves against them.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use ternary_core::kernels::cpu::{dense, Precision, Variant};

/// Values of the op's `activations` argument.
pub const ACTIVATIONS_AUTO: i64 = 0;
pub const ACTIVATIONS_EXACT: i64 = 1;
pub const ACTIVATIONS_INT8_GROUP: i64 = 2;
pub const ACTIVATIONS_INT8_TOKEN: i64 = 3;

/// Global CPU-kernel settings the Python side sets (`_ops_cpu.set_kernel_variant`, the
/// `TERNARY_RS_CPU_INT8` default), read by every native call.
static VARIANT: AtomicU8 = AtomicU8::new(0); // 0 auto, 1 scalar, 2 avx2, 3 avx512, 4 amx
static DEFAULT_MODE: AtomicU8 = AtomicU8::new(0); // 0 by dtype, 1 exact, 2 int8

/// Set while vLLM runs its warm-up forward pass on dummy tokens (`ternary_rs.vllm.warm_up`): that pass
/// exists to compile the model's graph and vLLM throws its outputs away, so the CPU ops return zeros
/// instead of doing M = max_num_batched_tokens worth of products (a 27B model's 4096-token pass ran
/// over an hour on a 2-core AVX2 machine before the server could start).
static WARM_UP_PASS: AtomicBool = AtomicBool::new(false);

pub fn set_warm_up_pass(on: bool) {
    WARM_UP_PASS.store(on, Ordering::SeqCst);
}

pub fn warm_up_pass() -> bool {
    WARM_UP_PASS.load(Ordering::SeqCst)
}

pub fn set_variant(v: Option<Variant>) {
    let code = match v {
        None => 0,
        Some(Variant::Scalar) => 1,
        Some(Variant::Avx2) => 2,
        Some(Variant::Avx512) => 3,
        Some(Variant::Amx) => 4,
    };
    VARIANT.store(code, Ordering::Relaxed);
}

pub(crate) fn variant() -> Variant {
    match VARIANT.load(Ordering::Relaxed) {
        1 => Variant::Scalar,
        2 => Variant::Avx2,
        3 => Variant::Avx512,
        4 => Variant::Amx,
        _ => Variant::best(),
    }
}

/// The build of the float kernels (decode attention, the Gated DeltaNet step) that the CPU kernel variant
/// names: `TERNARY_RS_CPU_KERNEL` forces both, for comparisons.
pub(crate) fn float_kernel() -> ternary_core::fast_math::Kernel {
    use ternary_core::fast_math::Kernel;
    match variant() {
        Variant::Scalar => Kernel::Portable,
        Variant::Avx2 => Kernel::Avx2,
        Variant::Avx512 | Variant::Amx => Kernel::Avx512,
    }
}

/// `None`: the dtype decides (int8 for bf16/fp16, exact for f32); `Some(false)`: exact for every
/// dtype; `Some(true)`: int8 for every dtype.
pub fn set_default_int8(v: Option<bool>) {
    DEFAULT_MODE.store(
        match v {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        },
        Ordering::Relaxed,
    );
}

/// The precision an `activations` argument resolves to for activations of `dtype_is_f32`.
pub fn resolve_precision(activations: i64, dtype_is_f32: bool) -> Result<Precision, String> {
    Ok(match activations {
        ACTIVATIONS_AUTO => match DEFAULT_MODE.load(Ordering::Relaxed) {
            1 => Precision::Exact,
            2 => Precision::Int8Group,
            _ => Precision::default_for(dtype_is_f32),
        },
        ACTIVATIONS_EXACT => Precision::Exact,
        ACTIVATIONS_INT8_GROUP => Precision::Int8Group,
        ACTIVATIONS_INT8_TOKEN => Precision::Int8Token,
        other => {
            return Err(format!(
                "activations={other}: expected 0 (auto), 1 (exact), 2 (int8 per group) or 3 (int8 per token)"
            ))
        }
    })
}

/// Whether a bf16 call of `m` tokens runs the dense prefill (decoded bf16 chunks through torch's
/// GEMM): only where torch's bf16 GEMM is native and the int8 kernels in use are slower than it
/// (`dense::prefill_pays`). Only in the default mode: an explicit activations mode or
/// TERNARY_RS_CPU_INT8 keeps its numerics.
pub(crate) fn prefers_dense_prefill(is_bf16: bool, activations: i64, m: usize) -> bool {
    is_bf16
        && activations == ACTIVATIONS_AUTO
        && DEFAULT_MODE.load(Ordering::Relaxed) == 0
        && m >= dense::DENSE_MIN_M
        && dense::prefill_pays(variant())
}
