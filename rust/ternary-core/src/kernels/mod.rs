//! Kernels.
pub mod cpu;
pub mod gpu_layout;
