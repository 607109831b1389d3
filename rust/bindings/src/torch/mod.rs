//! The native kernels of `torch.ops.ternary_rs.ternary_linear`, registered with torch's dispatcher
//! through PyTorch's stable C ABI (torch ≥ 2.10), so a call runs no Python.
//!
//! Registration is what `STABLE_TORCH_LIBRARY_IMPL(ternary_rs, <key>, m)` expands to:
//! `aoti_torch_library_init_impl` + `torch_library_impl` with a boxed kernel (`csrc/torch_boxed.cpp`
//! turns our error code into the C++ exception torch expects).
//!
//! Boxed calling convention (`torch/csrc/stable/library.h`): the stack holds one 64-bit StableIValue per
//! argument — tensors as owned `AtenTensorHandle`s (the kernel must free them), ints as `i64`, an
//! optional as a pointer to a heap StableIValue (or null for None; the kernel frees it) — and the
//! kernel writes its outputs (a new owned tensor handle) to the front of the stack.
//!
//! * [`abi`] — the C functions, resolved at run time from the loaded torch libraries;
//! * [`tensor`] — the owned tensor handle;
//! * [`policy`] — the CPU kernel variant and activation precision the Python side sets;
//! * [`pool`] — torch's intra-op pool as the core's `ParallelFor`;
//! * [`cpu_op`] / [`cuda_op`] — the two device kernels and their registration;
//! * [`moe_op`], [`dense_op`], [`fwht_op`], [`attention_op`] — the CPU kernels of `ternary_moe`,
//!   `dense_linear`, `fwht` and `decode_attention`.

/// What every single-kernel CPU op module needs around its `boxed(stack, num_args, num_outputs)`: the
/// `torch::Library` kept for the life of the process, `register(path)` (idempotent) and the
/// `#[no_mangle]` function `$boxed_fn` that `csrc/torch_boxed.cpp`'s `$entry` calls (its error code
/// becomes the C++ exception torch expects there).
macro_rules! cpu_boxed_op {
    ($name:literal, $op:expr, $entry:ident, $boxed_fn:ident) => {
        extern "C" {
            /// `csrc/torch_boxed.cpp`: the boxed entry torch calls; it calls this module's `_boxed` function.
            fn $entry(stack: *mut u64, num_args: u64, num_outputs: u64);
        }

        static LIBRARY: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

        /// Register this module's CPU kernel (whose schema the Python side has defined) with the torch
        /// loaded from `path`. Idempotent.
        pub fn register(path: &str) -> Result<(), String> {
            if LIBRARY.get().is_some() {
                return Ok(());
            }
            let lib = super::register_boxed_op(super::abi::api(path)?, c"CPU", $name, $entry)?;
            let _ = LIBRARY.set(lib);
            Ok(())
        }

        /// Entry point called by `csrc/torch_boxed.cpp`: returns 0, or non-zero with a message in `err`.
        ///
        /// # Safety
        /// `stack` is torch's boxed stack of `max(num_args, num_outputs)` StableIValues; `err` has
        /// `err_len` bytes.
        #[no_mangle]
        pub unsafe extern "C" fn $boxed_fn(
            stack: *mut u64,
            num_args: u64,
            num_outputs: u64,
            err: *mut std::ffi::c_char,
            err_len: usize,
        ) -> i32 {
            // SAFETY: forwarded from our caller's contract.
            unsafe { super::catch_boxed(err, err_len, $op, || boxed(stack, num_args, num_outputs)) }
        }
    };
}

mod abi;
mod attention_op;
mod cpu_op;
mod cuda_op;
mod dense_op;
mod fwht_op;
mod moe_op;
mod policy;
mod pool;
mod tensor;

use std::ffi::{c_char, CStr, CString};

pub(crate) use attention_op::register as register_cpu_attention;
pub(crate) use cpu_op::register as register_cpu;
pub(crate) use cuda_op::{register as register_cuda, set_dequant_min_m};
pub(crate) use dense_op::register as register_cpu_dense;
pub(crate) use fwht_op::register as register_cpu_fwht;
pub(crate) use moe_op::register as register_cpu_moe;
pub(crate) use policy::{
    float_kernel, resolve_precision, set_default_int8, set_variant, set_warm_up_pass, variant,
    warm_up_pass, ACTIVATIONS_AUTO, ACTIVATIONS_EXACT, ACTIVATIONS_INT8_GROUP,
    ACTIVATIONS_INT8_TOKEN,
};

