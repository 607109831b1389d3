//! Containers: zero-copy readers and streaming writers for GGUF and safetensors.
//!
//! * [`gguf::GgufFile`] — GGUF v2/v3 reader (either byte order), id-42 variant resolution.
//! * [`safetensors::SafetensorsCheckpoint`] — one file or the shards of an `index.json`.
//! * [`gguf_writer::GgufWriter`], [`safetensors_writer::SafetensorsWriter`] — streaming writers.
//! * [`ggml_types::GgmlType`] — the ggml type table; [`limits`] — every hard limit, by name.
//!
//! Readers parse headers only and validate everything once at open; afterwards a tensor's bytes
//! are a bounds-checked slice of the shared [`mapping::MappedFile`].

pub mod ggml_types;
pub mod gguf;
pub mod gguf_writer;
pub mod limits;
pub mod mapping;
pub mod safetensors;
pub mod safetensors_writer;
pub mod sigbus;

pub use ggml_types::GgmlType;
pub use gguf::{GgufFile, GgufTensorInfo, GgufValue, GgufValueType};
pub use gguf_writer::{GgufWriter, MetaValue};
pub use mapping::MappedFile;
pub use safetensors::{Dtype, SafetensorsCheckpoint, SafetensorsFile, SafetensorsTensorInfo};
pub use safetensors_writer::SafetensorsWriter;

#[cfg(test)]
mod tests;
