//! Codec bindings: thin wrappers over `ternary_core::{formats, repack, canonical}`.
//!
//! Arrays cross as NumPy: codes `uint8`, scales as raw fp16 bits (`uint16`, viewed as `float16` by the
//! Python layer), outputs are fresh arrays built from the Rust `Vec` without a copy. Every heavy call
//! runs with the GIL released (`py.detach`) on the ternary-rs pool.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::vec::HalfFloatVecExt;
use numpy::{
    PyArray1, PyArray2, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use ternary_core::canonical::{self, CanonicalRef, CanonicalTernary, HalfKind};
use ternary_core::formats::bitnet::{self, ScaleConvention};
use ternary_core::formats::dense::{self, DenseDtype, Method};
use ternary_core::formats::{i2_s, mlx, Format};
use ternary_core::repack;

use crate::errors::to_py;

type Canon<'py> = (Bound<'py, PyArray2<u8>>, Bound<'py, PyArray2<u16>>, usize);

fn slice<'a, T: numpy::Element>(a: &'a PyReadonlyArrayDyn<'_, T>, what: &str) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| {
        crate::errors::invalid_argument(format!("{what} must be a C-contiguous array"))
    })
}

fn to_canon<'py>(py: Python<'py>, t: CanonicalTernary) -> PyResult<Canon<'py>> {
    let (rows, cols, g) = (t.rows, t.cols, t.group_size);
    let q = PyArray1::from_vec(py, t.qweight).reshape([rows, cols / 4])?;
    let bits: Vec<u16> = t.scales.reinterpret_into();
    let s = PyArray1::from_vec(py, bits).reshape([rows, cols / g])?;
    Ok((q, s, g))
}

/// Run `f` with the GIL released and hand its tensor back as NumPy (qweight, scale bits, group).
fn detached_canon<'py>(
    py: Python<'py>,
    f: impl FnOnce() -> ternary_core::Result<CanonicalTernary> + Send,
) -> PyResult<Canon<'py>> {
    let t = py.detach(f).map_err(to_py)?;
    to_canon(py, t)
}

/// Borrow the (qweight, scales) arrays as a canonical tensor of `[rows, cols]`, checked.
fn canon_ref<'a>(
    qweight: &'a PyReadonlyArrayDyn<'_, u8>,
    scales: &'a PyReadonlyArrayDyn<'_, u16>,
    rows: usize,
    cols: usize,
    group_size: usize,
) -> PyResult<CanonicalRef<'a>> {
    let c = CanonicalRef {
        rows,
        cols,
        group_size,
        qweight: slice(qweight, "qweight")?,
        scales: slice(scales, "scales")?.reinterpret_cast::<f16>(),
    };
    c.check().map_err(to_py)?;
    Ok(c)
}

/// Decode GGUF tensor data (`format` name, raw bytes, PyTorch shape) → (qweight, scale bits, group).
#[pyfunction]
#[pyo3(signature = (format, data, rows, cols, group_size=None, requantize=false, tensor="<bytes>"))]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn decode_gguf<'py>(
    py: Python<'py>,
    format: &str,
    data: PyReadonlyArrayDyn<'py, u8>,
    rows: usize,
    cols: usize,
    group_size: Option<usize>,
    requantize: bool,
    tensor: &str,
) -> PyResult<Canon<'py>> {
    let f = Format::from_name(format).map_err(to_py)?;
    let d = slice(&data, "data")?;
    detached_canon(py, || {
        repack::decode_gguf(f, tensor, d, rows, cols, group_size, requantize)
    })
}

/// Encode a canonical tensor as GGUF tensor data of `format` (regrouping losslessly or refusing).
#[pyfunction]
#[pyo3(signature = (format, qweight, scales, rows, cols, group_size, requantize=false, tensor="<tensor>"))]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn encode_gguf<'py>(
    py: Python<'py>,
    format: &str,
    qweight: PyReadonlyArrayDyn<'py, u8>,
    scales: PyReadonlyArrayDyn<'py, u16>,
    rows: usize,
    cols: usize,
    group_size: usize,
    requantize: bool,
    tensor: &str,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let f = Format::from_name(format).map_err(to_py)?;
    let c = canon_ref(&qweight, &scales, rows, cols, group_size)?;
    let out = py
        .detach(|| repack::encode_gguf(f, tensor, c, requantize))
        .map_err(to_py)?;
    Ok(PyArray1::from_vec(py, out))
}

