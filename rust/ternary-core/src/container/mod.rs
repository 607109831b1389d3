//! Container readers and writers.
pub mod gguf;
pub mod safetensors;
