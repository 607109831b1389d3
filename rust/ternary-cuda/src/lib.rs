//! FFI to the fused ternary CUDA kernels in `cuda/` (compiled by `build.rs` when the `nvcc` feature is on).
//!
//! The launchers take raw device pointers and a `cudaStream_t` and only enqueue work, so the Python side
//! (PyTorch tensors, `torch.cuda.current_stream()`) owns every allocation and the calls can be captured
//! in CUDA graphs. Without the feature every entry point returns [`CudaError::NotBuilt`].

use std::fmt;

/// Activation dtypes: the GEMM kernels take bf16 and fp16 (`x`, `bias` and `y` share one); the
/// activation quantizers and the row-scale epilogue also take fp32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum DType {
    Bf16 = 0,
    Fp16 = 1,
    Fp32 = 2,
}

/// The activation quantizer a `ternary_linear` call runs before the GEMM (the op's `activations`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantize {
    /// x as it is (auto and exact).
    None,
    /// BitNet's int8 per token: fp16 codes q · 2⁻⁷ into an fp16 GEMM, the token scale applied after it.
    Tokens,
    /// int8 per token and weight group: the dequantized q · xs_g in bf16 into a bf16 GEMM.
    Groups,
}

/// The dtypes one `ternary_linear` call moves through on CUDA: the GEMM's compute dtype, and what x,
/// the bias and y are converted to and from. fp32 x runs the GEMM in bf16 (the tensor cores take no
/// fp32 inputs), the result converted back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallPlan {
    pub x: DType,
    pub quantize: Quantize,
    /// The GEMM's input and output dtype.
    pub compute: DType,
}

impl CallPlan {
    pub fn new(x: DType, quantize: Quantize) -> CallPlan {
        let compute = match quantize {
            Quantize::Tokens => DType::Fp16,
            Quantize::Groups => DType::Bf16,
            Quantize::None if x == DType::Fp32 => DType::Bf16,
            Quantize::None => x,
        };
        CallPlan {
            x,
            quantize,
            compute,
        }
    }

    /// The bias is added in this dtype: by the GEMM, or in f32 by the per-token epilogue.
    pub fn bias_dtype(&self) -> DType {
        match self.quantize {
            Quantize::Tokens => DType::Fp32,
            _ => self.compute,
        }
    }

    /// Whether the GEMM writes a temporary that is then converted into y (per token the epilogue
    /// writes y in x's dtype itself).
    pub fn converts_output(&self) -> bool {
        self.quantize != Quantize::Tokens && self.compute != self.x
    }
}

/// How a call runs and the workspace it needs (see `cuda/ternary_gemm.h`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// 0 = decode GEMV (M ≤ 8), 1..=4 = mma GEMM with 16/32/64/128-row tiles.
    pub kernel: i32,
    pub splits: i32,
    pub grid_n: i32,
    pub grid_m: i32,
    /// fp32 elements of split-K partials (0: none).
    pub partial_floats: i64,
    /// int32 tile counters, zero before the first call (0: none).
    pub counters: i64,
}

/// Raw device pointers of one call. `bias`, `partials` and `counters` may be null when not needed.
#[derive(Clone, Copy, Debug)]
pub struct LinearArgs {
    pub x: u64,
    pub qweight: u64,
    pub scales: u64,
    pub bias: u64,
    pub y: u64,
    pub partials: u64,
    /// Elements available at `partials` (checked against the plan).
    pub partials_len: i64,
    pub counters: u64,
    /// Elements available at `counters` (checked against the plan).
    pub counters_len: i64,
    pub m: i64,
    pub n: i64,
    pub k: i64,
    pub group_size: i32,
    pub dtype: DType,
    pub sm_count: i32,
    /// A `cudaStream_t` (0 = the legacy default stream).
    pub stream: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaError {
    /// This build has no CUDA kernels (the `nvcc` feature was off).
    NotBuilt,
    /// A code from the C launchers with its message.
    Launch { code: i32, message: String },
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::NotBuilt => write!(
                f,
                "ternary_rs was built without CUDA kernels (rebuild with the `cuda` feature and a CUDA toolkit)"
            ),
            CudaError::Launch { code, message } => write!(f, "ternary CUDA kernel error {code}: {message}"),
        }
    }
}

impl std::error::Error for CudaError {}

/// Whether this build contains the CUDA kernels.
pub fn available() -> bool {
    cfg!(feature = "nvcc")
}

