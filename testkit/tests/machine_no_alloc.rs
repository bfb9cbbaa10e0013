//! `Machine::handle` is a plain value-type step: it must not allocate (measured with the
//! testkit's counting global allocator over a realistic input mix).

use prefill_router::lifecycle::{Machine, RetryPolicy};
use prefill_router_testkit::alloc_probe::{peak_bytes, CountingAllocator};
use prefill_router_testkit::realistic_mix;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

#[test]
fn handle_never_allocates_on_a_realistic_mix() {
    let trace = realistic_mix(100_000, 3);
    let mut machine = Machine::new(RetryPolicy::default());
    // Any allocation inside the loop, even one freed at once, raises the peak above zero.
    let (actions, peak) = peak_bytes(|| {
        trace
            .iter()
            .map(|input| machine.handle(input.clone()).len())
            .sum::<usize>()
    });
    assert!(actions > trace.len() / 2, "the mix exercises the machine");
    assert_eq!(
        peak,
        Some(0),
        "Machine::handle allocated (None: allocator not installed)"
    );
}
