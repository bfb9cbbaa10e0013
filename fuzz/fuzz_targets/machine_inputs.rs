//! A sequence of lifecycle inputs through `Machine`, checked after every step against the
//! reference model and I1..I6 (harness: `prefill_router_testkit::machine_fuzz`).
//!
//! `PREFILL_FUZZ_MUTANT=<Mutation>` (e.g. `PublishesStaleBuilds`) fuzzes a deliberately broken
//! machine instead, to measure how fast the fuzzer finds a known bug (docs/fuzzing.md).
#![no_main]

use std::sync::OnceLock;

use prefill_router_testkit::machine_fuzz::{check_script, MachineScript};
use prefill_router_testkit::mutants::{check_script_against_mutant, Mutation};

fn mutant() -> Option<Mutation> {
    static MUTANT: OnceLock<Option<Mutation>> = OnceLock::new();
    *MUTANT.get_or_init(|| {
        std::env::var("PREFILL_FUZZ_MUTANT")
            .ok()
            .map(|name| Mutation::named(&name).unwrap_or_else(|| panic!("no mutation {name}")))
    })
}

// Typed, so that `cargo fuzz fmt machine_inputs <file>` prints the decoded script; libfuzzer-sys
// decodes it with `arbitrary_take_rest`, exactly as the stable replay does.
libfuzzer_sys::fuzz_target!(|script: MachineScript| match mutant() {
    None => check_script(&script),
    Some(mutation) => check_script_against_mutant(&script, mutation),
});
