//! Test and fuzz support (cargo feature `testkit`; not a public API, hence `#[doc(hidden)]`).
//!
//! One copy of everything the randomized checks share, so that the proptest suite, the
//! cargo-fuzz targets (crate `fuzz/`) and the stable corpus replay (`tests/fuzz_corpus_replay.rs`)
//! judge the machine by the same rules:
//!
//! - [`reference`](mod@reference): a reference model of the lifecycle machine, written from the transition
//!   rules of `docs/design.md`, and [`MachineView`], the observable state both expose;
//! - [`ledger`]: the history invariants I1..I6 checked after every step;
//! - [`machine_fuzz`], [`card_fuzz`], `control_fuzz`, `frame_fuzz` (feature `runtime`),
//!   [`record_fuzz`]: the fuzz harnesses, plain functions over bytes;
//! - [`alloc_probe`]: peak-allocation measurement for the decoder's memory bound;
//! - [`branches`]: which branches of `Machine::handle` a step exercised (coverage of a corpus);
//! - [`mutants`]: deliberately broken code under test that the checks must reject.
//!
//! [`TARGETS`] names every fuzz target with its harness: the replay test runs every corpus and
//! artifact file through the harness listed there (the very function the fuzz binary calls), and
//! checks that every listed target has a fuzz binary and a seed corpus.

pub mod alloc_probe;
pub mod branches;
pub mod card_fuzz;
// Under loom the core's cell and lock are loom types, usable only inside a loom model.
#[cfg(not(prefill_loom))]
pub mod control_fuzz;
#[cfg(feature = "runtime")]
pub mod frame_fuzz;
pub mod ledger;
pub mod machine_fuzz;
pub mod mutants;
pub mod record_fuzz;
pub mod reference;

pub use reference::{MachineView, Reference};

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
    #[cfg(not(prefill_loom))]
    FuzzTarget {
        name: "control_ops",
        run: control_fuzz::control_ops,
    },
    #[cfg(feature = "runtime")]
    FuzzTarget {
        name: "frame_decode",
        run: frame_fuzz::frame_decode,
    },
    FuzzTarget {
        name: "discovery_record",
        run: record_fuzz::discovery_record,
    },
];

/// The target called `name`, if any.
pub fn target(name: &str) -> Option<&'static FuzzTarget> {
    TARGETS.iter().find(|t| t.name == name)
}

#[cfg(test)]
mod tests;
