//! Raw bytes and structure-aware JSON through card parsing and resolution (harness:
//! `prefill_router_testkit::card_fuzz`).
#![no_main]

// Raw bytes, not a typed input: the harness also feeds the bytes themselves as a card document.
libfuzzer_sys::fuzz_target!(|data: &[u8]| prefill_router_testkit::card_fuzz::card_json(data));
