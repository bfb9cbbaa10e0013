//! The model's state: the machine under check plus the world the tokio adapter lives in.

use std::fmt;

use prefill_router::lifecycle::{BuildId, Lifecycle};

use crate::subject::Target;

/// A build the adapter started and whose result has not been reported yet. A cancelled build
/// may still report (late), in any order with the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Build {
    /// The id from `StartBuild`.
    pub id: BuildId,
    /// What it builds (the adapter's own record, not the machine's).
    pub target: Target,
    /// Whether the machine ordered `CancelBuild` for it.
    pub cancelled: bool,
    /// Whether it was started by a retry timer (for the vacuity check "a retry reaches Active").
    pub retry: bool,
}

/// A retry timer the adapter armed. A cancelled timer may still fire late (a firing racing its
/// cancellation), which the machine must ignore.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Timer {
    /// The failed build the retry follows.
    pub after: BuildId,
    /// The target the failed build was for.
    pub target: Target,
    /// Whether the machine ordered `CancelRetry` for it.
    pub cancelled: bool,
}

/// A binding the adapter built: the worker set of one build, for the target it really serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Binding {
    /// The build that produced it.
    pub build: BuildId,
    /// The target it serves.
    pub target: Target,
}

impl fmt::Display for Binding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.target, self.build)
    }
}

/// One request's progress: load the snapshot, then dispatch on the loaded binding or bypass to
/// decode, then finish.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Request {
    /// Not arrived yet.
    Idle,
    /// Loaded the snapshot: the binding it will use (`None`: bypass) and the controller's
    /// decision in force when it loaded.
    Loaded {
        /// The binding the snapshot routed it to.
        binding: Option<Binding>,
        /// The target of the last `SetTarget` that had returned before the load.
        desired: Option<Target>,
    },
    /// Prefilling on the binding it loaded.
    Running(Binding),
    /// Finished: on its binding, by bypass, or by a typed failure (its binding's admission
    /// had emptied). A failure is an ending, not a loss.
    Done,
}

/// What readers see: the lifecycle and the binding to route on (only when Active).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Snapshot {
    /// The machine's lifecycle.
    pub lifecycle: Lifecycle,
    /// The adapter's published binding, exposed only when Active.
    pub binding: Option<Binding>,
}

/// Sticky records of bad events (a safety property reads one bit each).
pub mod fault {
    /// A cancelled or superseded build was published.
    pub const STALE_PUBLISHED: u16 = 1 << 0;
    /// A `Retire` named a binding never published or already retired, or a published binding
    /// was replaced without being retired.
    pub const BAD_RETIRE: u16 = 1 << 1;
    /// A retired binding was published again.
    pub const REPUBLISHED: u16 = 1 << 2;
    /// A request that loaded after a retarget dispatched to a binding of an earlier target.
    pub const STALE_DISPATCH: u16 = 1 << 3;
    /// A request lost the binding it loaded (torn down under it).
    pub const REQUEST_LOST: u16 = 1 << 4;
    /// A `Publish` named a build that had not just succeeded and is not a known binding.
    pub const UNKNOWN_PUBLISH: u16 = 1 << 5;
    /// A request was dispatched on a binding whose admission set was empty (to a worker
    /// outside admission).
    pub const OUTSIDE_ADMISSION: u16 = 1 << 6;
}

/// Sticky records of good events, so `sometimes` properties show the model is not vacuous.
pub mod seen {
    /// A build started by a retry timer was published.
    pub const RETRY_ACTIVE: u8 = 1 << 0;
    /// A request finished on a binding that had been retired meanwhile.
    pub const RETIRED_SERVED: u8 = 1 << 1;
    /// A finished build was discarded as stale.
    pub const STALE_REJECTED: u8 = 1 << 2;
    /// A held binding was reused on a return to its target (Active without a build).
    pub const REUSED: u8 = 1 << 3;
    /// A request on a retired binding failed because the binding's admission had emptied.
    pub const ADMISSION_FAILED: u8 = 1 << 4;
}

/// The whole model state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State<S> {
    /// The machine under check.
    pub subject: S,
    /// The controller's last decision (`None`: no `SetTarget` yet).
    pub desired: Option<Option<Target>>,
    /// Whether the controller shut the hop down.
    pub shut_down: bool,
    /// Retargets the controller may still make.
    pub retargets_left: u8,
    /// Build failures the world may still inject.
    pub failures_left: u8,
    /// Builds started and not yet reported, by id.
    pub builds: Vec<Build>,
    /// Retry timers armed and not yet fired, by id.
    pub timers: Vec<Timer>,
    /// The adapter's published binding (set by `Publish`, cleared by `Retire`).
    pub current: Option<Binding>,
    /// The newest build ever started: an older one that finishes is superseded.
    pub newest: BuildId,
    /// Requests, kept sorted: they are interchangeable, so the sorted list is a canonical form.
    pub requests: Vec<Request>,
    /// Bit `i`: build `i` was ever published.
    pub published: u64,
    /// Bit `i`: build `i` was retired.
    pub retired: u64,
    /// Bit `i`: binding `i` was torn down (its workers dropped).
    pub torn: u64,
    /// Admission changes the world may still make (each empties one retired binding's set).
    pub admission_left: u8,
    /// Bit `i`: the admission set of binding `i` is empty.
    pub emptied: u64,
    /// [`fault`] bits.
    pub faults: u16,
    /// [`seen`] bits.
    pub seen: u8,
}

impl<S: crate::subject::Subject> State<S> {
    /// The snapshot the adapter publishes after every step.
    pub fn snapshot(&self) -> Snapshot {
        let lifecycle = self.subject.lifecycle();
        Snapshot {
            lifecycle,
            binding: if lifecycle == Lifecycle::Active {
                self.current
            } else {
                None
            },
        }
    }
}

/// The bit of a build id in the `published`/`retired`/`torn`/`emptied` masks; ids past 63 share bit 63
/// (the model's bounds keep ids far below that: see `Config::validate`).
pub fn bit(id: BuildId) -> u64 {
    1u64 << id.0.min(63)
}
