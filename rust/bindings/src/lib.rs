//! `ternary_rs._core`: thin PyO3 bindings over `ternary-core`.
//!
//! One file per area, each with a `register` function; heavy work runs with the GIL released
//! (`py.detach`) and errors are mapped to the exception classes of [`errors`].

mod codecs;
mod container;
mod cuda;
mod errors;
mod hadamard;
mod kernels;
mod torch;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The contract's group sizes, so Python checks them against the same constant as the core.
    m.add(
        "GROUP_SIZES",
        pyo3::types::PyTuple::new(m.py(), ternary_core::canonical::GROUP_SIZES)?,
    )?;
    errors::register(m)?;
    container::register(m)?;
    codecs::register(m)?;
    kernels::register(m)?;
    cuda::register(m)?;
    hadamard::register(m)?;
    m.add_function(wrap_pyfunction!(set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(get_num_threads, m)?)?;
    Ok(())
}

/// Most worker threads one pool may have (more is a typo, and starting 10⁶ threads hangs the process).
const MAX_THREADS: i64 = 4096;

/// Set the number of threads heavy work uses (0 = all cores).
#[pyfunction]
fn set_num_threads(n: &Bound<'_, PyAny>) -> PyResult<()> {
    let n: i64 = n.extract().map_err(|_| {
        errors::invalid_argument(format!(
            "set_num_threads: expected a whole number of threads, got {}",
            n.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })?;
    if !(0..=MAX_THREADS).contains(&n) {
        return Err(errors::invalid_argument(format!(
            "set_num_threads({n}): expected 0 (all cores) up to {MAX_THREADS} threads"
        )));
    }
    ternary_core::threads::set_num_threads(n as usize).map_err(errors::to_py)
}

/// The number of threads heavy work uses.
#[pyfunction]
fn get_num_threads() -> usize {
    ternary_core::threads::num_threads()
}
