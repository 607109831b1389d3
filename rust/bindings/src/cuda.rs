//! The CUDA path: the GPU weight layout (pure Rust, always built) and the kernel launchers of
//! `ternary-cuda` (present only in builds with the `cuda` feature).
//!
//! Launchers take raw device pointers (`tensor.data_ptr()`) and the stream handle
//! (`torch.cuda.current_stream().cuda_stream`) as integers; `_ops_cuda.py` owns every allocation.
//! f16 scales travel as their raw `uint16` bits (zero-copy views on both sides).

use half::{f16, slice::HalfBitsSliceExt};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use ternary_core::canonical::CanonicalRef;
use ternary_core::kernels::gpu_layout as layout;
use ternary_cuda::{CudaError, DType, LinearArgs};

use crate::errors::to_py;
use crate::torch;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_layout, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_plan, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ternary_linear, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_set_gemv_max_m, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_set_dequant_min_m, m)?)?;
    m.add_function(wrap_pyfunction!(register_torch_cuda_kernel, m)?)?;
    m.add("GPU_CHUNK_N", layout::CHUNK_N)?;
    m.add("GPU_CHUNK_K", layout::CHUNK_K)?;
    m.add("GPU_CHUNK_BYTES", layout::CHUNK_BYTES)?;
    Ok(())
}

/// `(qweight_k, scales_k_bits)` as NumPy arrays.
type LayoutArrays<'py> = (Bound<'py, PyArray2<u8>>, Bound<'py, PyArray2<u16>>);

fn cuda_err(e: CudaError) -> PyErr {
    match e {
        CudaError::Launch { code, .. } if code < 0 => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Whether this build contains the CUDA kernels (built with the `cuda` feature).
#[pyfunction]
fn cuda_available() -> bool {
    ternary_cuda::available()
}

/// Number of CUDA devices the kernels' runtime sees (0 without kernels, driver or device; never raises).
#[pyfunction]
fn cuda_device_count() -> i32 {
    ternary_cuda::device_count()
}

/// Permute canonical `qweight` (`uint8 [N, K/4]`) and `scales` (f16 bits, `uint16 [N, K/g]`) into the
/// CUDA kernels' layout: returns `(uint8 [n_pad/32, k_pad/64 · 512], uint16 [groups_pad, n_pad])`.
/// Rejects code 3 and non-finite scales. Runs without the GIL on the ternary-rs thread pool.
#[pyfunction]
fn gpu_layout<'py>(
    py: Python<'py>,
    qweight: PyReadonlyArray2<'py, u8>,
    scales: PyReadonlyArray2<'py, u16>,
    group_size: usize,
) -> PyResult<LayoutArrays<'py>> {
    let (rows, qcols) = (qweight.shape()[0], qweight.shape()[1]);
    let cols = qcols
        .checked_mul(4)
        .ok_or_else(|| PyValueError::new_err("gpu_layout: qweight is too wide"))?;
    if group_size == 0 || scales.shape() != [rows, cols / group_size] {
        return Err(PyValueError::new_err(format!(
            "gpu_layout: scales shape {:?} does not match qweight [{rows}, {qcols}] (K = {cols}) with group size \
             {group_size}: expected [{rows}, {}]",
            scales.shape(),
            cols.checked_div(group_size).unwrap_or(0)
        )));
    }
    let q = qweight
        .as_slice()
        .map_err(|e| PyValueError::new_err(format!("gpu_layout qweight: {e}")))?;
    let s: &[f16] = scales
        .as_slice()
        .map_err(|e| PyValueError::new_err(format!("gpu_layout scales: {e}")))?
        .reinterpret_cast();
    let w = CanonicalRef {
        rows,
        cols,
        group_size,
        qweight: q,
        scales: s,
    };
    let layout = py
        .detach(|| layout::to_gpu_layout(w, "qweight"))
        .map_err(to_py)?;
    let strips = layout.n_pad / layout::CHUNK_N;
    let strip_bytes = layout.qweight.len() / strips;
    let q_out = Array2::from_shape_vec((strips, strip_bytes), layout.qweight)
        .map_err(|e| PyRuntimeError::new_err(format!("gpu_layout: {e}")))?;
    let s_bits: Vec<u16> = layout.scales.iter().map(|v| v.to_bits()).collect();
    let s_out = Array2::from_shape_vec((layout.groups_pad, layout.n_pad), s_bits)
        .map_err(|e| PyRuntimeError::new_err(format!("gpu_layout: {e}")))?;
    Ok((q_out.into_pyarray(py), s_out.into_pyarray(py)))
}

