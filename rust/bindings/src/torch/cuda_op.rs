//! The CUDA kernel of `torch.ops.ternary_rs.ternary_linear`, registered natively with torch's
//! dispatcher like the CPU one (`cpu_op.rs`: same stable C ABI, same boxed calling convention), so
//! a call runs no Python.
//!
//! The torch functions the CUDA path needs beyond the CPU ones (the current stream, a device guard,
//! cuBLAS GEMMs for the optional dequantize path) live in `libtorch_cuda.so`, resolved at run time
//! from the copy `import torch` loaded. Every allocation is torch's (caching allocator, ordered on the
//! current stream), and the launchers only enqueue work on that stream, so calls can be captured in
//! CUDA graphs. The numerics are those of the Python path (`_ops_cuda.ternary_linear`), which stays as
//! the fallback and the reference the GPU tests compare against.

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Mutex, OnceLock};

use ternary_core::kernels::gpu_layout as gpu;
use ternary_cuda::{CallPlan, DType, LinearArgs, Quantize};

use super::abi::{self, AddmmOutFn, Api, Handle, HandleFn, LoadedLib, MmOutFn, Status};
use super::policy::{
    ACTIVATIONS_AUTO, ACTIVATIONS_EXACT, ACTIVATIONS_INT8_GROUP, ACTIVATIONS_INT8_TOKEN,
};
use super::tensor::{check, Device, Tensor};
use super::{register_boxed, run_boxed, LinearOp};

extern "C" {
    fn ternary_rs_cuda_linear_entry(stack: *mut u64, num_args: u64, num_outputs: u64);
}

type StreamFn = unsafe extern "C" fn(i32, *mut *mut c_void) -> Status;
type GuardFn = unsafe extern "C" fn(i32, *mut Handle) -> Status;

/// The `libtorch_cuda` functions we call.
struct CudaApi {
    current_stream: StreamFn,
    create_guard: GuardFn,
    delete_guard: HandleFn,
    zero_: HandleFn,
    /// cuBLAS through torch, for the optional dequantize path (`set_dequant_min_m`).
    mm_out: Option<MmOutFn>,
    addmm_out: Option<AddmmOutFn>,
}

static CUDA_API: OnceLock<CudaApi> = OnceLock::new();
static LIBRARY: OnceLock<usize> = OnceLock::new();
/// From this M on, dequantize W and multiply with torch's cuBLAS GEMM (0 = never); `_ops_cuda`'s
/// `set_dequant_min_m` sets it for both paths.
static DEQUANT_MIN_M: AtomicI64 = AtomicI64::new(0);

pub fn set_dequant_min_m(m: i64) -> i64 {
    DEQUANT_MIN_M.swap(m.max(0), Ordering::Relaxed)
}

/// Register the native CUDA kernel (the schema must be defined). `libtorch_cpu` / `libtorch_cuda` are
/// the paths of the loaded libraries. Idempotent.
pub fn register(libtorch_cpu: &str, libtorch_cuda: &str) -> Result<(), String> {
    if LIBRARY.get().is_some() {
        return Ok(());
    }
    if !ternary_cuda::available() {
        return Err("this ternary_rs build has no CUDA kernels".into());
    }
    let api = abi::api(libtorch_cpu)?;
    if CUDA_API.get().is_none() {
        let zero_ = api
            .zero_
            .ok_or_else(|| format!("{libtorch_cpu} has no aoti_torch_zero_"))?;
        let c = load(libtorch_cuda, zero_)?;
        let _ = CUDA_API.set(c);
    }
    let lib = register_boxed(api, c"CUDA", ternary_rs_cuda_linear_entry)?;
    let _ = LIBRARY.set(lib);
    Ok(())
}