use abi::{registered_api, Api, BoxedFn, Handle};
use tensor::Tensor;
use ternary_core::threads::ParallelFor;

extern "C" {
    /// `csrc/torch_boxed.cpp`: frees a heap StableIValue on a torch without `torch_delete_stable_ivalue`.
    fn ternary_rs_delete_stable_ivalue(p: *mut u64);
}

/// torch's intra-op pool, once a native kernel is registered (the torch library is loaded).
pub(crate) fn intra_op_pool() -> Option<impl ParallelFor + Send> {
    registered_api().map(pool::TorchPool)
}

/// The schema's argument count: x, qweight, scales, out_features, in_features, group_size, bias,
/// activations.
pub const NUM_ARGS: u64 = 8;
/// torch 2.10.0 as `TORCH_ABI_VERSION` encodes it (`torch/headeronly/version.h`): the stable-ABI
/// conventions this kernel was written for.
const BUILD_ABI_VERSION: u64 = (2 << 56) | (10 << 48);

/// `STABLE_TORCH_LIBRARY_IMPL(ternary_rs, <key>, m) { m.impl("ternary_linear", entry); }`: returns the
/// new `torch::Library`, which the caller keeps for the life of the process.
/// The registration names the caller's source line (`torch._C._dispatch_dump` shows it).
#[track_caller]
pub(crate) fn register_boxed(api: &Api, key: &CStr, entry: BoxedFn) -> Result<usize, String> {
    register_boxed_op(api, key, c"ternary_linear", entry)
}

/// [`register_boxed`] for the op `name` of the `ternary_rs` library.
#[track_caller]
pub(crate) fn register_boxed_op(
    api: &Api,
    key: &CStr,
    name: &CStr,
    entry: BoxedFn,
) -> Result<usize, String> {
    let at = std::panic::Location::caller();
    let file = CString::new(at.file()).unwrap_or_default();
    let mut lib: Handle = std::ptr::null_mut();
    // SAFETY: valid C strings; `lib` receives a new heap torch::Library the caller keeps forever.
    let status = unsafe {
        (api.library_init_impl)(
            c"ternary_rs".as_ptr(),
            key.as_ptr(),
            file.as_ptr(),
            at.line(),
            &mut lib,
        )
    };
    if status != 0 || lib.is_null() {
        return Err(format!(
            "aoti_torch_library_init_impl(ternary_rs, {}) failed",
            key.to_string_lossy()
        ));
    }
    // SAFETY: `lib` is the library just created; the entry point follows the boxed convention.
    let status = unsafe { (api.library_impl)(lib, name.as_ptr(), entry, BUILD_ABI_VERSION) };
    if status != 0 {
        return Err(format!(
            "torch_library_impl({}) failed (is the schema defined?)",
            name.to_string_lossy()
        ));
    }
    Ok(lib as usize)
}

/// One `ternary_linear` call's arguments, unboxed from torch's stack; the handles are owned (freed
/// on drop).
pub(crate) struct LinearOp<'a> {
    pub(crate) x: Tensor<'a>,
    pub(crate) qweight: Tensor<'a>,
    pub(crate) scales: Tensor<'a>,
    /// out_features, in_features, group_size.
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) g: usize,
    pub(crate) bias: Option<Tensor<'a>>,
    /// One of the `ACTIVATIONS_*` codes.
    pub(crate) activations: i64,
}

/// The device kernel behind a boxed entry point: the op's arguments and its result.
pub(crate) type LinearFn = for<'a> fn(&'a Api, LinearOp<'a>) -> Result<Tensor<'a>, String>;

/// Unbox the stack, run `kernel`, box its result; an error or panic becomes a message in `err`.
///
/// # Safety
/// As for [`ternary_rs_cpu_linear_boxed`].
pub(crate) unsafe fn run_boxed(
    stack: *mut u64,
    num_args: u64,
    num_outputs: u64,
    err: *mut c_char,
    err_len: usize,
    kernel: LinearFn,
) -> i32 {
    // SAFETY: forwarded from our caller's contract.
    unsafe {
        catch_boxed(err, err_len, "ternary_rs::ternary_linear", || {
            boxed(stack, num_args, num_outputs, kernel)
        })
    }
}

