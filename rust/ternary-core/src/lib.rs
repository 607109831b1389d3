//! ternary-core: the pure-Rust heart of ternary_rs.
//!
//! * [`container`] — zero-copy readers (and streaming writers) for GGUF and safetensors.
//! * [`formats`] — one module per ternary source format: block struct, scalar reference codec, fast path.
//! * [`canonical`] — the one in-memory form every format decodes to (codes `t+1`, 4 per byte along K).
//! * [`repack`] — multithreaded conversion between formats through the canonical form.
//! * [`kernels`] — ternary GEMV/GEMM on the CPU (AVX-512, AVX2, scalar; picked at run time) and the
//!   GPU weight layout permutation.
//! * [`attention`] — decode attention over vLLM's paged CPU KV cache.
//! * [`element`] — the f32 / bf16 / f16 element types of the f32 kernels.
//! * [`hadamard`] — the blockwise fast Walsh–Hadamard transform used by Bonsai 2's rotated weights.
//!
//! Nothing here panics on malformed input: every error is an [`Error`] that names file, tensor and offset.

pub mod attention;
pub mod canonical;
pub mod container;
mod cpu_features;
pub mod element;
pub mod error;
pub mod fast_math;
pub mod formats;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod gdn;
pub mod hadamard;
pub mod kernels;
pub mod repack;
pub mod sampling;
pub mod threads;

pub use error::{Error, Result};
