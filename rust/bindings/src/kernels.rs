//! CPU ternary GEMV/GEMM bindings (`ternary_rs._core.ternary_gemm_cpu` and friends).
//!
//! Zero-copy from torch: the Python side (`ternary_rs/_ops_cpu.py`) passes `tensor.data_ptr()` and the
//! sizes as ints after checking device, dtype, contiguity and shape — these functions are private to
//! that module. Here we re-check what can be checked (shape limits, null and misaligned pointers) and
//! release the GIL for the whole kernel.

use half::{bf16, f16};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use ternary_core::canonical::{check_shape, CanonicalRef};
use ternary_core::kernels::cpu::{self, layout, Activation, Precision, PreparedRef, Variant};

use crate::errors::to_py;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(ternary_cpu_prepare, m)?)?;
    m.add_function(wrap_pyfunction!(ternary_gemm_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_prepared_row_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernel_variants, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernel_best, m)?)?;
    Ok(())
}

/// A slice over `len` elements of `T` at address `addr` (checked non-null and aligned).
///
/// # Safety
/// The caller (the Python wrapper) guarantees that `addr` points at `len` live elements of `T`
/// that nobody writes for the duration of the call.
unsafe fn slice_at<'a, T>(addr: usize, len: usize, what: &str) -> PyResult<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    check_pointer::<T>(addr, what)?;
    // SAFETY: non-null and aligned (checked); length and liveness guaranteed by the caller.
    Ok(unsafe { std::slice::from_raw_parts(addr as *const T, len) })
}

/// Mutable version of [`slice_at`] (same contract, and no other reference to the memory exists).
unsafe fn slice_at_mut<'a, T>(addr: usize, len: usize, what: &str) -> PyResult<&'a mut [T]> {
    if len == 0 {
        return Ok(&mut []);
    }
    check_pointer::<T>(addr, what)?;
    // SAFETY: as in `slice_at`, plus exclusivity guaranteed by the caller.
    Ok(unsafe { std::slice::from_raw_parts_mut(addr as *mut T, len) })
}

fn check_pointer<T>(addr: usize, what: &str) -> PyResult<()> {
    if addr == 0 || !addr.is_multiple_of(std::mem::align_of::<T>()) {
        return Err(PyValueError::new_err(format!(
            "{what}: data pointer {addr:#x} is null or not aligned to {} bytes",
            std::mem::align_of::<T>()
        )));
    }
    Ok(())
}

fn checked_len(a: usize, b: usize, what: &str) -> PyResult<usize> {
    a.checked_mul(b)
        .ok_or_else(|| PyValueError::new_err(format!("{what}: size {a} x {b} overflows")))
}

/// Bytes of one row of the CPU kernel's weight layout for `in_features` columns.
#[pyfunction]
fn cpu_prepared_row_bytes(cols: usize) -> usize {
    layout::row_bytes(cols)
}

/// Names of the CPU kernel variants this machine can run (always includes "scalar").
#[pyfunction]
fn cpu_kernel_variants() -> Vec<&'static str> {
    Variant::ALL
        .iter()
        .filter(|v| v.is_supported())
        .map(|v| v.name())
        .collect()
}

/// Name of the variant "auto" picks on this machine.
#[pyfunction]
fn cpu_kernel_best() -> &'static str {
    Variant::best().name()
}

/// Permute canonical `qweight` (u8 `[rows, cols/4]`) into the kernel's bit-planes at `out_ptr`
/// (u8 `[rows, cpu_prepared_row_bytes(cols)]`); validates codes and scales first.
#[pyfunction]
#[pyo3(signature = (qweight_ptr, scales_ptr, rows, cols, group_size, out_ptr, tensor = "qweight"))]
#[allow(clippy::too_many_arguments)]
fn ternary_cpu_prepare(
    py: Python<'_>,
    qweight_ptr: usize,
    scales_ptr: usize,
    rows: usize,
    cols: usize,
    group_size: usize,
    out_ptr: usize,
    tensor: &str,
) -> PyResult<()> {
    check_shape(rows, cols, group_size).map_err(to_py)?;
    let codes = checked_len(rows, cols / 4, "qweight")?;
    let groups = checked_len(rows, cols / group_size, "scales")?;
    let out_len = layout::prepared_bytes(rows, cols)
        .ok_or_else(|| PyValueError::new_err("prepared weight size overflows"))?;
    let tensor = tensor.to_owned();
    py.detach(move || {
        // SAFETY: the Python wrapper passes contiguous CPU tensors of exactly these sizes.
        let (qweight, scales, out) = unsafe {
            (
                slice_at::<u8>(qweight_ptr, codes, "qweight")?,
                slice_at::<f16>(scales_ptr, groups, "scales")?,
                slice_at_mut::<u8>(out_ptr, out_len, "prepared qweight")?,
            )
        };
        let w = CanonicalRef {
            rows,
            cols,
            group_size,
            qweight,
            scales,
        };
        layout::prepare_into(w, &tensor, out).map_err(to_py)
    })
}

