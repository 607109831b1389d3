//! GGUF reader (in progress)
