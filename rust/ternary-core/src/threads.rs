//! The rayon pool all heavy work runs on. Its size can be set from Python (`ternary_rs.set_num_threads`);
//! 0 means "all cores". Work is run with [`install`], so a caller's own rayon pool is never used by accident.

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
