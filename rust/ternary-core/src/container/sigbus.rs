//! Surviving a mapped file that shrinks while it is read.
//!
//! A read-only map stays valid when its file is replaced (the old inode lives on), but when the file
//! is *truncated*, touching a page past its new end raises SIGBUS, which kills the process — in the
//! middle of a conversion, or of a vLLM start-up that reads headers through ternary_rs. So every map
//! made by [`super::MappedFile`] is registered here, and a process-wide SIGBUS handler (installed on
//! first use, chaining to whatever handler was there before) turns such a fault into data: it maps
//! zero pages over the rest of the registered range, so the read completes, and marks the range as
//! *tripped*. Readers then ask [`tripped`] (through `MappedFile::check_unchanged`) before they trust
//! what they read, and fail with an error naming the file. Faults outside registered ranges go to the
//! previous handler (or the default action), exactly as without this module.
//!
//! The handler only loads atomics and calls `mmap(2)`, which is a plain system call.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

/// Most maps guarded at once (a big sharded checkpoint has ~100 shards); more are simply unguarded.
pub const MAX_GUARDED_MAPS: usize = 4096;

struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    tripped: AtomicBool,
    /// Offset (within the map) of the first fault, valid once `tripped`.
    fault_offset: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)] // only used to initialise SLOTS
const EMPTY: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    tripped: AtomicBool::new(false),
    fault_offset: AtomicU64::new(0),
};
static SLOTS: [Slot; MAX_GUARDED_MAPS] = [EMPTY; MAX_GUARDED_MAPS];
static INSTALL: Once = Once::new();
/// The SIGBUS disposition before ours (faults outside guarded maps go there).
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Guard `[start, start + len)`; returns the slot to pass to [`tripped`] and [`unregister`], or None
/// when every slot is taken or the handler could not be installed (the map is then unguarded).
pub fn register(start: *const u8, len: usize) -> Option<usize> {
    if len == 0 {
        return None;
    }
    INSTALL.call_once(install);
    if !INSTALLED.load(Ordering::Acquire) {
        return None;
    }
    for (i, slot) in SLOTS.iter().enumerate() {
        // Claim a free slot by its length, then publish the start (the handler matches on both).
        if slot
            .len
            .compare_exchange(0, len, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            slot.tripped.store(false, Ordering::Relaxed);
            slot.fault_offset.store(0, Ordering::Relaxed);
            slot.start.store(start as usize, Ordering::Release);
            return Some(i);
        }
    }
    None
}

/// Stop guarding a slot (before its map is unmapped).
pub fn unregister(slot: usize) {
    let s = &SLOTS[slot];
    s.start.store(0, Ordering::Release);
    s.len.store(0, Ordering::Release);
}

/// The offset of the first access past the end of the file, if the guarded map was truncated.
pub fn tripped(slot: usize) -> Option<u64> {
    let s = &SLOTS[slot];
    s.tripped
        .load(Ordering::Acquire)
        .then(|| s.fault_offset.load(Ordering::Relaxed))
}

fn install() {
    // SAFETY: plain sigaction(2) calls on zero-initialised (valid) structs. The previous disposition
    // is stored before ours is installed, so the handler always finds it.
    unsafe {
        let mut previous: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut previous) != 0 {
            return;
        }
        let _ = PREVIOUS.set(previous);
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) == 0 {
            INSTALLED.store(true, Ordering::Release);
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in SLOTS.iter() {
        let start = slot.start.load(Ordering::Acquire);
        let len = slot.len.load(Ordering::Acquire);
        if start == 0 || addr < start || addr >= start + len {
            continue;
        }
        let page = page_size();
        let from = addr & !(page - 1);
        let end = (start + len).div_ceil(page) * page;
        // SAFETY: [from, end) lies inside this registered read-only file map (which is page aligned
        // and page-rounded by the kernel); replacing it with zero pages is what lets the faulting
        // read complete. The map owner unmaps the whole range later, these pages included.
        let p = unsafe {
            libc::mmap(
                from as *mut libc::c_void,
                end - from,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            if !slot.tripped.load(Ordering::Relaxed) {
                slot.fault_offset
                    .store((addr - start) as u64, Ordering::Relaxed);
            }
            slot.tripped.store(true, Ordering::Release);
            return;
        }
        break; // could not patch it up: behave as if unguarded
    }
    // Not ours: hand over to the previous disposition.
    let Some(prev) = PREVIOUS.get() else {
        // SAFETY: restoring the default disposition is always valid.
        unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
        return;
    };
    let handler = prev.sa_sigaction;
    // SAFETY: `handler` is the function the previous owner of SIGBUS installed, called with the
    // arguments the kernel gave us, in the form its flags declare; `info` is valid (see above).
    unsafe {
        if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
            // Restore the default and return: a faulting access repeats and terminates the process
            // with SIGBUS, as it would have without this handler (the kernel does not let a fault be
            // ignored either); a SIGBUS sent by kill(2) is raised again.
            libc::signal(libc::SIGBUS, libc::SIG_DFL);
            if (*info).si_code <= 0 {
                libc::raise(sig);
            }
            return;
        }
        if prev.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(handler);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
            f(sig);
        }
    }
}
