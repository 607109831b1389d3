//! The CPU kernel of `ternary_rs::ternary_linear`: checks the prepared weight, then runs the core's
//! GEMM (or, for bf16 prefill, decoded bf16 chunks through torch's GEMM) on torch's intra-op pool.

use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

use half::{bf16, f16};
use ternary_core::kernels::cpu::{
    self, dense, layout, Activation, KernelChoice, Layout, Precision, PreparedRef,
};
use ternary_core::threads::ParallelFor;

use super::abi::{api, Api, TorchGemm};
use super::policy::{prefers_dense_prefill, resolve_precision, variant, warm_up_pass};
use super::pool::TorchPool;
use super::tensor::{check, Tensor};
use super::{register_boxed, LinearOp};
use crate::kernels::{GemmShape, Pointers};

extern "C" {
    /// `csrc/torch_boxed.cpp`: the boxed entry torch calls; it calls [`ternary_rs_cpu_linear_boxed`].
    fn ternary_rs_cpu_linear_entry(stack: *mut u64, num_args: u64, num_outputs: u64);
}

/// The `torch::Library` our impl lives in; kept for the life of the process (dropping it would
/// deregister the kernel).
static LIBRARY: OnceLock<usize> = OnceLock::new();

/// Resolve the API from the loaded `libtorch_cpu` at `path` and register the CPU kernel of
/// `ternary_rs::ternary_linear` (whose schema the Python side has defined). Idempotent.
pub fn register(path: &str) -> Result<(), String> {
    if LIBRARY.get().is_some() {
        return Ok(());
    }
    let lib = register_boxed(api(path)?, c"CPU", ternary_rs_cpu_linear_entry)?;
    let _ = LIBRARY.set(lib);
    Ok(())
}

/// Entry point called by `csrc/torch_boxed.cpp`: returns 0, or non-zero with a message in `err`.
///
/// # Safety
/// `stack` is torch's boxed stack of `max(num_args, num_outputs)` StableIValues; `err` has `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ternary_rs_cpu_linear_boxed(
    stack: *mut u64,
    num_args: u64,
    num_outputs: u64,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: forwarded from our caller's contract.
    unsafe { super::run_boxed(stack, num_args, num_outputs, err, err_len, linear) }
}

/// The name of a supported activation dtype of `op`'s x.
pub(crate) fn dtype_name(api: &Api, x: &Tensor<'_>, op: &str) -> Result<&'static str, String> {
    let dtype = x.dtype()?;
    if dtype == api.dtype_bf16 {
        Ok("bfloat16")
    } else if dtype == api.dtype_f16 {
        Ok("float16")
    } else if dtype == api.dtype_f32 {
        Ok("float32")
    } else {
        Err(format!(
            "{op}: x dtype is not supported; use bfloat16, float16 or float32"
        ))
    }
}

/// Refuse tensors off the CPU, an x whose last dimension is not `k`, and a weight that is not a
/// prepared CPU layout for `[n, k]` in groups of `g`; returns which layout it is.
fn check_operands(api: &Api, op: &LinearOp<'_>) -> Result<Layout, String> {
    let (n, k, g) = (op.n, op.k, op.g);
    for (t, what) in [
        (&op.x, "x"),
        (&op.qweight, "qweight"),
        (&op.scales, "scales"),
    ] {
        if !t.is_cpu()? {
            return Err(format!(
                "ternary_linear (CPU kernel): {what} is not a CPU tensor"
            ));
        }
    }
    let xs = op.x.sizes()?;
    if xs.is_empty() || xs[xs.len() - 1] as usize != k {
        return Err(format!(
            "ternary_linear: x has shape {xs:?}, expected [..., {k}]"
        ));
    }
    ternary_core::canonical::check_shape(n.max(1), k, g)
        .map_err(|e| format!("ternary_linear: {e}"))?;
    // The two layouts' codes differ in their second dimension for one (n, k): Kp vs 4·Kp.
    let (qweight, scales) = (&op.qweight, &op.scales);
    let qs = qweight.sizes()?;
    let shape_of = |l: Layout| {
        let (q, s) = (l.codes_shape(n, k), l.scales_shape(n, k, g));
        ([q.0 as i64, q.1 as i64], [s.0 as i64, s.1 as i64])
    };
    let layout = [Layout::Rows4, Layout::Lanes16]
        .into_iter()
        .find(|&l| qs == shape_of(l).0)
        .unwrap_or(Layout::Rows4);
    let (want_q, want_s) = shape_of(layout);
    if qweight.dtype()? != api.dtype_u8 || qs != want_q || !qweight.is_contiguous()? {
        return Err(format!(
            "ternary_linear: qweight must be the prepared uint8 {want_q:?} (ops.prepare_weight; {:?} in the lanes16 layout), got shape {qs:?}",
            shape_of(Layout::Lanes16).0
        ));
    }
    if scales.dtype()? != api.dtype_f16 || scales.sizes()? != want_s || !scales.is_contiguous()? {
        return Err(format!(
            "ternary_linear: scales must be the prepared float16 {want_s:?} (ops.prepare_weight, {} layout), got shape {:?}",
            layout.name(),
            scales.sizes()?
        ));
    }
    Ok(layout)
}

/// The bias as a contiguous CPU tensor of shape `[n]` in `dtype`.
fn checked_bias<'a>(
    bias: Option<Tensor<'a>>,
    n: usize,
    dtype: i32,
) -> Result<Option<Tensor<'a>>, String> {
    match bias {
        Some(b) => {
            if b.sizes()? != [n as i64] || !b.is_cpu()? {
                return Err(format!(
                    "ternary_linear: bias must be a CPU tensor of shape [{n}], got {:?}",
                    b.sizes()?
                ));
            }
            Ok(Some(b.contiguous_as(dtype)?))
        }
        None => Ok(None),
    }
}