fn load(path: &str, zero_: HandleFn) -> Result<CudaApi, String> {
    let lib = LoadedLib::open(path)?;
    // SAFETY (all three): the AOTI shim functions of these names (aoti_torch/c/shim.h, USE_CUDA part)
    // with the C signatures StreamFn / GuardFn / HandleFn spell out.
    let current_stream = unsafe {
        std::mem::transmute::<*mut c_void, StreamFn>(
            lib.sym(c"aoti_torch_get_current_cuda_stream")?,
        )
    };
    let create_guard = unsafe {
        std::mem::transmute::<*mut c_void, GuardFn>(lib.sym(c"aoti_torch_create_cuda_guard")?)
    };
    let delete_guard = unsafe {
        std::mem::transmute::<*mut c_void, HandleFn>(lib.sym(c"aoti_torch_delete_cuda_guard")?)
    };
    // SAFETY: generated/c_shim_cuda.h's mm_out / addmm_out, signatures MmOutFn / AddmmOutFn.
    let mm_out = lib
        .sym(c"aoti_torch_cuda_mm_out")
        .ok()
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, MmOutFn>(p) });
    let addmm_out = lib
        .sym(c"aoti_torch_cuda_addmm_out")
        .ok()
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, AddmmOutFn>(p) });
    Ok(CudaApi {
        current_stream,
        create_guard,
        delete_guard,
        zero_,
        mm_out,
        addmm_out,
    })
}

/// Entry point called by `csrc/torch_boxed.cpp` for CUDA tensors.
///
/// # Safety
/// As for `cpu_op::ternary_rs_cpu_linear_boxed`.
#[no_mangle]
pub unsafe extern "C" fn ternary_rs_cuda_linear_boxed(
    stack: *mut u64,
    num_args: u64,
    num_outputs: u64,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: forwarded from our caller's contract.
    unsafe { run_boxed(stack, num_args, num_outputs, err, err_len, linear) }
}

/// `at::cuda::CUDAGuard` for the call: makes the tensors' device current, restores the previous one.
struct DeviceGuard<'c> {
    cuda: &'c CudaApi,
    h: Handle,
}

impl<'c> DeviceGuard<'c> {
    fn new(cuda: &'c CudaApi, index: i32) -> Result<DeviceGuard<'c>, String> {
        let mut h = std::ptr::null_mut();
        // SAFETY: plain out-parameter; the guard is deleted on drop.
        check!(
            unsafe { (cuda.create_guard)(index, &mut h) },
            "create_cuda_guard"
        );
        Ok(DeviceGuard { cuda, h })
    }
}

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: we own the guard.
        unsafe { (self.cuda.delete_guard)(self.h) };
    }
}

fn err(e: ternary_cuda::CudaError) -> String {
    format!("ternary_linear (CUDA): {e}")
}

/// SM count per device index (the plan's grid sizing), asked once.
fn sm_count(device: i32) -> Result<i32, String> {
    static CACHE: Mutex<Vec<(i32, i32)>> = Mutex::new(Vec::new());
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&(_, c)) = cache.iter().find(|(d, _)| *d == device) {
        return Ok(c);
    }
    let c = ternary_cuda::sm_count(device).map_err(err)?;
    cache.push((device, c));
    Ok(c)
}

/// The split-K tile counters: one zeroed int32 buffer per (device, stream), kept for the life of the
/// process (the kernels leave it zeroed). A buffer that grows is replaced, never freed: CUDA graphs
/// captured earlier may still point at it. A buffer made during a capture is zeroed only by that
/// graph's memset node, so until a call outside any capture zeroes it, every call zeroes it again on
/// its stream (an eager call: now; another capture: a memset node of that graph).
fn counters(
    api: &Api,
    cuda: &CudaApi,
    device: Device,
    stream: u64,
    needed: i64,
    sms: i32,
) -> Result<(u64, i64), String> {
    struct Buffer {
        device: i32,
        stream: u64,
        handle: usize,
        ptr: u64,
        len: i64,
        zeroed_outside_capture: bool,
    }
    static BUFFERS: Mutex<Vec<Buffer>> = Mutex::new(Vec::new());
    let capturing = ternary_cuda::stream_capturing(stream).map_err(err)?;
    let mut buffers = BUFFERS.lock().unwrap_or_else(|p| p.into_inner());
    let slot = buffers
        .iter()
        .position(|b| b.device == device.index && b.stream == stream);
    if let Some(b) = slot.map(|i| &mut buffers[i]) {
        if b.len >= needed {
            if !b.zeroed_outside_capture {
                // SAFETY: the handle we keep forever; zero_ is enqueued on the current stream.
                check!(unsafe { (cuda.zero_)(b.handle as Handle) }, "zero_");
                b.zeroed_outside_capture = !capturing;
            }
            return Ok((b.ptr, b.len));
        }
    }
    // Split-K is only used while tiles < 8 blocks per SM, so this size is rarely exceeded.
    let len = needed.max(8 * sms as i64 + 64);
    let t = Tensor::empty_on(api, &[len], api.dtype_i32, device)?;
    // SAFETY: valid handle; zero_ is enqueued on the current stream, before the kernels that use it.
    check!(unsafe { (cuda.zero_)(t.h) }, "zero_");
    let ptr = t.data()? as u64;
    let entry = Buffer {
        device: device.index,
        stream,
        handle: t.into_raw() as usize, // kept forever
        ptr,
        len,
        zeroed_outside_capture: !capturing,
    };
    match slot {
        Some(i) => buffers[i] = entry,
        None => buffers.push(entry),
    }
    Ok((ptr, len))
}

