//! Arbitrary bytes and structure-aware record documents, under matching or arbitrary keys,
//! through the discovery record reader every backend shares (harness:
//! `prefill_router_testkit::record_fuzz`).
#![no_main]

// Raw bytes: the harness also reads the bytes themselves as a record.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    prefill_router_testkit::record_fuzz::discovery_record(data)
});
