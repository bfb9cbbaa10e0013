//! The topology: turns a namespace's discovery records into the prefill router's target, as
//! upstream's controller does.
//!
//! Two parts, like the router: the pure [`Machine`] holds the rules (discovery's
//! `NamespaceEvent`s in, a batch of [`Action`]s out: admission sets to publish, the target to
//! set, generations to retire; no tokio, builds without the `runtime` feature), and the
//! `TopologyWatcher` (feature `runtime`) drives it: it owns the namespace watch, one admission
//! channel per generation and the target sink, and carries out every batch in order.
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
//! - admission sets that grow are published before the target is set, those that shrink after
//!   it (so no request reaches an instance the new target does not admit);
//! - the watcher calls `set_target` before it publishes its own view.

mod kind;
mod machine;
#[cfg(feature = "runtime")]
mod watcher;

pub use kind::{worker_kind, WorkerKind};
pub use machine::{
    Action, Actions, ActionsIntoIter, GenerationId, Machine, TargetSpec, MAX_DORMANT_SETS,
};
#[cfg(feature = "runtime")]
pub use watcher::{TargetSink, TopologySnapshot, TopologyWatcher};
