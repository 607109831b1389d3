//! `fwht`: the blockwise normalized Walsh–Hadamard transform of `ternary_core::hadamard` over NumPy rows.
//!
//! bf16/f16 arrays travel as their raw `uint16` bits (NumPy has no bf16), so torch tensors are passed
//! zero-copy with `.view(torch.int16/uint16)`. The output array is written in place; the GIL is released
//! while the transform runs.

use half::{bf16, f16, slice::HalfBitsSliceExt};
use numpy::{
    Element, PyReadonlyArray1, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use ternary_core::hadamard::{self, Direction, Transform};
use ternary_core::threads::{ParallelFor, Rayon};

use crate::errors::to_py;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(fwht, m)?)?;
    m.add_function(wrap_pyfunction!(gdn_tiled_to_grouped, m)?)?;
    #[cfg(feature = "cuda")]
    m.add_function(wrap_pyfunction!(fwht_cuda, m)?)?;
    m.add("HADAMARD_MAX_BLOCK_SIZE", hadamard::MAX_BLOCK_SIZE)?;
    Ok(())
}

fn row_width(shape: &[usize]) -> PyResult<usize> {
    shape
        .last()
        .copied()
        .ok_or_else(|| PyValueError::new_err("fwht: input must have at least one dimension"))
}

/// Extract `input`/`output` as same-shape arrays of `T`, build the transform for their row width, and
/// run `run(transform, input data, output data)` on their C-contiguous data.
fn with_rows<'t, T: Element>(
    input: &Bound<'_, PyAny>,
    output: &Bound<'_, PyAny>,
    transform: impl FnOnce(usize) -> PyResult<Transform<'t>>,
    run: impl FnOnce(Transform<'t>, &[T], &mut [T]) -> PyResult<()>,
) -> PyResult<()> {
    let src: PyReadonlyArrayDyn<'_, T> = input.extract()?;
    let mut dst: PyReadwriteArrayDyn<'_, T> = output.extract()?;
    if src.shape() != dst.shape() {
        return Err(PyValueError::new_err(
            "fwht: input and output shapes differ",
        ));
    }
    let t = transform(row_width(src.shape())?)?;
    let s = src
        .as_slice()
        .map_err(|e| PyValueError::new_err(format!("fwht input: {e}")))?;
    let d = dst
        .as_slice_mut()
        .map_err(|e| PyValueError::new_err(format!("fwht output: {e}")))?;
    run(t, s, d)
}

/// Transform every row (last axis) of `input` into `output` (same shape, C-contiguous).
///
/// `dtype` is "float32" (float32 arrays) or "bfloat16"/"float16" (uint16 arrays holding the raw bits).
/// `inverse=False`: `x → x[gather] → ·signs → H/√block`; `inverse=True`: `x → H/√block → ·signs`.
/// `torch_pool=True`: many rows run on torch's intra-op pool (once the native op is registered;
/// otherwise, and by default, on the ternary-rs rayon pool).
#[pyfunction]
#[pyo3(signature = (input, output, block_size, dtype, inverse=false, signs=None, gather=None, torch_pool=false))]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn fwht(
    py: Python<'_>,
    input: &Bound<'_, PyAny>,
    output: &Bound<'_, PyAny>,
    block_size: usize,
    dtype: &str,
    inverse: bool,
    signs: Option<PyReadonlyArray1<'_, f32>>,
    gather: Option<PyReadonlyArray1<'_, u32>>,
    torch_pool: bool,
) -> PyResult<()> {
    // Inside torch (the op's CPU path) many rows go to torch's own pool, whose threads spin awake after
    // the previous op: the rayon pool woke up against them (M = 16, 17408 wide: 495 -> 1270 us).
    let pool = torch_pool.then(crate::torch::intra_op_pool).flatten();
    let par: &(dyn ParallelFor + Sync) = match &pool {
        Some(p) => p,
        None => &Rayon,
    };
    let direction = if inverse {
        Direction::Inverse
    } else {
        Direction::Forward
    };
    let signs_slice = match &signs {
        Some(s) => Some(
            s.as_slice()
                .map_err(|e| PyValueError::new_err(format!("fwht signs: {e}")))?,
        ),
        None => None,
    };
    let gather_slice = match &gather {
        Some(g) => Some(
            g.as_slice()
                .map_err(|e| PyValueError::new_err(format!("fwht gather: {e}")))?,
        ),
        None => None,
    };
    let transform = |width| {
        Transform::new(width, block_size, direction, signs_slice, gather_slice).map_err(to_py)
    };
    match dtype {
        "float32" => with_rows::<f32>(input, output, transform, |t, s, d| {
            py.detach(|| t.apply_on(s, d, par)).map_err(to_py)
        }),
        "bfloat16" | "float16" => with_rows::<u16>(input, output, transform, |t, s, d| {
            if dtype == "bfloat16" {
                py.detach(|| {
                    t.apply_on::<bf16>(s.reinterpret_cast(), d.reinterpret_cast_mut(), par)
                })
            } else {
                py.detach(|| t.apply_on::<f16>(s.reinterpret_cast(), d.reinterpret_cast_mut(), par))
            }
            .map_err(to_py)
        }),
        other => Err(PyValueError::new_err(format!(
            "fwht: unsupported dtype {other:?}; supported: float32, bfloat16, float16"
        ))),
    }
}

