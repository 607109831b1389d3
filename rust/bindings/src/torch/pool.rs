//! torch's intra-op pool (`torch_parallel_for`) as the core's [`ParallelFor`]: inside vLLM that is
//! the OpenMP pool bound to the cores, so no second pool spins against it.

use std::ffi::c_void;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use ternary_core::threads::ParallelFor;

use super::abi::Api;

/// torch's intra-op pool as a [`ParallelFor`].
pub(crate) struct TorchPool<'a>(pub(crate) &'a Api);

struct Trampoline<'f> {
    f: &'f (dyn Fn(Range<usize>) + Sync),
    panicked: AtomicBool,
}

unsafe extern "C" fn trampoline(begin: i64, end: i64, ctx: *mut c_void) {
    // SAFETY: ctx is the `Trampoline` `run` passes, alive for the whole parallel_for call.
    let t = unsafe { &*(ctx as *const Trampoline<'_>) };
    // A panic must never unwind into torch's C++ frames.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        (t.f)(begin as usize..end as usize)
    }))
    .is_err()
    {
        t.panicked.store(true, Ordering::Relaxed);
    }
}

impl ParallelFor for TorchPool<'_> {
    fn threads(&self) -> usize {
        let mut n = 1u32;
        // SAFETY: plain out-parameter.
        unsafe { (self.0.get_num_threads)(&mut n) };
        n.max(1) as usize
    }

    fn run(&self, n: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let t = Trampoline {
            f,
            panicked: AtomicBool::new(false),
        };
        // SAFETY: `t` outlives the call; torch_parallel_for returns after every piece ran.
        unsafe {
            (self.0.parallel_for)(
                0,
                n as i64,
                1,
                trampoline,
                &t as *const Trampoline<'_> as *mut c_void,
            )
        };
        if t.panicked.load(Ordering::Relaxed) {
            panic!("a ternary_rs kernel task panicked");
        }
    }
}