/// Bytes of a GGUF tensor of `format` and shape `[rows, cols]`.
#[pyfunction]
fn gguf_tensor_bytes(format: &str, rows: usize, cols: usize) -> PyResult<usize> {
    let f = Format::from_name(format).map_err(to_py)?;
    repack::gguf_tensor_bytes(f, rows, cols).map_err(to_py)
}

/// Decode a transformers BitNet `weight` (uint8 `[rows/4, cols]`) with its `weight_scale`.
#[pyfunction]
#[pyo3(signature = (packed, rows, cols, weight_scale, linear_class=None, group_size=None, tensor="<bytes>"))]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn decode_bitnet<'py>(
    py: Python<'py>,
    packed: PyReadonlyArrayDyn<'py, u8>,
    rows: usize,
    cols: usize,
    weight_scale: f32,
    linear_class: Option<&str>,
    group_size: Option<usize>,
    tensor: &str,
) -> PyResult<Canon<'py>> {
    let conv = ScaleConvention::from_linear_class(linear_class).map_err(to_py)?;
    let g = match group_size {
        Some(g) => g,
        None => repack::default_group_for(cols).map_err(to_py)?,
    };
    let p = slice(&packed, "packed")?;
    detached_canon(py, || {
        bitnet::decode(tensor, p, rows, cols, weight_scale, conv, g)
    })
}

/// Encode to transformers BitNet packing: (uint8 `[rows/4, cols]`, weight_scale as f32).
#[pyfunction]
#[pyo3(signature = (qweight, scales, rows, cols, group_size, linear_class=None, tensor="<tensor>"))]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn encode_bitnet<'py>(
    py: Python<'py>,
    qweight: PyReadonlyArrayDyn<'py, u8>,
    scales: PyReadonlyArrayDyn<'py, u16>,
    rows: usize,
    cols: usize,
    group_size: usize,
    linear_class: Option<&str>,
    tensor: &str,
) -> PyResult<(Bound<'py, PyArray2<u8>>, f32)> {
    let conv = ScaleConvention::from_linear_class(linear_class).map_err(to_py)?;
    let c = canon_ref(&qweight, &scales, rows, cols, group_size)?;
    let (packed, ws) = py
        .detach(|| bitnet::encode(tensor, c, conv))
        .map_err(to_py)?;
    Ok((
        PyArray1::from_vec(py, packed).reshape([rows / 4, cols])?,
        ws,
    ))
}

/// Check an MLX 2-bit pack for ternarity (bias == −scale, no code 3); returns its group size.
#[pyfunction]
#[pyo3(signature = (weight, scales, biases, rows, cols, tensor="<tensor>"))]
fn validate_mlx<'py>(
    py: Python<'py>,
    weight: PyReadonlyArrayDyn<'py, u8>,
    scales: PyReadonlyArrayDyn<'py, u16>,
    biases: PyReadonlyArrayDyn<'py, u16>,
    rows: usize,
    cols: usize,
    tensor: &str,
) -> PyResult<usize> {
    let (w, s, b) = (
        slice(&weight, "weight")?,
        slice(&scales, "scales")?.reinterpret_cast::<f16>(),
        slice(&biases, "biases")?.reinterpret_cast::<f16>(),
    );
    py.detach(|| mlx::validate(tensor, w, s, b, rows, cols))
        .map_err(to_py)
}

/// Recover codes and scales exactly from a dense ternary tensor's raw little-endian bytes.
#[pyfunction]
#[pyo3(signature = (data, dtype, rows, cols, group_size, tensor="<tensor>"))]
fn recover_dense<'py>(
    py: Python<'py>,
    data: PyReadonlyArrayDyn<'py, u8>,
    dtype: &str,
    rows: usize,
    cols: usize,
    group_size: usize,
    tensor: &str,
) -> PyResult<Canon<'py>> {
    let dt = DenseDtype::from_name(dtype).map_err(to_py)?;
    let d = slice(&data, "data")?;
    detached_canon(py, || dense::recover(tensor, d, dt, rows, cols, group_size))
}