fn dtype_of(api: &Api, code: i32) -> Option<DType> {
    if code == api.dtype_bf16 {
        Some(DType::Bf16)
    } else if code == api.dtype_f16 {
        Some(DType::Fp16)
    } else if code == api.dtype_f32 {
        Some(DType::Fp32)
    } else {
        None
    }
}

fn code_of(api: &Api, d: DType) -> i32 {
    match d {
        DType::Bf16 => api.dtype_bf16,
        DType::Fp16 => api.dtype_f16,
        DType::Fp32 => api.dtype_f32,
    }
}

/// The sizes of one call and the device it runs on.
#[derive(Clone, Copy)]
struct Call {
    m: i64,
    n: i64,
    k: i64,
    g: i32,
    device: Device,
    stream: u64,
}

/// The activation quantization an `activations` code asks for (auto is exact on CUDA).
fn quantize_mode(activations: i64) -> Result<Quantize, String> {
    match activations {
        ACTIVATIONS_AUTO | ACTIVATIONS_EXACT => Ok(Quantize::None),
        ACTIVATIONS_INT8_GROUP => Ok(Quantize::Groups),
        ACTIVATIONS_INT8_TOKEN => Ok(Quantize::Tokens),
        other => Err(format!(
            "ternary_linear: activations={other}: expected 0, 1, 2 or 3"
        )),
    }
}

/// x's device, after refusing an x off CUDA, a weight on another device, an x whose last dimension
/// is not `k` and a weight that is not the prepared CUDA layout for `[n, k]` in groups of `g`.
fn check_operands(api: &Api, op: &LinearOp<'_>) -> Result<Device, String> {
    let (n, k, g) = (op.n, op.k, op.g);
    let device = op.x.device()?;
    if device.kind != api.device_cuda {
        return Err("ternary_linear (CUDA kernel): x is not a CUDA tensor".into());
    }
    for (t, what) in [(&op.qweight, "qweight"), (&op.scales, "scales")] {
        if t.device()? != device {
            return Err(format!(
                "ternary_linear: {what} is on another device than x (cuda:{})",
                device.index
            ));
        }
    }
    let xs = op.x.sizes()?;
    if xs.is_empty() || xs[xs.len() - 1] as usize != k {
        return Err(format!(
            "ternary_linear: x has {} features (shape {xs:?}), the layer expects {k}",
            xs.last().copied().unwrap_or(0)
        ));
    }
    let (n_pad, k_pad, groups_pad) =
        gpu::padded_dims(n.max(1), k, g).map_err(|e| format!("ternary_linear: {e}"))?;
    let want_q = [
        (n_pad / gpu::CHUNK_N) as i64,
        (k_pad / gpu::CHUNK_K * gpu::CHUNK_BYTES) as i64,
    ];
    let want_s = [groups_pad as i64, n_pad as i64];
    let (qweight, scales) = (&op.qweight, &op.scales);
    if qweight.dtype()? != api.dtype_u8 || qweight.sizes()? != want_q || !qweight.is_contiguous()? {
        return Err(format!(
            "ternary_linear: qweight must be the prepared CUDA layout uint8 {want_q:?} for [{n}, {k}] g{g}, \
             got shape {:?} (call ternary_rs.ops.prepare_weight first)",
            qweight.sizes()?
        ));
    }
    if scales.dtype()? != api.dtype_f16 || scales.sizes()? != want_s || !scales.is_contiguous()? {
        return Err(format!(
            "ternary_linear: scales must be the prepared float16 {want_s:?}, got shape {:?}",
            scales.sizes()?
        ));
    }
    Ok(device)
}

