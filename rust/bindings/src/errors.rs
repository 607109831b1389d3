//! Python exception classes and the one mapping from `ternary_core::Error` to them.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyOSError, PyValueError};
use pyo3::prelude::*;
use ternary_core::Error;

create_exception!(
    ternary_rs,
    TernaryError,
    PyException,
    "Base class of every ternary_rs error."
);
create_exception!(
    ternary_rs,
    FormatError,
    TernaryError,
    "Malformed container (names file, field and byte offset)."
);
create_exception!(
    ternary_rs,
    UnsupportedTypeError,
    TernaryError,
    "A tensor type or dtype ternary_rs does not handle here (names tensor and what is supported)."
);
create_exception!(
    ternary_rs,
    ValidationError,
    TernaryError,
    "Well-formed but unacceptable data: NaN/Inf scale, code 3, non-ternary values, shape mismatch."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TernaryError", py.get_type::<TernaryError>())?;
    m.add("FormatError", py.get_type::<FormatError>())?;
    m.add(
        "UnsupportedTypeError",
        py.get_type::<UnsupportedTypeError>(),
    )?;
    m.add("ValidationError", py.get_type::<ValidationError>())?;
    Ok(())
}

/// Map a core error to its Python exception. A `ValidationError` also carries the structured fields as
/// attributes (`tensor`, `first_index`, `count`), so callers can report the first bad index without
/// parsing the message.
pub fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Format { .. } => FormatError::new_err(msg),
        Error::UnsupportedType { .. } => UnsupportedTypeError::new_err(msg),
        Error::Validation {
            tensor,
            first_index,
            count,
            ..
        } => {
            let err = ValidationError::new_err(msg);
            Python::attach(|py| {
                let value = err.value(py);
                // Setting attributes on a fresh exception instance cannot fail in practice; if it
                // did, the message still holds the same facts.
                let _ = value.setattr("tensor", tensor);
                let _ = value.setattr("first_index", first_index);
                let _ = value.setattr("count", count);
            });
            err
        }
        Error::Io { source, .. } => PyOSError::new_err((source.raw_os_error().unwrap_or(0), msg)),
        Error::InvalidArgument(_) => PyValueError::new_err(msg),
    }
}