#[cfg(feature = "nvcc")]
mod ffi {
    use super::Plan;
    use std::ffi::{c_char, c_int, c_void};

    extern "C" {
        pub fn ternary_cuda_plan(
            m: i64,
            n: i64,
            k: i64,
            group_size: i32,
            sm_count: i32,
            plan: *mut Plan,
        ) -> c_int;
        pub fn ternary_cuda_linear(
            x: *const c_void,
            qweight: *const c_void,
            scales: *const c_void,
            bias: *const c_void,
            y: *mut c_void,
            partials: *mut f32,
            partials_len: i64,
            counters: *mut i32,
            counters_len: i64,
            m: i64,
            n: i64,
            k: i64,
            group_size: i32,
            dtype: i32,
            sm_count: i32,
            stream: *mut c_void,
        ) -> c_int;
        pub fn ternary_cuda_set_gemv_max_m(m: i32) -> c_int;
        pub fn ternary_cuda_dequantize(
            qweight: *const c_void,
            scales: *const c_void,
            w_out: *mut c_void,
            n: i64,
            k: i64,
            group_size: i32,
            dtype: i32,
            stream: *mut c_void,
        ) -> c_int;
        pub fn ternary_cuda_device_count(count: *mut i32) -> c_int;
        pub fn ternary_cuda_sm_count(device: i32, count: *mut i32) -> c_int;
        pub fn ternary_cuda_stream_capturing(stream: *mut c_void, capturing: *mut i32) -> c_int;
        pub fn ternary_cuda_quantize_tokens(
            x: *const c_void,
            x_dtype: i32,
            m: i64,
            k: i64,
            codes: *mut c_void,
            xs: *mut f32,
            stream: *mut c_void,
        ) -> c_int;
        pub fn ternary_cuda_quantize_groups(
            x: *const c_void,
            x_dtype: i32,
            m: i64,
            k: i64,
            group_size: i32,
            out: *mut c_void,
            stream: *mut c_void,
        ) -> c_int;
        pub fn ternary_cuda_scale_rows(
            y16: *const c_void,
            xs: *const f32,
            bias: *const f32,
            out: *mut c_void,
            out_dtype: i32,
            m: i64,
            n: i64,
            stream: *mut c_void,
        ) -> c_int;
        pub fn ternary_cuda_error_string(code: c_int) -> *const c_char;
    }
}

#[cfg(feature = "nvcc")]
fn check(code: i32) -> Result<(), CudaError> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: the C side returns a pointer to a static NUL-terminated string for every code.
    let message = unsafe { std::ffi::CStr::from_ptr(ffi::ternary_cuda_error_string(code)) }
        .to_string_lossy()
        .into_owned();
    Err(CudaError::Launch { code, message })
}

/// The plan (kernel, K-splits, workspace sizes) for a call of these sizes on a device with `sm_count` SMs.
pub fn plan(m: i64, n: i64, k: i64, group_size: i32, sm_count: i32) -> Result<Plan, CudaError> {
    #[cfg(feature = "nvcc")]
    {
        let mut p = Plan::default();
        // SAFETY: `p` is a valid, writable `Plan` with the C layout of `TernaryCudaPlan`.
        check(unsafe { ffi::ternary_cuda_plan(m, n, k, group_size, sm_count, &mut p) })?;
        Ok(p)
    }
    #[cfg(not(feature = "nvcc"))]
    {
        let _ = (m, n, k, group_size, sm_count);
        Err(CudaError::NotBuilt)
    }
}

/// Enqueue `y = x @ W^T (+ bias)` on `args.stream`.
///
/// # Safety
/// Every non-null pointer must be a live device allocation of the current CUDA device, large enough for
/// the sizes given (`x`: m·k, `y`: m·n, `bias`: n activations; `qweight`/`scales` in the GPU layout of
/// `ternary_core::kernels::gpu_layout` for (n, k, group_size); `partials`/`counters` as [`plan`] says),
/// and must stay alive until the enqueued work has run. `stream` must be a stream of that device.
pub unsafe fn linear(args: &LinearArgs) -> Result<(), CudaError> {
    #[cfg(feature = "nvcc")]
    {
        use std::ffi::c_void;
        let a = args;
        // SAFETY: forwarded to the caller's contract above; the C side validates sizes and alignment.
        check(unsafe {
            ffi::ternary_cuda_linear(
                a.x as *const c_void,
                a.qweight as *const c_void,
                a.scales as *const c_void,
                a.bias as *const c_void,
                a.y as *mut c_void,
                a.partials as *mut f32,
                a.partials_len,
                a.counters as *mut i32,
                a.counters_len,
                a.m,
                a.n,
                a.k,
                a.group_size,
                a.dtype as i32,
                a.sm_count,
                a.stream as *mut c_void,
            )
        })
    }
    #[cfg(not(feature = "nvcc"))]
    {
        let _ = args;
        Err(CudaError::NotBuilt)
    }
}