/// The bias as a contiguous tensor of shape `[n]` in `dtype` on `device`.
fn bias_on_device<'a>(
    api: &'a Api,
    bias: Option<Tensor<'a>>,
    n: usize,
    dtype: i32,
    device: Device,
) -> Result<Option<Tensor<'a>>, String> {
    let Some(b) = bias else {
        return Ok(None);
    };
    if b.sizes()? != [n as i64] {
        return Err(format!(
            "ternary_linear: bias must have shape [{n}], got {:?}",
            b.sizes()?
        ));
    }
    if b.device()? == device {
        return Ok(Some(b.contiguous_as(dtype)?));
    }
    // As the Python path's `bias.to(device=x.device)`: copied over (and converted).
    let moved = Tensor::empty_on(api, &[n as i64], dtype, device)?;
    // SAFETY: valid handles of one shape; copy_ moves and converts.
    check!(unsafe { (api.copy_)(moved.h, b.h, 0) }, "copy_");
    Ok(Some(moved))
}

fn linear<'a>(api: &'a Api, op: LinearOp<'a>) -> Result<Tensor<'a>, String> {
    let cuda = CUDA_API
        .get()
        .ok_or("ternary_rs: native CUDA kernel called before registration")?;
    let x_dtype = dtype_of(api, op.x.dtype()?).ok_or(
        "ternary_linear: x dtype is not supported on CUDA; use bfloat16, float16 or float32",
    )?;
    let plan = CallPlan::new(x_dtype, quantize_mode(op.activations)?);
    let device = check_operands(api, &op)?;
    let LinearOp {
        x,
        qweight,
        scales,
        n,
        k,
        g,
        bias,
        ..
    } = op;
    let bias = bias_on_device(api, bias, n, code_of(api, plan.bias_dtype()), device)?;

    let _guard = DeviceGuard::new(cuda, device.index)?;
    let mut stream = std::ptr::null_mut();
    // SAFETY: plain out-parameter.
    check!(
        unsafe { (cuda.current_stream)(device.index, &mut stream) },
        "get_current_cuda_stream"
    );
    let xs = x.sizes()?;
    let mut out_sizes = xs[..xs.len() - 1].to_vec();
    out_sizes.push(n as i64);
    let y = Tensor::empty_on(api, &out_sizes, x.dtype()?, device)?;
    let m = x.numel()? / k.max(1);
    if m == 0 || n == 0 {
        return Ok(y);
    }
    let call = Call {
        m: m as i64,
        n: n as i64,
        k: k as i64,
        g: g as i32,
        device,
        stream: stream as u64,
    };
    let weight = Weight {
        qweight: &qweight,
        scales: &scales,
    };
    let device_call = DeviceCall { api, cuda, call };
    match plan.quantize {
        Quantize::None | Quantize::Groups => {
            run_fused(device_call, plan, x, weight, bias.as_ref(), &y, &out_sizes)?
        }
        Quantize::Tokens => {
            run_token_quantized(device_call, x_dtype, x, weight, bias.as_ref(), &y)?
        }
    }
    Ok(y)
}

/// What every launch of one call needs: the APIs and the call's sizes, device and stream.
#[derive(Clone, Copy)]
struct DeviceCall<'c> {
    api: &'c Api,
    cuda: &'c CudaApi,
    call: Call,
}

