//! CPU ternary GEMV/GEMM (in progress)
