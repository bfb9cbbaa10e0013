//! `Machine::handle` is a plain value-type step: it must not allocate (measured with a counting
//! global allocator over a realistic input mix).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use prefill_router::lifecycle::{realistic_mix, Machine, RetryPolicy};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn handle_never_allocates_on_a_realistic_mix() {
    let trace = realistic_mix(100_000, 3);
    let mut machine = Machine::new(RetryPolicy::default());
    let mut actions = 0usize;
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for input in &trace {
        actions += machine.handle(input.clone()).len();
    }
    let allocated = ALLOCATIONS.load(Ordering::Relaxed) - before;
    assert!(actions > trace.len() / 2, "the mix exercises the machine");
    assert_eq!(allocated, 0, "Machine::handle allocated {allocated} times");
}
