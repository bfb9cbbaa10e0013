//! The topology watcher: turns a namespace's discovery records into the prefill router's
//! target, as upstream's controller does.
//!
//! Rules (`docs/demo.md` has the long form):
//! - a worker set is the instances of one endpoint; its role comes from its component name
//!   ([`worker_kind`]);
//! - exactly one live prefill set and exactly one live decode set give `Some(target)`;
//!   anything else gives `None` (bypass);
//! - first-wins admission: the earliest-arrived live instance's card is the set's *selected*
//!   card; instances whose card equals it are admitted, others are rejected with a log line;
//! - a new generation when the selected card changes (the old card's instances all left and
//!   another card is live); a pool that leaves and returns with the same card keeps its
//!   generation, so the router reuses its binding;
//! - the watcher calls `set_target` before it publishes its own view.

mod kind;
mod sets;
mod watcher;

pub use kind::{worker_kind, WorkerKind};
pub use sets::{AdmissionChange, Changes, Topology, TopologySnapshot, MAX_DORMANT_SETS};
pub use watcher::{TargetSink, TopologyWatcher};
