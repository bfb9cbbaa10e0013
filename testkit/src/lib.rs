//! Test and fuzz support for `prefill_router`, a workspace package of its own so the library
//! carries none of it (and a default build of the library never links `arbitrary`).
//!
//! One copy of everything the randomized checks share, so that the proptest suite, the
//! cargo-fuzz targets (crate `fuzz/`) and the stable corpus replay
//! (`testkit/tests/fuzz_corpus_replay.rs`) judge the machine by the same rules:
//!
//! - [`reference`](mod@reference): a reference model of the lifecycle machine, written from the transition
//!   rules of `docs/design.md`, and [`MachineView`], the observable state both expose;
//! - [`ledger`]: the history invariants I1..I6 checked after every step;
//! - [`machine_fuzz`], [`card_fuzz`], [`control_fuzz`], [`frame_fuzz`], [`record_fuzz`], [`health_fuzz`], [`kv_events_fuzz`], [`engine_batch_fuzz`], [`topology_fuzz`]: the fuzz harnesses, plain functions over bytes;
//! - [`alloc_probe`]: peak-allocation measurement for the decoder's memory bound;
//! - [`branches`]: which branches of `Machine::handle` a step exercised (coverage of a corpus);
//! - [`mutants`]: deliberately broken code under test that the checks must reject (the topology
//!   target's, a driver that shrinks before the target, lives in [`topology_fuzz`]);
//! - [`realistic_mix`]: a deterministic, realistic input mix for benchmarks and allocation tests.
//!
//! [`TARGETS`] names every fuzz target with its harness: the replay test runs every corpus and
//! artifact file through the harness listed there (the very function the fuzz binary calls), and
//! checks that every listed target has a fuzz binary and a seed corpus.

pub mod alloc_probe;
pub mod branches;
pub mod card_fuzz;
pub mod control_fuzz;
pub mod engine_batch_fuzz;
pub mod frame_fuzz;
pub mod health_fuzz;
pub mod kv_events_fuzz;
pub mod ledger;
pub mod machine_fuzz;
pub mod mutants;
pub mod record_fuzz;
pub mod reference;
pub mod topology_fuzz;
mod trace;

pub use reference::{MachineView, Reference};
pub use trace::realistic_mix;

/// A fuzz target: its cargo-fuzz name and the harness that judges one input.
#[derive(Clone, Copy, Debug)]
pub struct FuzzTarget {
    /// The binary name in `fuzz/Cargo.toml`, also the directory name under `fuzz/corpus/`.
    pub name: &'static str,
    /// Runs one raw fuzz input; panics (with a reproduction message) when a check fails.
    pub run: fn(&[u8]),
}

/// Every fuzz target of the crate.
pub const TARGETS: &[FuzzTarget] = &[
    FuzzTarget {
        name: "machine_inputs",
        run: machine_fuzz::machine_inputs,
    },
    FuzzTarget {
        name: "card_json",
        run: card_fuzz::card_json,
    },
    FuzzTarget {
        name: "control_ops",
        run: control_fuzz::control_ops,
    },
    FuzzTarget {
        name: "frame_decode",
        run: frame_fuzz::frame_decode,
    },
    FuzzTarget {
        name: "discovery_record",
        run: record_fuzz::discovery_record,
    },
    FuzzTarget {
        name: "health_inputs",
        run: health_fuzz::health_inputs,
    },
    FuzzTarget {
        name: "kv_events",
        run: kv_events_fuzz::kv_events,
    },
    FuzzTarget {
        name: "engine_batch",
        run: engine_batch_fuzz::engine_batch,
    },
    FuzzTarget {
        name: "topology_events",
        run: topology_fuzz::topology_events,
    },
];

/// The target called `name`, if any.
pub fn target(name: &str) -> Option<&'static FuzzTarget> {
    TARGETS.iter().find(|t| t.name == name)
}

#[cfg(test)]
mod tests;
