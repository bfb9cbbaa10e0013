//! The machine's inputs, interleaved with request admissions and pinned snapshots, through the
//! thread-safe control core, checked against a shadow machine after every operation (harness:
//! `prefill_router_testkit::control_fuzz`).
#![no_main]

use prefill_router_testkit::control_fuzz::{check_control_script, ControlScript};

libfuzzer_sys::fuzz_target!(|script: ControlScript| check_control_script(&script));
