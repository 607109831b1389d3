//! Where heavy work runs.
//!
//! * The ternary-rs rayon pool ([`install`], [`Rayon`]): conversion, codecs and the kernels when they
//!   are called outside torch. Its size can be set from Python (`ternary_rs.set_num_threads`); 0 means
//!   "all cores". Work is run with [`install`], so a caller's own rayon pool is never used by accident.
//! * Any other pool, through [`ParallelFor`]: inside torch (and so inside vLLM) the CPU kernel runs on
//!   torch's own intra-op OpenMP pool, which vLLM binds to cores — a second pool spinning beside it
//!   makes both slower (the bindings implement this trait with `torch_parallel_for`).

use std::ops::Range;
use std::sync::{Arc, RwLock};

static POOL: RwLock<Option<(usize, Arc<rayon::ThreadPool>)>> = RwLock::new(None);

/// Set the number of worker threads (0 = number of logical CPUs). Takes effect for the next call.
pub fn set_num_threads(n: usize) -> crate::Result<()> {
    let n = if n == 0 { default_threads() } else { n };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("ternary-rs-{i}"))
        .build()
        .map_err(|e| crate::Error::invalid(format!("cannot start {n} threads: {e}")))?;
    *POOL.write().unwrap_or_else(|p| p.into_inner()) = Some((n, Arc::new(pool)));
    Ok(())
}

/// The number of worker threads heavy work will use.
pub fn num_threads() -> usize {
    pool().current_num_threads()
}

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn pool() -> Arc<rayon::ThreadPool> {
    if let Some((_, p)) = POOL.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
        return p.clone();
    }
    let _ = set_num_threads(0);
    POOL.read()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .expect("pool was just created")
        .1
        .clone()
}

/// Run `f` on the ternary-rs pool.
pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    pool().install(f)
}

/// A buffer that several tasks of one parallel call write, each task its own disjoint elements: the base
/// pointer, shareable across the pool's threads (a raw pointer is neither `Send` nor `Sync`).
///
/// Sound only under that contract — no element written by two tasks, or read by one while another
/// writes it, and the buffer alive until the call returns — which the user's plan or split guarantees
/// and states where it creates one. Closures capture it whole through its methods (by value), never its
/// raw pointer field.
#[derive(Clone, Copy)]
pub(crate) struct DisjointWrites<T>(*mut T);
// SAFETY: see the type's contract; the tasks' writes never overlap.
unsafe impl<T: Send> Send for DisjointWrites<T> {}
unsafe impl<T: Send> Sync for DisjointWrites<T> {}

impl<T> DisjointWrites<T> {
    pub(crate) fn new(buffer: &mut [T]) -> Self {
        Self(buffer.as_mut_ptr())
    }

    /// From a base pointer into a buffer (a part of one a caller splits further).
    pub(crate) fn from_ptr(base: *mut T) -> Self {
        Self(base)
    }

    /// The address of element `i` (computed, not dereferenced).
    pub(crate) fn at(self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }

    /// Elements `start .. start + len`.
    ///
    /// # Safety
    /// They lie inside the buffer, and no other task touches them while the slice lives.
    pub(crate) unsafe fn slice<'b>(self, start: usize, len: usize) -> &'b mut [T] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// A parallel-for: run `f` over pieces of `0..n` that together cover it exactly once, possibly at the
/// same time on several threads, and return when all are done.
pub trait ParallelFor: Sync {
    /// Threads the pool runs pieces on (tasks are sized from this).
    fn threads(&self) -> usize;
    /// Call `f(range)` for disjoint ranges covering `0..n`.
    fn run(&self, n: usize, f: &(dyn Fn(Range<usize>) + Sync));
}

/// The ternary-rs rayon pool as a [`ParallelFor`] (one piece per index).
pub struct Rayon;

impl ParallelFor for Rayon {
    fn threads(&self) -> usize {
        num_threads()
    }

    fn run(&self, n: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        use rayon::prelude::*;
        if n <= 1 {
            if n == 1 {
                f(0..1);
            }
            return;
        }
        install(|| (0..n).into_par_iter().for_each(|i| f(i..i + 1)));
    }
}

/// Everything on the calling thread.
pub struct Serial;

impl ParallelFor for Serial {
    fn threads(&self) -> usize {
        1
    }

    fn run(&self, n: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        if n > 0 {
            f(0..n);
        }
    }
}