fn linear<'a>(api: &'a Api, op: LinearOp<'a>) -> Result<Tensor<'a>, String> {
    let name = dtype_name(api, &op.x, "ternary_linear")?;
    let layout = check_operands(api, &op)?;
    let LinearOp {
        x,
        qweight,
        scales,
        n,
        k,
        g,
        bias,
        activations,
    } = op;
    let xs = x.sizes()?.to_vec();
    let dtype = x.dtype()?;
    let x = x.contiguous_as(dtype)?;
    let bias = checked_bias(bias, n, dtype)?;
    let mut out_sizes = xs[..xs.len() - 1].to_vec();
    out_sizes.push(n as i64);
    let y = Tensor::empty(api, &out_sizes, dtype)?;
    let m = x.numel()? / k.max(1);
    if m == 0 || n == 0 {
        return Ok(y);
    }
    let precision = resolve_precision(activations, name == "float32")?;
    if warm_up_pass() {
        y.zero_cpu()?;
        return Ok(y);
    }
    let ptrs = Pointers {
        x: x.data()? as usize,
        planes: qweight.data()? as usize,
        scales: scales.data()? as usize,
        bias: match &bias {
            Some(b) => b.data()? as usize,
            None => 0,
        },
        y: y.data()? as usize,
    };
    let shape = GemmShape { m, n, k, g, layout };
    let pool = TorchPool(api);
    // The dense path decodes row blocks (4-row layout only); a lanes16 weight's prefill runs its int8
    // kernel (the layout is chosen only where that is the faster one: `cpu::int8_layout`).
    if layout == Layout::Rows4 && prefers_dense_prefill(name == "bfloat16", activations, m) {
        if let Some(gemm) = &api.gemm {
            dense_tile_gemm(api, gemm, ptrs, shape, &pool)?;
            return Ok(y);
        }
    }
    match name {
        "bfloat16" => run::<bf16>(ptrs, shape, precision, &pool),
        "float16" => run::<f16>(ptrs, shape, precision, &pool),
        _ => run::<f32>(ptrs, shape, precision, &pool),
    }?;
    Ok(y)
}

fn run<T: Activation>(
    p: Pointers,
    shape: GemmShape,
    precision: Precision,
    pool: &dyn ParallelFor,
) -> Result<(), String> {
    let GemmShape { m, n, k, .. } = shape;
    let w = prepared_weight(p, shape)?;
    // SAFETY: x, bias and y are the data of contiguous CPU tensors whose dtype and shape were checked
    // above (x: m·k elements of T, bias n, y freshly allocated m·n).
    let (x, bias, y) = unsafe {
        (
            std::slice::from_raw_parts(p.x as *const T, m * k),
            (p.bias != 0).then(|| std::slice::from_raw_parts(p.bias as *const T, n)),
            std::slice::from_raw_parts_mut(p.y as *mut T, m * n),
        )
    };
    let choice = KernelChoice {
        variant: variant(),
        precision,
    };
    cpu::gemm(w, x, m, bias, y, choice, pool).map_err(|e| format!("ternary_linear: {e}"))
}

