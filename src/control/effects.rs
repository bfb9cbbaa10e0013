//! What the async side must do after a [`Control`](super::Control) call.
//!
//! The machine's `Publish`, `Retire` and `Discard` actions are carried out by `Control` itself
//! (they touch only the published cell and the binding store); the rest need a runtime: a
//! build task, a timer. They come back here, in the machine's order.

use std::time::Duration;

use crate::batch::{Batch, IntoIter};
use crate::lifecycle::{Action, BuildId};

/// One order for the async side.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Effect<T> {
    /// Start building a binding for `target`; report it with
    /// [`Control::build_succeeded`](super::Control::build_succeeded) or
    /// [`Control::build_failed`](super::Control::build_failed) under this id.
    StartBuild {
        /// The id the result must carry.
        build: BuildId,
        /// What to build.
        target: T,
    },
    /// Abandon this build (a late result is harmless: it is discarded).
    CancelBuild {
        /// The build to abandon.
        build: BuildId,
    },
    /// Arm a timer; when it fires call
    /// [`Control::retry_elapsed`](super::Control::retry_elapsed)`(after)`.
    ScheduleRetry {
        /// The failed build the retry follows.
        after: BuildId,
        /// How long to wait.
        delay: Duration,
        /// Consecutive failures so far for this target (1-based).
        attempt: u32,
    },
    /// Disarm the timer armed after build `after` (a late firing is ignored).
    CancelRetry {
        /// The failed build whose retry timer to disarm.
        after: BuildId,
    },
}

impl<T> Effect<T> {
    /// The async-side part of a machine action; `None` for the actions `Control` applies.
    pub(crate) fn from_action(action: Action<T>) -> Option<Self> {
        match action {
            Action::StartBuild { build, target } => Some(Effect::StartBuild { build, target }),
            Action::CancelBuild { build } => Some(Effect::CancelBuild { build }),
            Action::ScheduleRetry {
                after,
                delay,
                attempt,
            } => Some(Effect::ScheduleRetry {
                after,
                delay,
                attempt,
            }),
            Action::CancelRetry { after } => Some(Effect::CancelRetry { after }),
            Action::Publish { .. } | Action::Retire { .. } | Action::Discard { .. } => None,
        }
    }
}

/// The effects of one call, in order (cancellations before starts). Inline, no allocation.
pub type Effects<T> = Batch<Effect<T>>;

/// Owning iterator over [`Effects`].
pub type EffectsIntoIter<T> = IntoIter<Effect<T>>;