/// Enqueue the dequantization `w_out[N, K] = trit · scale` (dtype, row-major) from the GPU layout.
///
/// # Safety
/// `qweight`/`scales` must be live device tensors in the GPU layout for (n, k, group_size), `w_out` a
/// live device buffer of n·k elements of `dtype`, all on the current device, alive until the work has run.
#[allow(clippy::too_many_arguments)]
pub unsafe fn dequantize(
    qweight: u64,
    scales: u64,
    w_out: u64,
    n: i64,
    k: i64,
    group_size: i32,
    dtype: DType,
    stream: u64,
) -> Result<(), CudaError> {
    #[cfg(feature = "nvcc")]
    {
        use std::ffi::c_void;
        // SAFETY: forwarded to the caller's contract above; the C side validates sizes and alignment.
        check(unsafe {
            ffi::ternary_cuda_dequantize(
                qweight as *const c_void,
                scales as *const c_void,
                w_out as *mut c_void,
                n,
                k,
                group_size,
                dtype as i32,
                stream as *mut c_void,
            )
        })
    }
    #[cfg(not(feature = "nvcc"))]
    {
        let _ = (qweight, scales, w_out, n, k, group_size, dtype, stream);
        Err(CudaError::NotBuilt)
    }
}

/// Enqueue BitNet's per-token activation quantization of `x [m, k]` (`x_dtype`): `codes` (fp16
/// `[m, k]`) = q · 2⁻⁷ and `xs` (f32 `[m]`) = 1 / scale, the CPU kernel's codes and scales bit for bit
/// (`cuda/activation_quant.h`).
///
/// # Safety
/// Live device buffers of the current device of those sizes, alive until the work has run; `stream` a
/// stream of that device.
#[allow(clippy::too_many_arguments)]
pub unsafe fn quantize_tokens(
    x: u64,
    x_dtype: DType,
    m: i64,
    k: i64,
    codes: u64,
    xs: u64,
    stream: u64,
) -> Result<(), CudaError> {
    #[cfg(feature = "nvcc")]
    {
        use std::ffi::c_void;
        // SAFETY: forwarded to the caller's contract; the C side validates sizes and null pointers.
        check(unsafe {
            ffi::ternary_cuda_quantize_tokens(
                x as *const c_void,
                x_dtype as i32,
                m,
                k,
                codes as *mut c_void,
                xs as *mut f32,
                stream as *mut c_void,
            )
        })
    }
    #[cfg(not(feature = "nvcc"))]
    {
        let _ = (x, x_dtype, m, k, codes, xs, stream);
        Err(CudaError::NotBuilt)
    }
}

/// Enqueue the per-group activation quantization of `x [m, k]`: `out` (bf16 `[m, k]`) = q · xs_g per
/// token and weight group of `group_size`.
///
/// # Safety
/// As for [`quantize_tokens`].
pub unsafe fn quantize_groups(
    x: u64,
    x_dtype: DType,
    m: i64,
    k: i64,
    group_size: i32,
    out: u64,
    stream: u64,
) -> Result<(), CudaError> {
    #[cfg(feature = "nvcc")]
    {
        use std::ffi::c_void;
        // SAFETY: forwarded to the caller's contract; the C side validates sizes and null pointers.
        check(unsafe {
            ffi::ternary_cuda_quantize_groups(
                x as *const c_void,
                x_dtype as i32,
                m,
                k,
                group_size,
                out as *mut c_void,
                stream as *mut c_void,
            )
        })
    }
    #[cfg(not(feature = "nvcc"))]
    {
        let _ = (x, x_dtype, m, k, group_size, out, stream);
        Err(CudaError::NotBuilt)
    }
}

