//! safetensors reader (in progress)
