//! Bindings of the container readers and writers (`ternary_rs._core._GgufFile`, …).
//!
//! The Python-facing API lives in `python/ternary_rs/io.py`; these classes are its thin backend.
//! Zero-copy: `_Mapping` exposes a whole file map through the buffer protocol, read-only, and NumPy
//! views made from it (`np.frombuffer`) hold a reference to it, so the map outlives the reader.
//! Opening and writing release the GIL.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::path::PathBuf;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyString, PyTuple};
use ternary_core::container::gguf::{
    ArrayItems, ByteOrder, GgufArray, GgufFile, GgufValue, GgufValueType,
};
use ternary_core::container::{
    Dtype, GgufWriter, MappedFile, MetaValue, SafetensorsCheckpoint, SafetensorsWriter,
};

use crate::errors::to_py;

/// A read-only memory map of one file, exposed through the buffer protocol.
#[pyclass(frozen, module = "ternary_rs._core", name = "_Mapping")]
pub struct Mapping {
    file: MappedFile,
}

impl Mapping {
    fn new(m: &MappedFile) -> Self {
        Mapping { file: m.clone() }
    }

    fn bytes(&self) -> &[u8] {
        self.file.bytes()
    }
}

#[pymethods]
impl Mapping {
    /// # Safety
    /// `view` is the `Py_buffer` CPython passes; `PyBuffer_FillInfo` fills it and keeps `slf` alive.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("View is null"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "ternary_rs file mappings are read-only",
            ));
        }
        let bytes = slf.get().bytes();
        // SAFETY: the pointer stays valid while `slf` (which owns the shared map) is alive, and
        // PyBuffer_FillInfo stores a new reference to `slf` in the view.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                bytes.as_ptr() as *mut c_void,
                bytes.len() as ffi::Py_ssize_t,
                1,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.bytes().len()
    }

    /// Raise FormatError if the file shrank under the map, changed, or was replaced or removed since
    /// it was mapped (see `MappedFile::check_unchanged`).
    fn check_unchanged(&self) -> PyResult<()> {
        self.file.check_unchanged().map_err(to_py)
    }

    fn __repr__(&self) -> String {
        format!(
            "<ternary_rs mapping of {} ({} bytes)>",
            self.file.path().display(),
            self.bytes().len()
        )
    }
}

fn value_type_name(v: &GgufValue) -> String {
    match v {
        GgufValue::Array(a) => array_type_name(a),
        other => other.value_type().name().to_string(),
    }
}

fn array_type_name(a: &GgufArray) -> String {
    format!("array[{}]", a.elem.name())
}

fn text_or_bytes<'py>(py: Python<'py>, b: &[u8]) -> Bound<'py, PyAny> {
    match std::str::from_utf8(b) {
        Ok(s) => PyString::new(py, s).into_any(),
        Err(_) => PyBytes::new(py, b).into_any(),
    }
}

