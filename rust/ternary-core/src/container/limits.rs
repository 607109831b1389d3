//! Hard limits applied to every count, length and size a container header declares.
//!
//! A header is untrusted input: each value is checked against these before it is used to size an
//! allocation or index the mapping, so a hostile or corrupted file fails with a clear error instead
//! of exhausting memory. The values are far above anything a real checkpoint needs.

/// Most tensors one GGUF file may declare (the largest real models have a few tens of thousands).
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most metadata key/value pairs one GGUF file may declare.
pub const MAX_KV: u64 = 1 << 20;
/// Longest GGUF string (key, tensor name or string value), in bytes. Chat templates are the longest.
pub const MAX_STRING_LEN: u64 = 64 << 20;
/// Longest tensor name, in bytes (ggml itself uses 64; Hugging Face names can be longer).
pub const MAX_TENSOR_NAME_LEN: u64 = 4096;
/// Most elements in one GGUF metadata array (vocabularies and merge lists are the longest).
pub const MAX_ARRAY_LEN: u64 = 1 << 28;
/// Deepest nesting of GGUF metadata arrays (arrays of arrays of …).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Most dimensions a GGUF tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: u64 = 4;
/// Largest `general.alignment` accepted (must also be a power of two).
pub const MAX_ALIGNMENT: u64 = 1 << 24;
/// GGUF default alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Largest element count of one tensor (ggml uses int64 element counts).
pub const MAX_ELEMENTS: u64 = i64::MAX as u64;

/// Largest safetensors JSON header, in bytes (the `safetensors` crate's `MAX_HEADER_SIZE`).
pub const MAX_HEADER_SIZE: u64 = 100_000_000;
/// Most dimensions a safetensors tensor may have.
pub const MAX_SAFETENSORS_DIMS: usize = 64;
/// Largest `*.safetensors.index.json`, in bytes.
pub const MAX_INDEX_SIZE: u64 = 256 << 20;
/// Most shards one index may reference.
pub const MAX_SHARDS: usize = 1 << 16;
