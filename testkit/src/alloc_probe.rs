//! Measures how much memory a closure allocates at its peak, per thread, through a counting
//! global allocator that a test or fuzz binary installs:
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: prefill_router::testkit::alloc_probe::CountingAllocator =
//!     prefill_router::testkit::alloc_probe::CountingAllocator;
//! ```
//!
//! Counters are thread-local, so tests running in parallel do not disturb each other.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    /// Bytes currently allocated by this thread (net of frees; may go negative when a thread
    /// frees what another allocated, hence signed).
    static CURRENT: Cell<isize> = const { Cell::new(0) };
    /// The highest `CURRENT` since the last reset.
    static PEAK: Cell<isize> = const { Cell::new(0) };
    /// Whether any allocation went through the counting allocator on this thread.
    static SEEN: Cell<bool> = const { Cell::new(false) };
}

/// A global allocator that forwards to [`System`] and keeps per-thread byte counters.
pub struct CountingAllocator;

fn record(delta: isize) {
    // `try_with`: never panic inside the allocator, even during thread teardown.
    let _ = CURRENT.try_with(|c| {
        let now = c.get() + delta;
        c.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
    let _ = SEEN.try_with(|s| s.set(true));
}

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size() as isize);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(layout.size() as isize);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        record(-(layout.size() as isize));
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size as isize - layout.size() as isize);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Run `f`; returns its result and the peak number of bytes it had allocated at once (above
/// what was allocated when it started), or `None` for the peak when no [`CountingAllocator`]
/// is installed.
pub fn peak_bytes<R>(f: impl FnOnce() -> R) -> (R, Option<usize>) {
    let start = CURRENT.with(Cell::get);
    PEAK.with(|p| p.set(start));
    // Probe: an allocation the counting allocator must see.
    SEEN.with(|s| s.set(false));
    drop(std::hint::black_box(Box::new(0u64)));
    let installed = SEEN.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let result = f();
    let peak = PEAK.with(Cell::get) - start;
    (result, installed.then_some(peak.max(0) as usize))
}