/// Enqueue the per-token epilogue `out[m, n] = fl(y16 · xs[row] · 2⁷) + bias[col]` (`y16` fp16, `xs`
/// and `bias` f32, `bias` 0 for none, `out` of `out_dtype`).
///
/// # Safety
/// As for [`quantize_tokens`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn scale_rows(
    y16: u64,
    xs: u64,
    bias: u64,
    out: u64,
    out_dtype: DType,
    m: i64,
    n: i64,
    stream: u64,
) -> Result<(), CudaError> {
    #[cfg(feature = "nvcc")]
    {
        use std::ffi::c_void;
        // SAFETY: forwarded to the caller's contract; the C side validates sizes and null pointers.
        check(unsafe {
            ffi::ternary_cuda_scale_rows(
                y16 as *const c_void,
                xs as *const f32,
                bias as *const f32,
                out as *mut c_void,
                out_dtype as i32,
                m,
                n,
                stream as *mut c_void,
            )
        })
    }
    #[cfg(not(feature = "nvcc"))]
    {
        let _ = (y16, xs, bias, out, out_dtype, m, n, stream);
        Err(CudaError::NotBuilt)
    }
}

/// Streaming multiprocessors of CUDA device `device` (the plan's `sm_count`).
pub fn sm_count(device: i32) -> Result<i32, CudaError> {
    #[cfg(feature = "nvcc")]
    {
        let mut c = 0i32;
        // SAFETY: `c` is a valid out pointer; the call only queries a device attribute.
        check(unsafe { ffi::ternary_cuda_sm_count(device, &mut c) })?;
        Ok(c)
    }
    #[cfg(not(feature = "nvcc"))]
    {
        let _ = device;
        Err(CudaError::NotBuilt)
    }
}

/// Whether `stream` (a `cudaStream_t`) is being captured into a CUDA graph.
pub fn stream_capturing(stream: u64) -> Result<bool, CudaError> {
    #[cfg(feature = "nvcc")]
    {
        let mut c = 0i32;
        // SAFETY: `c` is a valid out pointer; cudaStreamIsCapturing only queries the stream.
        check(unsafe {
            ffi::ternary_cuda_stream_capturing(stream as *mut std::ffi::c_void, &mut c)
        })?;
        Ok(c != 0)
    }
    #[cfg(not(feature = "nvcc"))]
    {
        let _ = stream;
        Err(CudaError::NotBuilt)
    }
}

/// Largest M the decode GEMV handles (the kernel supports up to this).
pub const GEMV_MAX_ROWS: i32 = 16;

/// Set the largest M that runs the decode GEMV (0..=[`GEMV_MAX_ROWS`], default 8; larger M runs the mma
/// GEMM). Process-wide, for tuning; returns the previous value.
pub fn set_gemv_max_m(m: i32) -> Result<i32, CudaError> {
    #[cfg(feature = "nvcc")]
    {
        // SAFETY: plain value call; the C side range-checks it.
        let prev = unsafe { ffi::ternary_cuda_set_gemv_max_m(m) };
        if prev < 0 {
            check(prev)?;
        }
        Ok(prev)
    }
    #[cfg(not(feature = "nvcc"))]
    {
        let _ = m;
        Err(CudaError::NotBuilt)
    }
}