/// The prepared weight behind `p.planes` / `p.scales`.
fn prepared_weight(p: Pointers, shape: GemmShape) -> Result<PreparedRef<'static>, String> {
    let GemmShape {
        n, k, g, layout, ..
    } = shape;
    let planes = layout
        .prepared_bytes(n, k)
        .ok_or("prepared weight size overflows")?;
    let scales = layout
        .prepared_scales(n, k, g)
        .ok_or("prepared scales size overflows")?;
    // SAFETY: both are the data of contiguous CPU tensors checked to have exactly these sizes, alive
    // (held by the caller's handles) for the whole call; 'static never escapes the call.
    Ok(unsafe {
        PreparedRef {
            rows: n,
            cols: k,
            group_size: g,
            layout,
            planes: std::slice::from_raw_parts(p.planes as *const u8, planes),
            scales: std::slice::from_raw_parts(p.scales as *const f16, scales),
        }
    })
}

/// Bytes of bf16 weight decoded per torch GEMM call: big enough that the GEMM's N is wide, small
/// enough to stay in the last-level cache.
const DENSE_CHUNK_BYTES: usize = 16 << 20;

/// `y = x · Wᵀ (+ bias)` for bf16 `x [m, k]`: row chunks of W decoded to bf16, each multiplied by
/// torch's GEMM straight into its columns of `y` (row stride n), the bias added by the same call.
fn dense_tile_gemm(
    api: &Api,
    gemm: &TorchGemm,
    p: Pointers,
    shape: GemmShape,
    pool: &dyn ParallelFor,
) -> Result<(), String> {
    let GemmShape { m, n, k, .. } = shape;
    let w = prepared_weight(p, shape)?;
    let blocks = layout::row_blocks(n);
    let per_chunk = (DENSE_CHUNK_BYTES / (2 * k * layout::ROWS)).clamp(1, blocks);
    // One buffer per thread, kept: a fresh 16 MiB allocation is a fresh mmap, page-faulted on every call.
    thread_local! {
        static BUF: std::cell::RefCell<Vec<bf16>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with(|cell| {
        let mut buf = cell.borrow_mut();
        let need = (per_chunk * layout::ROWS).min(n) * k;
        if buf.len() < need {
            buf.resize(need, bf16::ZERO);
        }
        // A tensor over memory we own (or torch owns: x, y, bias), freed (not the memory) on drop.
        let view =
            |data: usize, sizes: [i64; 2], strides: [i64; 2]| -> Result<Tensor<'_>, String> {
                let mut h = std::ptr::null_mut();
                // SAFETY: `data` points at ≥ the bytes these sizes/strides address, alive past the GEMM.
                check!(
                    unsafe {
                        (gemm.from_blob)(
                            data as *mut c_void,
                            2,
                            sizes.as_ptr(),
                            strides.as_ptr(),
                            0,
                            api.dtype_bf16,
                            api.device_cpu,
                            0,
                            &mut h,
                        )
                    },
                    "create_tensor_from_blob"
                );
                Ok(Tensor { api, h })
            };
        let (mi, ki, ni) = (m as i64, k as i64, n as i64);
        let x = view(p.x, [mi, ki], [ki, 1])?;
        for b0 in (0..blocks).step_by(per_chunk) {
            let b1 = (b0 + per_chunk).min(blocks);
            let (r0, r1) = (b0 * layout::ROWS, (b1 * layout::ROWS).min(n));
            let rows = r1 - r0;
            dense::decode_blocks_bf16(&w, b0..b1, &mut buf[..rows * k], pool)
                .map_err(|e| format!("ternary_linear: {e}"))?;
            let c = rows as i64;
            let wt = view(buf.as_ptr() as usize, [ki, c], [1, ki])?; // Wᵀ chunk [k, rows]
            let out = view(p.y + 2 * r0, [mi, c], [ni, 1])?;
            if p.bias != 0 {
                let bias = view(p.bias + 2 * r0, [mi, c], [0, 1])?; // broadcast over tokens
                                                                    // SAFETY: valid handles; out = 1·bias + 1·(x · wt).
                check!(
                    unsafe { (gemm.addmm_out)(out.h, bias.h, x.h, wt.h, 1.0, 1.0) },
                    "addmm_out"
                );
            } else {
                // SAFETY: valid handles.
                check!(unsafe { (gemm.mm_out)(out.h, x.h, wt.h) }, "mm_out");
            }
        }
        Ok(())
    })
}
