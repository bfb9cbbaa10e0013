//! What the async side must do after a [`Control`](super::Control) call.
//!
//! The machine's `Publish`, `Retire` and `Discard` actions are carried out by `Control` itself
//! (they touch only the published cell and the binding store); the rest need a runtime: a
//! build task, a timer. They come back here, in the machine's order.

use std::time::Duration;

use crate::lifecycle::{Action, BuildId};

const CAPACITY: usize = 4;

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
#[must_use = "the async side must carry out every effect"]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Effects<T> {
    items: [Option<Effect<T>>; CAPACITY],
    len: usize,
}

impl<T> Default for Effects<T> {
    fn default() -> Self {
        Effects {
            items: [None, None, None, None],
            len: 0,
        }
    }
}

impl<T> Effects<T> {
    pub(crate) fn push(&mut self, effect: Effect<T>) {
        // A machine batch holds at most CAPACITY actions, so its effects fit; dropping one would
        // leave a build or timer unmanaged, hence the assert rather than a silent truncation.
        assert!(self.len < CAPACITY, "effect batch overflow");
        self.items[self.len] = Some(effect);
        self.len += 1;
    }

    /// Number of effects.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The effects, borrowed, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Effect<T>> {
        self.items[..self.len].iter().flatten()
    }

    /// The effects as a vector (allocates; convenient in tests and traces).
    pub fn to_vec(&self) -> Vec<Effect<T>>
    where
        T: Clone,
    {
        self.iter().cloned().collect()
    }
}

/// Owning iterator over [`Effects`].
#[derive(Debug)]
pub struct EffectsIntoIter<T> {
    items: [Option<Effect<T>>; CAPACITY],
    next: usize,
}

impl<T> Iterator for EffectsIntoIter<T> {
    type Item = Effect<T>;

    fn next(&mut self) -> Option<Effect<T>> {
        while self.next < CAPACITY {
            let i = self.next;
            self.next += 1;
            if let Some(e) = self.items[i].take() {
                return Some(e);
            }
        }
        None
    }
}

impl<T> IntoIterator for Effects<T> {
    type Item = Effect<T>;
    type IntoIter = EffectsIntoIter<T>;

    fn into_iter(self) -> EffectsIntoIter<T> {
        EffectsIntoIter {
            items: self.items,
            next: 0,
        }
    }
}

impl<'a, T> IntoIterator for &'a Effects<T> {
    type Item = &'a Effect<T>;
    type IntoIter = std::iter::Flatten<std::slice::Iter<'a, Option<Effect<T>>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.items[..self.len].iter().flatten()
    }
}