/// Ternarize dense f32 weights `[rows, cols]` (absmax / absmean, per group or per tensor).
#[pyfunction]
#[pyo3(signature = (w, rows, cols, group_size, method="absmax", per_tensor=false, tensor="<tensor>"))]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn ternarize<'py>(
    py: Python<'py>,
    w: PyReadonlyArrayDyn<'py, f32>,
    rows: usize,
    cols: usize,
    group_size: usize,
    method: &str,
    per_tensor: bool,
    tensor: &str,
) -> PyResult<Canon<'py>> {
    let m = Method::from_name(method, per_tensor).map_err(to_py)?;
    let d = slice(&w, "w")?;
    detached_canon(py, || {
        dense::ternarize(tensor, d, rows, cols, group_size, m)
    })
}

/// Dequantize into `out` (C-contiguous, `rows·cols` elements): float32 for `dtype` "float32", uint16
/// bits for "float16"/"bfloat16". Writing into a caller's array lets Python allocate it (NumPy and
/// torch use huge pages for large buffers; first-touch page faults dominate fresh outputs) or fill a
/// torch tensor directly.
#[pyfunction]
#[pyo3(signature = (qweight, scales, rows, cols, group_size, out, dtype="float32"))]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn dequantize_into<'py>(
    py: Python<'py>,
    qweight: PyReadonlyArrayDyn<'py, u8>,
    scales: PyReadonlyArrayDyn<'py, u16>,
    rows: usize,
    cols: usize,
    group_size: usize,
    out: Bound<'py, PyAny>,
    dtype: &str,
) -> PyResult<()> {
    let c = canon_ref(&qweight, &scales, rows, cols, group_size)?;
    let not_contiguous =
        || crate::errors::invalid_argument("out must be a writable C-contiguous array");
    match dtype {
        "float32" => {
            let arr = out.cast::<PyArrayDyn<f32>>().map_err(|_| {
                crate::errors::invalid_argument("out must be a float32 array for dtype float32")
            })?;
            let mut rw = arr.try_readwrite().map_err(|_| not_contiguous())?;
            let o = rw.as_slice_mut().map_err(|_| not_contiguous())?;
            py.detach(|| c.dequantize_f32_into(o)).map_err(to_py)
        }
        "float16" | "bfloat16" => {
            let kind = if dtype == "float16" {
                HalfKind::F16
            } else {
                HalfKind::BF16
            };
            let arr = out.cast::<PyArrayDyn<u16>>().map_err(|_| {
                crate::errors::invalid_argument(
                    "out must be a uint16 array (raw bits) for float16/bfloat16",
                )
            })?;
            let mut rw = arr.try_readwrite().map_err(|_| not_contiguous())?;
            let o = rw.as_slice_mut().map_err(|_| not_contiguous())?;
            py.detach(|| c.dequantize_bits_into(kind, o)).map_err(to_py)
        }
        d => Err(crate::errors::invalid_argument(format!(
            "dequantize dtype must be float32, float16 or bfloat16, not {d}"
        ))),
    }
}

/// Reject code 3 and non-finite scales (names the tensor, first index and count).
#[pyfunction]
#[pyo3(signature = (qweight, scales, rows, cols, group_size, tensor="<tensor>"))]
fn validate<'py>(
    py: Python<'py>,
    qweight: PyReadonlyArrayDyn<'py, u8>,
    scales: PyReadonlyArrayDyn<'py, u16>,
    rows: usize,
    cols: usize,
    group_size: usize,
    tensor: &str,
) -> PyResult<()> {
    let c = canon_ref(&qweight, &scales, rows, cols, group_size)?;
    py.detach(|| c.validate(tensor)).map_err(to_py)
}

/// Change the group size (lossless, or refused unless `requantize`).
#[pyfunction]
#[pyo3(signature = (qweight, scales, rows, cols, group_size, new_group_size, requantize=false, tensor="<tensor>"))]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn regroup<'py>(
    py: Python<'py>,
    qweight: PyReadonlyArrayDyn<'py, u8>,
    scales: PyReadonlyArrayDyn<'py, u16>,
    rows: usize,
    cols: usize,
    group_size: usize,
    new_group_size: usize,
    requantize: bool,
    tensor: &str,
) -> PyResult<Canon<'py>> {
    let c = canon_ref(&qweight, &scales, rows, cols, group_size)?;
    detached_canon(py, || {
        repack::regroup(c, tensor, new_group_size, requantize)
    })
}