fn scalar_to_py<'py>(py: Python<'py>, v: &GgufValue) -> PyResult<Bound<'py, PyAny>> {
    Ok(match *v {
        GgufValue::U8(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::I8(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::U16(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::I16(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::U32(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::I32(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::U64(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::I64(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::F32(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::F64(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::Bool(x) => PyBool::new(py, x).to_owned().into_any(),
        GgufValue::String(_) | GgufValue::Array(_) => {
            return Err(crate::errors::invalid_argument("internal: not a scalar"));
        }
    })
}

fn value_to_py<'py>(py: Python<'py>, f: &GgufFile, v: &GgufValue) -> PyResult<Bound<'py, PyAny>> {
    match v {
        GgufValue::String(s) => Ok(text_or_bytes(py, f.span_bytes(*s))),
        GgufValue::Array(a) => array_to_py(py, f, a),
        other => scalar_to_py(py, other),
    }
}

fn array_to_py<'py>(py: Python<'py>, f: &GgufFile, a: &GgufArray) -> PyResult<Bound<'py, PyAny>> {
    let list = PyList::empty(py);
    match &a.items {
        ArrayItems::Strings(spans) => {
            for s in spans {
                list.append(text_or_bytes(py, f.span_bytes(*s)))?;
            }
        }
        ArrayItems::Arrays(inner) => {
            for x in inner {
                list.append(array_to_py(py, f, x)?)?;
            }
        }
        ArrayItems::Scalars(_) => {
            for i in 0..a.len {
                let v = f.array_scalar(a, i).ok_or_else(|| {
                    crate::errors::invalid_argument("internal: array element out of range")
                })?;
                list.append(scalar_to_py(py, &v)?)?;
            }
        }
    }
    Ok(list.into_any())
}

/// An open GGUF file (backend of `ternary_rs.open` for `.gguf`).
#[pyclass(frozen, module = "ternary_rs._core", name = "_GgufFile")]
pub struct PyGgufFile {
    inner: GgufFile,
}

#[pymethods]
impl PyGgufFile {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = py.detach(|| GgufFile::open(&path)).map_err(to_py)?;
        Ok(PyGgufFile { inner })
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path().to_path_buf()
    }
    #[getter]
    fn version(&self) -> u32 {
        self.inner.version
    }
    #[getter]
    fn alignment(&self) -> u64 {
        self.inner.alignment
    }
    #[getter]
    fn data_offset(&self) -> u64 {
        self.inner.data_offset
    }
    /// "little" or "big".
    #[getter]
    fn byte_order(&self) -> &'static str {
        match self.inner.byte_order {
            ByteOrder::Little => "little",
            ByteOrder::Big => "big",
        }
    }

    /// [(name, ne (GGUF order), type name, type id, nbytes, absolute offset)] in file order.
    /// One row per tensor, in file order, already in `TensorInfo`'s field order: (name, shape in
    /// PyTorch order, type name, type id, nbytes, absolute offset, `file`, ggml ne) — Python turns a row
    /// into a TensorInfo with one `tuple.__new__`, which keeps opening a file of thousands of tensors fast.
    fn tensor_infos<'py>(
        &self,
        py: Python<'py>,
        file: Bound<'py, PyString>,
    ) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        // One Python string per distinct type name (a model has a handful), not one per tensor.
        let mut type_names: Vec<(&'static str, Bound<'py, PyString>)> = Vec::new();
        for t in self.inner.tensors() {
            let ne = PyTuple::new(py, &t.ne)?;
            let shape = PyTuple::new(py, t.ne.iter().rev())?;
            let tname = t.ggml_type.name();
            let type_name = match type_names.iter().find(|(n, _)| *n == tname) {
                Some((_, s)) => s.clone(),
                None => {
                    let s = PyString::new(py, tname);
                    type_names.push((tname, s.clone()));
                    s
                }
            };
            list.append((
                t.name.as_str(),
                shape,
                type_name,
                t.type_id,
                t.nbytes,
                t.abs_offset,
                file.clone(),
                ne,
            ))?;
        }
        Ok(list)
    }

    /// [(key, type name, value)] in file order; type names are "u8" … "f64", "string", "array[<elem>]".
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (k, v) in self.inner.metadata() {
            list.append((
                k.as_str(),
                value_type_name(v),
                value_to_py(py, &self.inner, v)?,
            ))?;
        }
        Ok(list)
    }

    fn mapping(&self) -> Mapping {
        Mapping::new(self.inner.mapped())
    }
}

/// An open safetensors file or sharded checkpoint.
#[pyclass(frozen, module = "ternary_rs._core", name = "_SafetensorsCheckpoint")]
pub struct PySafetensors {
    inner: SafetensorsCheckpoint,
}

#[pymethods]
impl PySafetensors {
    /// Open one `.safetensors` file.
    #[staticmethod]
    fn open_file(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = py
            .detach(|| SafetensorsCheckpoint::open_file(&path))
            .map_err(to_py)?;
        Ok(PySafetensors { inner })
    }

    /// Open the shards of a `*.safetensors.index.json`.
    #[staticmethod]
    fn open_index(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = py
            .detach(|| SafetensorsCheckpoint::open_index(&path))
            .map_err(to_py)?;
        Ok(PySafetensors { inner })
    }

    #[getter]
    fn index_path(&self) -> Option<PathBuf> {
        self.inner.index_path.clone()
    }

    /// The index's "metadata" object as JSON text (None without an index or field).
    fn index_metadata_json(&self) -> Option<String> {
        self.inner.index_metadata.as_ref().map(|v| v.to_string())
    }

    fn shard_paths(&self) -> Vec<PathBuf> {
        self.inner
            .shards()
            .iter()
            .map(|s| s.path().to_path_buf())
            .collect()
    }

    /// One mapping per shard.
    fn mappings(&self) -> Vec<Mapping> {
        self.inner
            .shards()
            .iter()
            .map(|s| Mapping::new(s.mapped()))
            .collect()
    }