/// Run one boxed call's body; an error or panic becomes a message in `err` (and a non-zero return).
///
/// # Safety
/// `err` has `err_len` writable bytes.
pub(crate) unsafe fn catch_boxed(
    err: *mut c_char,
    err_len: usize,
    op: &str,
    body: impl FnOnce() -> Result<(), String>,
) -> i32 {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    let msg = match result {
        Ok(Ok(())) => return 0,
        Ok(Err(msg)) => msg,
        Err(_) => format!("{op}: internal error (panic)"),
    };
    if err_len > 0 {
        let bytes = msg.as_bytes();
        let n = bytes.len().min(err_len - 1);
        // SAFETY: n + 1 ≤ err_len bytes are written.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), err.cast::<u8>(), n);
            *err.add(n) = 0;
        }
    }
    1
}

/// Take the tensor handle at `stack[i]` (owned: freed when the returned value drops).
///
/// # Safety
/// `stack[i]` is an owned `AtenTensorHandle`.
pub(crate) unsafe fn take_tensor<'a>(api: &'a Api, stack: *mut u64, i: usize) -> Tensor<'a> {
    // SAFETY: per the contract.
    Tensor {
        api,
        h: unsafe { *stack.add(i) } as Handle,
    }
}

/// The registered API, once the boxed call's schema (its argument and output counts) is the one `op`'s
/// kernel was written for (`args` arguments, one output).
pub(crate) fn api_for_schema(
    op: &str,
    counts: (u64, u64),
    args: u64,
) -> Result<&'static Api, String> {
    api_for(op, counts, args, 1)
}

/// [`api_for_schema`] for a kernel with `outputs` outputs (0: it writes into an argument).
pub(crate) fn api_for(
    op: &str,
    (num_args, num_outputs): (u64, u64),
    args: u64,
    outputs: u64,
) -> Result<&'static Api, String> {
    let api = registered_api().ok_or("ternary_rs: native kernel called before registration")?;
    if num_args != args || num_outputs != outputs {
        return Err(format!(
            "{op}: the registered schema has {num_args} arguments and {num_outputs} outputs, this kernel \
             expects {args} and {outputs} (ternary_rs's ops.py and _core are from different versions?)"
        ));
    }
    Ok(api)
}

/// Take the optional tensor at `stack[i]` (None, or an owned handle freed when the value drops); the
/// heap box torch passed it in is freed here.
///
/// # Safety
/// `stack[i]` is a boxed optional tensor: null, or a heap StableIValue holding an owned handle.
pub(crate) unsafe fn take_optional_tensor<'a>(
    api: &'a Api,
    stack: *mut u64,
    i: usize,
) -> Option<Tensor<'a>> {
    // SAFETY: per the contract.
    let boxed = unsafe { *stack.add(i) } as *mut u64;
    if boxed.is_null() {
        return None;
    }
    // SAFETY: a non-null optional is a heap StableIValue holding an owned tensor handle.
    let h = unsafe { *boxed } as Handle;
    match api.delete_stable_ivalue {
        Some(del) => unsafe { del(boxed) },
        None => {
            unsafe { ternary_rs_delete_stable_ivalue(boxed) };
            0
        }
    };
    Some(Tensor { api, h })
}

unsafe fn boxed(
    stack: *mut u64,
    num_args: u64,
    num_outputs: u64,
    kernel: LinearFn,
) -> Result<(), String> {
    let api = api_for_schema(
        "ternary_rs::ternary_linear",
        (num_args, num_outputs),
        NUM_ARGS,
    )?;
    // SAFETY: the stack holds NUM_ARGS entries.
    let arg = |i: usize| unsafe { *stack.add(i) };
    // Take ownership of every handle first, so all are freed whatever fails below.
    let x = Tensor {
        api,
        h: arg(0) as Handle,
    };
    let qweight = Tensor {
        api,
        h: arg(1) as Handle,
    };
    let scales = Tensor {
        api,
        h: arg(2) as Handle,
    };
    // SAFETY: argument 6 is an optional tensor by the schema.
    let bias = unsafe { take_optional_tensor(api, stack, 6) };
    let int_arg = |i: usize, name: &str| -> Result<usize, String> {
        let v = arg(i) as i64;
        usize::try_from(v).map_err(|_| format!("ternary_linear: {name}={v} must be non-negative"))
    };
    let n = int_arg(3, "out_features")?;
    let k = int_arg(4, "in_features")?;
    let g = int_arg(5, "group_size")?;
    let activations = arg(7) as i64;

    let op = LinearOp {
        x,
        qweight,
        scales,
        n,
        k,
        g,
        bias,
        activations,
    };
    let out = kernel(api, op)?;
    // SAFETY: outputs go to the front of the stack; ownership passes to torch.
    unsafe { *stack = out.into_raw() as u64 };
    Ok(())
}