/// How a call of these sizes runs: dict with `kernel` ("gemv" or "gemm16/32/64/128"), `splits`,
/// `grid_n`, `grid_m`, `partial_floats` (fp32 workspace elements) and `counters` (zeroed int32s).
#[pyfunction]
fn cuda_plan<'py>(
    py: Python<'py>,
    m: i64,
    n: i64,
    k: i64,
    group_size: i32,
    sm_count: i32,
) -> PyResult<Bound<'py, PyDict>> {
    let p = ternary_cuda::plan(m, n, k, group_size, sm_count).map_err(cuda_err)?;
    let d = PyDict::new(py);
    let kernel = match p.kernel {
        0 => "gemv",
        1 => "gemm16",
        2 => "gemm32",
        3 => "gemm64",
        _ => "gemm128",
    };
    d.set_item("kernel", kernel)?;
    d.set_item("splits", p.splits)?;
    d.set_item("grid_n", p.grid_n)?;
    d.set_item("grid_m", p.grid_m)?;
    d.set_item("partial_floats", p.partial_floats)?;
    d.set_item("counters", p.counters)?;
    Ok(d)
}

/// Register the native CUDA kernel of `ternary_rs::ternary_linear` with torch's dispatcher (the schema
/// must already be defined); the arguments are the paths of the loaded `libtorch_cpu.so` and
/// `libtorch_cuda.so`. Raises RuntimeError saying why when it cannot (no kernels in this build, a torch
/// without the stable ABI or without CUDA).
#[pyfunction]
fn register_torch_cuda_kernel(libtorch_cpu: &str, libtorch_cuda: &str) -> PyResult<()> {
    torch::register_cuda(libtorch_cpu, libtorch_cuda).map_err(PyRuntimeError::new_err)
}

/// From this M on the native CUDA kernel dequantizes W and calls torch's cuBLAS GEMM (0 = never);
/// returns the previous value. `_ops_cuda.set_dequant_min_m` keeps it in step with the Python path.
#[pyfunction]
fn cuda_set_dequant_min_m(m: i64) -> i64 {
    torch::set_dequant_min_m(m)
}

/// Set the largest M that runs the decode GEMV (0..=16, default 8); returns the previous value.
/// Process-wide, for tuning and benchmarks (`benches/bench_gpu.py --gemv-max-m`).
#[pyfunction]
fn cuda_set_gemv_max_m(m: i32) -> PyResult<i32> {
    ternary_cuda::set_gemv_max_m(m).map_err(cuda_err)
}

fn parse_dtype(dtype: &str) -> PyResult<DType> {
    match dtype {
        "bfloat16" => Ok(DType::Bf16),
        "float16" => Ok(DType::Fp16),
        other => Err(PyValueError::new_err(format!(
            "dtype {other:?} is not supported by the CUDA kernels; supported: bfloat16, float16"
        ))),
    }
}

/// Enqueue `w_out[N, K] = trit · scale` (row-major, `dtype`) from the GPU layout on `stream` (device
/// pointers as integers; the caller guarantees sizes as for `cuda_ternary_linear`).
#[pyfunction]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn cuda_dequantize(
    qweight: u64,
    scales: u64,
    w_out: u64,
    n: i64,
    k: i64,
    group_size: i32,
    dtype: &str,
    stream: u64,
) -> PyResult<()> {
    let dtype = parse_dtype(dtype)?;
    // SAFETY: the Python caller passes live device tensors of the right sizes; the launcher only enqueues
    // work and validates sizes, null pointers and alignment itself.
    unsafe { ternary_cuda::dequantize(qweight, scales, w_out, n, k, group_size, dtype, stream) }
        .map_err(cuda_err)
}

/// Enqueue `y = x @ W^T (+ bias)` on `stream`. All pointers are device addresses (0 for an absent bias or
/// workspace; `partials_len` / `counters_len` are the workspace sizes in elements, checked against the plan); `dtype` is "bfloat16" or "float16". Only enqueues work (safe inside CUDA graph capture).
///
/// The caller (``ternary_rs._ops_cuda``) guarantees that the pointers are live tensors of the current
/// device with the sizes `cuda_plan` and the layout require; sizes and alignment are re-checked in C.
#[pyfunction]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (x, qweight, scales, bias, y, partials, partials_len, counters, counters_len, m, n, k, group_size, dtype, sm_count, stream))]
fn cuda_ternary_linear(
    x: u64,
    qweight: u64,
    scales: u64,
    bias: u64,
    y: u64,
    partials: u64,
    partials_len: i64,
    counters: u64,
    counters_len: i64,
    m: i64,
    n: i64,
    k: i64,
    group_size: i32,
    dtype: &str,
    sm_count: i32,
    stream: u64,
) -> PyResult<()> {
    let dtype = parse_dtype(dtype)?;
    let args = LinearArgs {
        x,
        qweight,
        scales,
        bias,
        y,
        partials,
        partials_len,
        counters,
        counters_len,
        m,
        n,
        k,
        group_size,
        dtype,
        sm_count,
        stream,
    };
    // SAFETY: the Python caller passes live device tensors sized per `cuda_plan` (see the docstring);
    // the launcher only enqueues work and validates sizes, null pointers and alignment itself.
    unsafe { ternary_cuda::linear(&args) }.map_err(cuda_err)
}
