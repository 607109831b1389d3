//! Ternary formats (in progress)