/// Number of visible CUDA devices (0 without a driver, a device, or the kernels). Never fails.
pub fn device_count() -> i32 {
    #[cfg(feature = "nvcc")]
    {
        let mut c = 0i32;
        // SAFETY: `c` is a valid out pointer; the call only queries the runtime.
        unsafe { ffi::ternary_cuda_device_count(&mut c) };
        c
    }
    #[cfg(not(feature = "nvcc"))]
    {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_layout_matches_c() {
        // TernaryCudaPlan: 4 × int32 then 2 × int64.
        assert_eq!(std::mem::size_of::<Plan>(), 32);
        assert_eq!(std::mem::align_of::<Plan>(), 8);
    }

    #[test]
    fn call_plans_pick_the_gemm_dtype_and_the_conversions() {
        use DType::*;
        let cases = [
            // x, quantize, compute, bias dtype, y converted from a temporary
            (Bf16, Quantize::None, Bf16, Bf16, false),
            (Fp16, Quantize::None, Fp16, Fp16, false),
            (Fp32, Quantize::None, Bf16, Bf16, true),
            (Bf16, Quantize::Tokens, Fp16, Fp32, false),
            (Fp16, Quantize::Tokens, Fp16, Fp32, false),
            (Fp32, Quantize::Tokens, Fp16, Fp32, false),
            (Bf16, Quantize::Groups, Bf16, Bf16, false),
            (Fp16, Quantize::Groups, Bf16, Bf16, true),
            (Fp32, Quantize::Groups, Bf16, Bf16, true),
        ];
        for (x, q, compute, bias, converts) in cases {
            let p = CallPlan::new(x, q);
            assert_eq!(
                (p.compute, p.bias_dtype(), p.converts_output()),
                (compute, bias, converts),
                "{x:?} {q:?}"
            );
        }
    }

    #[cfg(not(feature = "nvcc"))]
    #[test]
    fn without_kernels_everything_reports_not_built() {
        assert!(!available());
        assert_eq!(device_count(), 0);
        assert_eq!(plan(1, 32, 64, 64, 1), Err(CudaError::NotBuilt));
        assert_eq!(sm_count(0), Err(CudaError::NotBuilt));
        assert_eq!(stream_capturing(0), Err(CudaError::NotBuilt));
        // SAFETY: without kernels nothing is called.
        assert_eq!(
            unsafe { quantize_tokens(8, DType::Bf16, 1, 64, 8, 8, 0) },
            Err(CudaError::NotBuilt)
        );
    }

    #[cfg(feature = "nvcc")]
    #[test]
    fn plan_and_errors_without_a_gpu() {
        // Planning is pure host code: it works with no device.
        let p = plan(1, 6144, 5120, 128, 132).unwrap();
        assert_eq!(p.kernel, 0);
        assert!(p.splits >= 1);
        let p = plan(2048, 6144, 5120, 128, 132).unwrap();
        assert_eq!((p.kernel, p.splits, p.partial_floats), (4, 1, 0));
        match plan(1, 32, 100, 64, 132) {
            Err(CudaError::Launch { code: -1, message }) => assert!(message.contains("multiple")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            plan(1, 32, 96, 48, 132),
            Err(CudaError::Launch { code: -2, .. })
        ));
        // Bad pointers are rejected before anything touches the device.
        let args = LinearArgs {
            x: 0,
            qweight: 0,
            scales: 0,
            bias: 0,
            y: 0,
            partials: 0,
            partials_len: 0,
            counters: 0,
            counters_len: 0,
            m: 1,
            n: 32,
            k: 64,
            group_size: 64,
            dtype: DType::Bf16,
            sm_count: 1,
            stream: 0,
        };
        // SAFETY: null pointers are rejected by the launcher before any CUDA call.
        assert!(matches!(
            unsafe { linear(&args) },
            Err(CudaError::Launch { code: -4, .. })
        ));
        assert!(device_count() >= 0);
        // The GEMV cut-off moves the plan between the decode kernel and the 16-row mma tile.
        assert_eq!(plan(16, 4096, 4096, 128, 132).unwrap().kernel, 1);
        assert_eq!(set_gemv_max_m(16), Ok(8));
        assert_eq!(plan(16, 4096, 4096, 128, 132).unwrap().kernel, 0);
        assert!(set_gemv_max_m(17).is_err());
        assert_eq!(set_gemv_max_m(8), Ok(16));
        // SAFETY: null pointers are rejected before any CUDA call.
        let r = unsafe { dequantize(0, 0, 0, 32, 64, 64, DType::Fp16, 0) };
        assert!(matches!(r, Err(CudaError::Launch { code: -4, .. })));
        // The activation functions check their arguments on the host too.
        // SAFETY: every call below is rejected before any CUDA call.
        unsafe {
            assert!(matches!(
                quantize_tokens(0, DType::Bf16, 1, 64, 0, 0, 0),
                Err(CudaError::Launch { code: -4, .. })
            ));
            assert!(matches!(
                quantize_tokens(8, DType::Bf16, 0, 64, 8, 8, 0),
                Err(CudaError::Launch { code: -1, .. })
            ));
            assert!(matches!(
                quantize_groups(8, DType::Fp32, 1, 96, 64, 8, 0),
                Err(CudaError::Launch { code: -1, .. })
            ));
            assert!(matches!(
                quantize_groups(8, DType::Fp32, 1, 96, 48, 8, 0),
                Err(CudaError::Launch { code: -2, .. })
            ));
            assert!(matches!(
                scale_rows(8, 8, 0, 0, DType::Fp16, 1, 1, 0),
                Err(CudaError::Launch { code: -4, .. })
            ));
        }
        // fp32 is for the activation functions only: the GEMM refuses it.
        let args32 = LinearArgs {
            dtype: DType::Fp32,
            x: 16,
            qweight: 16,
            scales: 16,
            y: 16,
            ..args
        };
        // SAFETY: the dtype is rejected before any pointer is used.
        assert!(matches!(
            unsafe { linear(&args32) },
            Err(CudaError::Launch { code: -3, .. })
        ));
    }
}
