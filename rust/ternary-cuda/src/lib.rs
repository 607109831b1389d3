//! FFI to the fused ternary CUDA kernels (see `cuda/`).

/// Whether this build contains the CUDA kernels.
pub fn available() -> bool {
    cfg!(feature = "nvcc")
}
