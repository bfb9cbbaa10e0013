//! A sequence of lifecycle inputs through `Machine`, checked after every step against the
//! reference model and I1..I6 (harness: `prefill_router::testkit::machine_fuzz`).
#![no_main]

use prefill_router::testkit::machine_fuzz::{check_script, MachineScript};

// Typed, so that `cargo fuzz fmt machine_inputs <file>` prints the decoded script; libfuzzer-sys
// decodes it with `arbitrary_take_rest`, exactly as the stable replay does.
libfuzzer_sys::fuzz_target!(|script: MachineScript| check_script(&script));