/// The prepared weight of one call (GPU layout).
#[derive(Clone, Copy)]
struct Weight<'t> {
    qweight: &'t Tensor<'t>,
    scales: &'t Tensor<'t>,
}

/// Exact activations or int8 per group: x (quantized per group first if asked) through the fused
/// kernels in the plan's compute dtype, converted into y when that differs from x's.
fn run_fused(
    d: DeviceCall<'_>,
    plan: CallPlan,
    x: Tensor<'_>,
    weight: Weight<'_>,
    bias: Option<&Tensor<'_>>,
    y: &Tensor<'_>,
    out_sizes: &[i64],
) -> Result<(), String> {
    let DeviceCall { api, call, .. } = d;
    let compute = code_of(api, plan.compute);
    let xin = if plan.quantize == Quantize::Groups {
        let xc = x.contiguous_as(code_of(api, plan.x))?;
        let xq = Tensor::empty_on(api, &[call.m, call.k], compute, call.device)?;
        // SAFETY: live tensors of this device of [m, k] elements, on the current stream.
        unsafe {
            ternary_cuda::quantize_groups(
                xc.data()? as u64,
                plan.x,
                call.m,
                call.k,
                call.g,
                xq.data()? as u64,
                call.stream,
            )
        }
        .map_err(err)?;
        xq
    } else {
        // The kernels read x with 16-byte loads.
        x.contiguous_aligned(compute, 16)?
    };
    let operands = |y| Operands {
        x: &xin,
        weight,
        bias,
        y,
    };
    if plan.converts_output() {
        let yc = Tensor::empty_on(api, out_sizes, compute, call.device)?;
        gemm(d, plan.compute, operands(&yc))?;
        // SAFETY: valid handles of one shape; copy_ converts the dtype on the current stream.
        check!(unsafe { (api.copy_)(y.h, yc.h, 0) }, "copy_");
    } else {
        gemm(d, plan.compute, operands(y))?;
    }
    Ok(())
}

/// int8 per token: x quantized to f16 codes and one scale per token, multiplied in f16, then each
/// row scaled (and the bias added) into y.
fn run_token_quantized(
    d: DeviceCall<'_>,
    x_dtype: DType,
    x: Tensor<'_>,
    weight: Weight<'_>,
    bias: Option<&Tensor<'_>>,
    y: &Tensor<'_>,
) -> Result<(), String> {
    let DeviceCall { api, call, .. } = d;
    let xc = x.contiguous_as(code_of(api, x_dtype))?;
    let codes = Tensor::empty_on(api, &[call.m, call.k], api.dtype_f16, call.device)?;
    let token_scales = Tensor::empty_on(api, &[call.m], api.dtype_f32, call.device)?;
    // SAFETY: live tensors of this device of the sizes given, on the current stream.
    unsafe {
        ternary_cuda::quantize_tokens(
            xc.data()? as u64,
            x_dtype,
            call.m,
            call.k,
            codes.data()? as u64,
            token_scales.data()? as u64,
            call.stream,
        )
    }
    .map_err(err)?;
    let y16 = Tensor::empty_on(api, &[call.m, call.n], api.dtype_f16, call.device)?;
    let operands = Operands {
        x: &codes,
        weight,
        bias: None,
        y: &y16,
    };
    gemm(d, DType::Fp16, operands)?;
    // SAFETY: as above; y has m·n elements of x's dtype.
    unsafe {
        ternary_cuda::scale_rows(
            y16.data()? as u64,
            token_scales.data()? as u64,
            match bias {
                Some(b) => b.data()? as u64,
                None => 0,
            },
            y.data()? as u64,
            x_dtype,
            call.m,
            call.n,
            call.stream,
        )
    }
    .map_err(err)
}

/// The tensors of one GEMM: `y = x · Wᵀ (+ bias)`.
struct Operands<'t> {
    x: &'t Tensor<'t>,
    weight: Weight<'t>,
    bias: Option<&'t Tensor<'t>>,
    y: &'t Tensor<'t>,
}