    /// [(name, shape, dtype, nbytes, absolute offset, shard index)] in checkpoint order.
    /// Rows in `TensorInfo`'s field order (name, shape, dtype, None, nbytes, absolute offset, shard file,
    /// None) and, separately, each tensor's shard index; `files` are the shard paths as Python strings.
    fn tensor_infos<'py>(
        &self,
        py: Python<'py>,
        files: Vec<Bound<'py, PyString>>,
    ) -> PyResult<(Bound<'py, PyList>, Vec<usize>)> {
        let list = PyList::empty(py);
        let mut shards = Vec::new();
        for (s, t) in self.inner.tensors() {
            let shape = PyTuple::new(py, &t.shape)?;
            let file = files.get(s).ok_or_else(|| {
                crate::errors::invalid_argument(format!("tensor_infos: shard {s} has no file name"))
            })?;
            list.append((
                t.name.as_str(),
                shape,
                t.dtype.name(),
                py.None(),
                t.nbytes,
                t.abs_offset,
                file.clone(),
                py.None(),
            ))?;
            shards.push(s);
        }
        Ok((list, shards))
    }

    /// `__metadata__` (merged over shards), or None.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(m) = self.inner.metadata() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        for (k, v) in m {
            d.set_item(k, v)?;
        }
        Ok(Some(d))
    }
}

/// A contiguous Python buffer as bytes; the owner must stay alive while the slice is used.
fn contiguous_bytes(buf: &PyUntypedBuffer) -> PyResult<&[u8]> {
    if !buf.is_c_contiguous() {
        return Err(crate::errors::invalid_argument(
            "tensor data must be a C-contiguous buffer",
        ));
    }
    // SAFETY: a C-contiguous buffer of len_bytes() bytes starting at buf_ptr(), valid while `buf`
    // (which holds the exporter's buffer) lives.
    Ok(unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) })
}

/// A raw pointer that may cross `py.detach` (the buffer it points into is held by the caller).
struct SendSlice(*const u8, usize);
unsafe impl Send for SendSlice {}
unsafe impl Sync for SendSlice {}