/// Trits int8 `[rows, 4·bytes]` of canonical code bytes `[rows, bytes]`.
#[pyfunction]
fn unpack_codes<'py>(
    py: Python<'py>,
    qweight: PyReadonlyArrayDyn<'py, u8>,
) -> PyResult<Bound<'py, PyAny>> {
    let shape = qweight.shape().to_vec();
    let q = slice(&qweight, "qweight")?;
    let v = py.detach(|| canonical::unpack_trits(q));
    let mut out_shape = shape;
    if let Some(last) = out_shape.last_mut() {
        *last *= 4;
    }
    Ok(PyArray1::from_vec(py, v).reshape(out_shape)?.into_any())
}

/// Canonical code bytes `[rows, cols/4]` of int8 trits `[rows, cols]` (values must be −1, 0, 1).
#[pyfunction]
#[pyo3(signature = (trits, tensor="<trits>"))]
fn pack_codes<'py>(
    py: Python<'py>,
    trits: PyReadonlyArrayDyn<'py, i8>,
    tensor: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let shape = trits.shape().to_vec();
    let cols = *shape.last().unwrap_or(&0);
    let t = slice(&trits, "trits")?;
    let v = py
        .detach(|| canonical::pack_trits(tensor, t, cols))
        .map_err(to_py)?;
    let mut out_shape = shape;
    if let Some(last) = out_shape.last_mut() {
        *last /= 4;
    }
    Ok(PyArray1::from_vec(py, v).reshape(out_shape)?.into_any())
}

/// I2_S tensor byte count helper used by the Python layer's error messages.
#[pyfunction]
fn i2_s_tensor_bytes(rows: usize, cols: usize) -> Option<usize> {
    i2_s::tensor_bytes(rows, cols)
}

/// Canonical scale (fp16 bits) for a BitNet `weight_scale` under a linear class.
#[pyfunction]
#[pyo3(signature = (weight_scale, linear_class=None, tensor="<tensor>"))]
fn bitnet_canonical_scale(
    weight_scale: f32,
    linear_class: Option<&str>,
    tensor: &str,
) -> PyResult<u16> {
    let conv = ScaleConvention::from_linear_class(linear_class).map_err(to_py)?;
    conv.canonical_scale(tensor, weight_scale)
        .map(|s| s.to_bits())
        .map_err(to_py)
}

/// The canonical scales as f32 (helper so Python never re-implements fp16 rounding).
#[pyfunction]
fn scales_to_f32<'py>(
    py: Python<'py>,
    scales: PyReadonlyArrayDyn<'py, u16>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let s = slice(&scales, "scales")?.reinterpret_cast::<f16>();
    let mut out = vec![0f32; s.len()];
    s.convert_to_f32_slice(&mut out);
    Ok(PyArray1::from_vec(py, out))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_gguf, m)?)?;
    m.add_function(wrap_pyfunction!(encode_gguf, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_tensor_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(decode_bitnet, m)?)?;
    m.add_function(wrap_pyfunction!(encode_bitnet, m)?)?;
    m.add_function(wrap_pyfunction!(validate_mlx, m)?)?;
    m.add_function(wrap_pyfunction!(recover_dense, m)?)?;
    m.add_function(wrap_pyfunction!(ternarize, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_into, m)?)?;
    m.add_function(wrap_pyfunction!(validate, m)?)?;
    m.add_function(wrap_pyfunction!(regroup, m)?)?;
    m.add_function(wrap_pyfunction!(unpack_codes, m)?)?;
    m.add_function(wrap_pyfunction!(pack_codes, m)?)?;
    m.add_function(wrap_pyfunction!(i2_s_tensor_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(bitnet_canonical_scale, m)?)?;
    m.add_function(wrap_pyfunction!(scales_to_f32, m)?)?;
    Ok(())
}
