//! One error type for the whole core. The Python bindings map each variant to one exception class:
//! `Format` → `FormatError`, `UnsupportedType` → `UnsupportedTypeError`, `Validation` → `ValidationError`,
//! `Io` → `OSError`, `InvalidArgument` → `ValueError`.

use std::path::Path;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A malformed container: what was wrong, in which file, at which byte offset.
    #[error("{file}: {what} (at byte offset {offset})")]
    Format {
        file: String,
        offset: u64,
        what: String,
    },

    /// A type id or dtype we do not decode (or do not decode in this context).
    #[error("{file}: tensor '{tensor}': unsupported {what}; supported: {supported}")]
    UnsupportedType {
        file: String,
        tensor: String,
        what: String,
        supported: String,
    },

    /// Data that is well-formed but not acceptable: NaN/Inf scale, code 3, non-ternary value, shape mismatch.
    /// `first_index` is the first offending element (or block) index, `count` how many offend in total.
    #[error("tensor '{tensor}': {what} (first at index {first_index}, {count} in total)")]
    Validation {
        tensor: String,
        what: String,
        first_index: u64,
        count: u64,
    },

    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },

    /// A caller error (bad group size, mismatched shapes passed to an API).
    #[error("{0}")]
    InvalidArgument(String),
}

impl Error {
    pub fn format(file: impl AsRef<Path>, offset: u64, what: impl Into<String>) -> Self {
        Error::Format {
            file: file.as_ref().display().to_string(),
            offset,
            what: what.into(),
        }
    }

    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }

    pub fn invalid(what: impl Into<String>) -> Self {
        Error::InvalidArgument(what.into())
    }

    pub fn validation(
        tensor: impl Into<String>,
        what: impl Into<String>,
        first_index: u64,
        count: u64,
    ) -> Self {
        Error::Validation {
            tensor: tensor.into(),
            what: what.into(),
            first_index,
            count,
        }
    }
}