/// `y[m, n] = x[m, k] @ Wᵀ (+ bias)` in `dtype`: the fused kernels, or from `DEQUANT_MIN_M` on W
/// dequantized into a temporary and torch's cuBLAS GEMM (bias added by the same call).
fn gemm(d: DeviceCall<'_>, dtype: DType, o: Operands<'_>) -> Result<(), String> {
    let DeviceCall { api, cuda, call: c } = d;
    let dequant_min_m = DEQUANT_MIN_M.load(Ordering::Relaxed);
    if dequant_min_m > 0 && c.m >= dequant_min_m {
        return dequantized_gemm(d, dtype, o);
    }
    let sms = sm_count(c.device.index)?;
    let p = ternary_cuda::plan(c.m, c.n, c.k, c.g, sms).map_err(err)?;
    let (mut partials, mut partials_len, mut counters_ptr, mut counters_len) = (0, 0, 0, 0);
    // Per call from torch's caching allocator (stream-ordered, graph-safe); freed after the enqueue.
    let workspace;
    if p.splits > 1 {
        workspace = Tensor::empty_on(api, &[p.partial_floats], api.dtype_f32, c.device)?;
        partials = workspace.data()? as u64;
        partials_len = p.partial_floats;
        (counters_ptr, counters_len) = counters(api, cuda, c.device, c.stream, p.counters, sms)?;
    }
    let args = LinearArgs {
        x: o.x.data()? as u64,
        qweight: o.weight.qweight.data()? as u64,
        scales: o.weight.scales.data()? as u64,
        bias: match o.bias {
            Some(b) => b.data()? as u64,
            None => 0,
        },
        y: o.y.data()? as u64,
        partials,
        partials_len,
        counters: counters_ptr,
        counters_len,
        m: c.m,
        n: c.n,
        k: c.k,
        group_size: c.g,
        dtype,
        sm_count: sms,
        stream: c.stream,
    };
    // SAFETY: every pointer is the data of a live tensor of this device with the sizes the plan and
    // the layout require (checked by the caller); the launcher re-checks sizes and alignment.
    unsafe { ternary_cuda::linear(&args) }.map_err(err)
}

/// W dequantized into a temporary `[n, k]` of `dtype`, then torch's cuBLAS GEMM.
fn dequantized_gemm(d: DeviceCall<'_>, dtype: DType, o: Operands<'_>) -> Result<(), String> {
    let DeviceCall { api, cuda, call: c } = d;
    let (Some(mm_out), Some(addmm_out)) = (cuda.mm_out, cuda.addmm_out) else {
        return Err(
            "ternary_linear: the dequantize path needs torch's cuBLAS GEMM through the stable ABI \
                    (aoti_torch_cuda_mm_out), which this torch lacks; set_dequant_min_m(0)"
                .into(),
        );
    };
    let w = Tensor::empty_on(api, &[c.n, c.k], code_of(api, dtype), c.device)?;
    // SAFETY: live tensors of this device in the GPU layout for (n, k, g) and [n, k] of `dtype`.
    unsafe {
        ternary_cuda::dequantize(
            o.weight.qweight.data()? as u64,
            o.weight.scales.data()? as u64,
            w.data()? as u64,
            c.n,
            c.k,
            c.g,
            dtype,
            c.stream,
        )
    }
    .map_err(err)?;
    // 2-D views of the contiguous x and y (which may have more dimensions) and Wᵀ.
    let xv = o.x.view(&[c.m, c.k], &[c.k, 1])?;
    let wt = w.view(&[c.k, c.n], &[1, c.k])?;
    let out = o.y.view(&[c.m, c.n], &[c.n, 1])?;
    match o.bias {
        // The 1-D bias, as `F.linear` passes it (cuBLASLt's bias epilogue).
        // SAFETY: valid handles; out = 1·bias + 1·(x · wt).
        Some(b) => check!(
            unsafe { addmm_out(out.h, b.h, xv.h, wt.h, 1.0, 1.0) },
            "cuda_addmm_out"
        ),
        // SAFETY: valid handles.
        None => check!(unsafe { mm_out(out.h, xv.h, wt.h) }, "cuda_mm_out"),
    }
    Ok(())
}