/// `y[M, N] = x[M, K] · Wᵀ (+ bias)` on the CPU. `dtype` ("bfloat16", "float16", "float32") is the
/// type of x, bias and y; `bias_ptr` = 0 means no bias. `variant` is "auto", "avx512", "avx2" or
/// "scalar"; `int8` selects the per-token int8 activation mode (default: exact f32 accumulation).
#[pyfunction]
#[pyo3(signature = (x_ptr, dtype, m, k, planes_ptr, scales_ptr, n, group_size, bias_ptr, y_ptr, variant = "auto", int8 = false))]
#[allow(clippy::too_many_arguments)]
fn ternary_gemm_cpu(
    py: Python<'_>,
    x_ptr: usize,
    dtype: &str,
    m: usize,
    k: usize,
    planes_ptr: usize,
    scales_ptr: usize,
    n: usize,
    group_size: usize,
    bias_ptr: usize,
    y_ptr: usize,
    variant: &str,
    int8: bool,
) -> PyResult<()> {
    check_shape(n, k, group_size).map_err(to_py)?;
    let variant = Variant::parse(variant).map_err(to_py)?;
    let precision = if int8 {
        Precision::Int8
    } else {
        Precision::Exact
    };
    let sizes = Sizes {
        x: checked_len(m, k, "x")?,
        y: checked_len(m, n, "y")?,
        planes: layout::prepared_bytes(n, k)
            .ok_or_else(|| PyValueError::new_err("prepared weight size overflows"))?,
        scales: checked_len(n, k / group_size, "scales")?,
        n,
    };
    let ptrs = Pointers {
        x: x_ptr,
        planes: planes_ptr,
        scales: scales_ptr,
        bias: bias_ptr,
        y: y_ptr,
    };
    let shape = (m, n, k, group_size);
    match dtype {
        "bfloat16" => py.detach(move || run::<bf16>(ptrs, sizes, shape, variant, precision)),
        "float16" => py.detach(move || run::<f16>(ptrs, sizes, shape, variant, precision)),
        "float32" => py.detach(move || run::<f32>(ptrs, sizes, shape, variant, precision)),
        other => Err(PyValueError::new_err(format!(
            "x dtype {other} is not supported by the CPU kernel; supported: bfloat16, float16, float32"
        ))),
    }
}

#[derive(Clone, Copy)]
struct Pointers {
    x: usize,
    planes: usize,
    scales: usize,
    bias: usize,
    y: usize,
}

#[derive(Clone, Copy)]
struct Sizes {
    x: usize,
    y: usize,
    planes: usize,
    scales: usize,
    n: usize,
}

fn run<T: Activation>(
    p: Pointers,
    s: Sizes,
    (m, n, k, group_size): (usize, usize, usize, usize),
    variant: Variant,
    precision: Precision,
) -> PyResult<()> {
    // SAFETY: the Python wrapper passes contiguous CPU tensors of exactly these sizes, y freshly
    // allocated (not aliasing any input).
    let (x, planes, scales, bias, y) = unsafe {
        (
            slice_at::<T>(p.x, s.x, "x")?,
            slice_at::<u8>(p.planes, s.planes, "qweight")?,
            slice_at::<f16>(p.scales, s.scales, "scales")?,
            if p.bias == 0 {
                None
            } else {
                Some(slice_at::<T>(p.bias, s.n, "bias")?)
            },
            slice_at_mut::<T>(p.y, s.y, "y")?,
        )
    };
    let w = PreparedRef {
        rows: n,
        cols: k,
        group_size,
        planes,
        scales,
    };
    cpu::gemm(w, x, m, bias, y, variant, precision).map_err(to_py)
}
