//! A sequence of worker-health inputs through the breaker machine, checked after every step
//! against a ledger of discovery, armed timers and probes out (harness:
//! `prefill_router_testkit::health_fuzz`).
#![no_main]

use prefill_router_testkit::health_fuzz::{check_health_script, HealthScript};

libfuzzer_sys::fuzz_target!(|script: HealthScript| check_health_script(&script));
