//! Arbitrary bytes, and mutations of real vLLM 0.32.0 payloads (the seed corpus), through the
//! pure decoder of the engines' msgpack KV event batches; a decoded batch's valid events must
//! re-encode and decode to themselves (harness: `prefill_router_testkit::engine_batch_fuzz`).
#![no_main]

use prefill_router_testkit::alloc_probe::CountingAllocator;

// The harness measures the decoder's peak allocation through this allocator.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    prefill_router_testkit::engine_batch_fuzz::engine_batch(data)
});