/// The GDN value-head gather `grouped[i] = tiled[perm[i]]` for `[rep, nk, unit] → [nk, rep, unit]`.
#[pyfunction]
fn gdn_tiled_to_grouped(num_v_heads: usize, num_k_heads: usize, unit: usize) -> PyResult<Vec<u32>> {
    hadamard::gdn_tiled_to_grouped(num_v_heads, num_k_heads, unit).map_err(to_py)
}

#[cfg(feature = "cuda")]
mod cuda_ffi {
    use std::ffi::c_void;

    // cuda/fwht.h (compiled and linked by the ternary-cuda build script).
    extern "C" {
        // The C signature of cuda/fwht.h.
        #[allow(clippy::too_many_arguments)]
        pub fn ternary_cuda_fwht(
            input: *const c_void,
            output: *mut c_void,
            rows: i64,
            width: i64,
            block_size: i32,
            dtype: i32,
            signs: *const f32,
            gather: *const i32,
            inverse: i32,
            stream: *mut c_void,
        ) -> i32;
    }
}

/// Enqueue the CUDA FWHT on `stream` (raw device pointers from `tensor.data_ptr()`; 0 = absent).
/// `dtype` is "bfloat16", "float16" or "float32". Only enqueues: no synchronisation, graph-capturable.
#[cfg(feature = "cuda")]
#[pyfunction]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn fwht_cuda(
    input_ptr: u64,
    output_ptr: u64,
    rows: i64,
    width: i64,
    block_size: i32,
    dtype: &str,
    inverse: bool,
    signs_ptr: u64,
    gather_ptr: u64,
    stream: u64,
) -> PyResult<()> {
    use pyo3::exceptions::PyRuntimeError;
    use std::ffi::c_void;

    let code = match dtype {
        "bfloat16" => 0,
        "float16" => 1,
        "float32" => 2,
        other => {
            return Err(PyValueError::new_err(format!(
                "fwht_cuda: unsupported dtype {other:?}; supported: bfloat16, float16, float32"
            )))
        }
    };
    // SAFETY: the pointers come from live torch tensors of the sizes given (checked by the Python
    // caller); the launcher validates sizes and only enqueues work on `stream`.
    let rc = unsafe {
        cuda_ffi::ternary_cuda_fwht(
            input_ptr as *const c_void,
            output_ptr as *mut c_void,
            rows,
            width,
            block_size,
            code,
            signs_ptr as *const f32,
            gather_ptr as *const i32,
            i32::from(inverse),
            stream as *mut c_void,
        )
    };
    match rc {
        0 => Ok(()),
        rc if rc < 0 => Err(PyValueError::new_err(format!(
            "fwht_cuda: invalid arguments (code {rc}; see cuda/fwht.h): rows {rows}, width {width}, block {block_size}"
        ))),
        rc => Err(PyRuntimeError::new_err(format!(
            "fwht_cuda: CUDA launch failed with cudaError {rc}"
        ))),
    }
}
