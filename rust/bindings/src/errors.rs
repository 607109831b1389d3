//! Python exception classes and the one mapping from `ternary_core::Error` to them.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyType};
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

/// Errors that are a ternary_rs error and a built-in exception at once, so that both `except TernaryError`
/// and the built-in's `except` (`OSError`, `FileNotFoundError`, `ValueError`, `KeyError`, …) catch them:
/// (name, bases, doc). A base named here before is one of these classes; any other a builtin.
/// `create_exception!` takes a single base, so they are made with `type(name, bases, ns)`.
const DUAL_CLASSES: &[(&str, &[&str], &str)] = &[
    (
        "InvalidArgumentError",
        &["TernaryError", "ValueError", "TypeError"],
        "A bad argument: an unknown dtype, a K that is no multiple of the group, a negative thread count, \
         a closed file (also a ValueError and a TypeError).",
    ),
    (
        "TensorNotFoundError",
        &["TernaryError", "KeyError"],
        "No tensor of that name in the file (also a KeyError).",
    ),
    (
        "TernaryOSError",
        &["TernaryError", "OSError"],
        "A file could not be read or written (also an OSError; errno and filename as usual).",
    ),
    (
        "TernaryFileNotFoundError",
        &["TernaryOSError", "FileNotFoundError"],
        "A file or folder does not exist (also a FileNotFoundError).",
    ),
    (
        "TernaryFileExistsError",
        &["TernaryOSError", "FileExistsError"],
        "The destination exists and may not be replaced (also a FileExistsError).",
    ),
    (
        "TernaryPermissionError",
        &["TernaryOSError", "PermissionError"],
        "Permission denied (also a PermissionError).",
    ),
    (
        "TernaryIsADirectoryError",
        &["TernaryOSError", "IsADirectoryError"],
        "A folder where a file was expected (also an IsADirectoryError).",
    ),
    (
        "TernaryNotADirectoryError",
        &["TernaryOSError", "NotADirectoryError"],
        "A file where a folder was expected (also a NotADirectoryError).",
    ),
];

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TernaryError", py.get_type::<TernaryError>())?;
    m.add("FormatError", py.get_type::<FormatError>())?;
    m.add(
        "UnsupportedTypeError",
        py.get_type::<UnsupportedTypeError>(),
    )?;
    m.add("ValidationError", py.get_type::<ValidationError>())?;
    let builtins = py.import("builtins")?;
    let make_type = builtins.getattr("type")?;
    for (name, bases, doc) in DUAL_CLASSES {
        let mut classes = Vec::with_capacity(bases.len());
        for base in *bases {
            classes.push(match m.getattr(*base) {
                Ok(own) => own,
                Err(_) => builtins.getattr(*base)?,
            });
        }
        let ns = PyDict::new(py);
        ns.set_item("__module__", "ternary_rs")?;
        ns.set_item("__doc__", *doc)?;
        let cls = make_type.call1((*name, PyTuple::new(py, classes)?, ns))?;
        m.add(*name, cls)?;
    }
    Ok(())
}

/// One of [`DUAL_CLASSES`] (registered on `ternary_rs._core`), or `None` before the module exists.
fn dual_class<'py>(py: Python<'py>, name: &str) -> Option<Bound<'py, PyType>> {
    py.import("ternary_rs._core")
        .and_then(|m| m.getattr(name))
        .ok()
        .and_then(|c| c.cast_into::<PyType>().ok())
}

/// `InvalidArgumentError(msg)`: a bad argument (also a `ValueError` and a `TypeError`).
pub fn invalid_argument(msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| match dual_class(py, "InvalidArgumentError") {
        Some(cls) => PyErr::from_type(cls, msg),
        None => PyValueError::new_err(msg),
    })
}

/// The OS error class for an errno: `TernaryFileNotFoundError` for ENOENT and so on (each also the
/// built-in `OSError` subclass Python picks for that errno), `TernaryOSError` otherwise.
fn os_error(errno: i32, msg: String) -> PyErr {
    let name = match errno {
        2 => "TernaryFileNotFoundError",
        1 | 13 => "TernaryPermissionError",
        17 => "TernaryFileExistsError",
        20 => "TernaryNotADirectoryError",
        21 => "TernaryIsADirectoryError",
        _ => "TernaryOSError",
    };
    Python::attach(|py| match dual_class(py, name) {
        Some(cls) => PyErr::from_type(cls, (errno, msg)),
        None => PyOSError::new_err((errno, msg)),
    })
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
        Error::Io { source, .. } => os_error(source.raw_os_error().unwrap_or(0), msg),
        Error::InvalidArgument(_) => invalid_argument(msg),
    }
}
