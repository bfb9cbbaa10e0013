//! Arbitrary bytes, and cut, flipped or extended encodings of well-formed KV event batches,
//! through the pure decoder and into the index (harness: `prefill_router_testkit::kv_events_fuzz`).
#![no_main]

use prefill_router_testkit::alloc_probe::CountingAllocator;

// The harness measures the decoder's peak allocation through this allocator.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

libfuzzer_sys::fuzz_target!(|data: &[u8]| prefill_router_testkit::kv_events_fuzz::kv_events(data));
