//! Kernels.
pub mod cpu;