fn meta_from_py(key: &str, ty: &str, value: &Bound<'_, PyAny>) -> PyResult<MetaValue> {
    let bad = |e: PyErr| {
        crate::errors::invalid_argument(format!(
            "metadata '{key}': value does not fit type {ty}: {e}"
        ))
    };
    Ok(match ty {
        "u8" => MetaValue::U8(value.extract().map_err(bad)?),
        "i8" => MetaValue::I8(value.extract().map_err(bad)?),
        "u16" => MetaValue::U16(value.extract().map_err(bad)?),
        "i16" => MetaValue::I16(value.extract().map_err(bad)?),
        "u32" => MetaValue::U32(value.extract().map_err(bad)?),
        "i32" => MetaValue::I32(value.extract().map_err(bad)?),
        "u64" => MetaValue::U64(value.extract().map_err(bad)?),
        "i64" => MetaValue::I64(value.extract().map_err(bad)?),
        "f32" => MetaValue::F32(value.extract().map_err(bad)?),
        "f64" => MetaValue::F64(value.extract().map_err(bad)?),
        "bool" => MetaValue::Bool(value.extract().map_err(bad)?),
        "string" => MetaValue::String(value.extract().map_err(bad)?),
        // value = (element type, [items]); nested arrays give (element type, [items]) per item.
        "array" => {
            let (elem, items): (String, Vec<Bound<'_, PyAny>>) = value.extract().map_err(bad)?;
            let elem_ty = GgufValueType::from_name(&elem).ok_or_else(|| {
                crate::errors::invalid_argument(format!(
                    "metadata '{key}': unknown element type '{elem}'"
                ))
            })?;
            let items = items
                .iter()
                .map(|it| meta_from_py(key, &elem, it))
                .collect::<PyResult<Vec<_>>>()?;
            MetaValue::Array(elem_ty, items)
        }
        other => {
            return Err(crate::errors::invalid_argument(format!(
                "metadata '{key}': unknown GGUF value type '{other}'"
            )))
        }
    })
}

/// A streaming writer until `finish`/`abort` closes it, with the path its errors and `abort` use.
struct OpenWriter<W> {
    inner: Option<W>,
    path: PathBuf,
}

impl<W: Send> OpenWriter<W> {
    fn new(inner: W, path: PathBuf) -> Self {
        OpenWriter {
            inner: Some(inner),
            path,
        }
    }

    fn get(&mut self) -> PyResult<&mut W> {
        self.inner.as_mut().ok_or_else(|| {
            crate::errors::invalid_argument(format!("{}: writer is closed", self.path.display()))
        })
    }

    /// Run `write` on the bytes of the C-contiguous buffer `data` with the GIL released.
    fn write_buffer(
        &mut self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        write: impl FnOnce(&mut W, &[u8]) -> ternary_core::Result<()> + Send,
    ) -> PyResult<()> {
        let buf = PyUntypedBuffer::get(data)?;
        let bytes = contiguous_bytes(&buf)?;
        let s = SendSlice(bytes.as_ptr(), bytes.len());
        let w = self.get()?;
        py.detach(move || {
            let s = s;
            // SAFETY: `buf` keeps the exporter's memory alive until this call returns.
            let bytes = unsafe { std::slice::from_raw_parts(s.0, s.1) };
            write(w, bytes)
        })
        .map_err(to_py)
    }

    /// Run the writer's `finish` (checks, flush) with the GIL released, then close.
    fn finish(
        &mut self,
        py: Python<'_>,
        finish: impl FnOnce(&mut W) -> ternary_core::Result<()> + Send,
    ) -> PyResult<()> {
        let w = self.get()?;
        py.detach(|| finish(w)).map_err(to_py)?;
        self.inner = None;
        Ok(())
    }

    /// Close without checks and delete the partial file.
    fn abort(&mut self) {
        if self.inner.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Streaming GGUF v3 writer (backend of `ternary_rs.io.GGUFWriter`).
#[pyclass(module = "ternary_rs._core", name = "_GgufWriter")]
pub struct PyGgufWriter(OpenWriter<GgufWriter>);

#[pymethods]
impl PyGgufWriter {
    #[new]
    #[pyo3(signature = (path, alignment=32))]
    fn new(path: PathBuf, alignment: u64) -> PyResult<Self> {
        let inner = GgufWriter::create(&path, alignment).map_err(to_py)?;
        Ok(PyGgufWriter(OpenWriter::new(inner, path)))
    }

    /// `type` is a scalar type name, "string", or "array" with `value = (elem type, items)`.
    fn add_metadata(&mut self, key: &str, r#type: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let v = meta_from_py(key, r#type, value)?;
        self.0.get()?.add_metadata(key, v).map_err(to_py)
    }

    fn add_tensor_info(
        &mut self,
        name: &str,
        ne: Vec<u64>,
        type_id: u32,
        nbytes: u64,
    ) -> PyResult<()> {
        self.0
            .get()?
            .add_tensor_info(name, &ne, type_id, nbytes)
            .map_err(to_py)
    }

    fn write_tensor_data(
        &mut self,
        py: Python<'_>,
        name: &str,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.0
            .write_buffer(py, data, |w, bytes| w.write_tensor_data(name, bytes))
    }

    /// Check completeness, flush and close.
    fn finish(&mut self, py: Python<'_>) -> PyResult<()> {
        self.0.finish(py, |w| w.finish())
    }

    /// Close without checks and delete the partial file.
    fn abort(&mut self) {
        self.0.abort()
    }
}

/// Streaming safetensors writer (backend of `ternary_rs.io.SafetensorsWriter`).
#[pyclass(module = "ternary_rs._core", name = "_SafetensorsWriter")]
pub struct PySafetensorsWriter(OpenWriter<SafetensorsWriter>);

#[pymethods]
impl PySafetensorsWriter {
    #[new]
    #[pyo3(signature = (path, tensors, metadata=None))]
    fn new(
        path: PathBuf,
        tensors: Vec<(String, String, Vec<u64>)>,
        metadata: Option<BTreeMap<String, String>>,
    ) -> PyResult<Self> {
        let mut spec = Vec::with_capacity(tensors.len());
        for (name, dtype, shape) in tensors {
            let d = Dtype::from_name(&dtype).ok_or_else(|| {
                crate::errors::invalid_argument(format!(
                    "tensor '{name}': unknown safetensors dtype '{dtype}'"
                ))
            })?;
            spec.push((name, d, shape));
        }
        let inner = SafetensorsWriter::create(&path, &spec, metadata.as_ref()).map_err(to_py)?;
        Ok(PySafetensorsWriter(OpenWriter::new(inner, path)))
    }

    fn write(&mut self, py: Python<'_>, name: &str, data: &Bound<'_, PyAny>) -> PyResult<()> {
        self.0
            .write_buffer(py, data, |w, bytes| w.write(name, bytes))
    }

    fn finish(&mut self, py: Python<'_>) -> PyResult<()> {
        self.0.finish(py, |w| w.finish())
    }

    fn abort(&mut self) {
        self.0.abort()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Mapping>()?;
    m.add_class::<PyGgufFile>()?;
    m.add_class::<PySafetensors>()?;
    m.add_class::<PyGgufWriter>()?;
    m.add_class::<PySafetensorsWriter>()?;
    Ok(())
}
