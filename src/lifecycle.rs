//! The pure retarget state machine for one prefill hop.
//!
//! [`Machine`] decides which worker-set *binding* may serve prefill requests while a controller
//! retargets the hop. It is sans-IO: it reads no clock, does no I/O, spawns nothing and takes no
//! lock. Facts about the world go in as [`Input`]s; orders to the world come out as [`Action`]s,
//! in one batch per input ([`Actions`]). The tokio adapter, the stateright model, the proptest
//! suite and the fuzzers all drive this same code.
//!
//! # Driving it
//!
//! ```
//! use prefill_router::lifecycle::{Action, BuildId, Input, Lifecycle, Machine, RetryPolicy};
//!
//! let mut m = Machine::new(RetryPolicy::default());
//! // The controller picks a target: the machine orders a build.
//! let out: Vec<_> = m.handle(Input::SetTarget(Some("gen-1"))).into_iter().collect();
//! assert_eq!(out, vec![Action::StartBuild { build: BuildId(1), target: "gen-1" }]);
//! assert_eq!(m.lifecycle(), Lifecycle::Pending);
//! // The build finishes: publish it.
//! let out: Vec<_> = m.handle(Input::BuildSucceeded(BuildId(1))).into_iter().collect();
//! assert_eq!(out, vec![Action::Publish { build: BuildId(1), target: "gen-1" }]);
//! assert_eq!(m.lifecycle(), Lifecycle::Active);
//! ```
//!
//! # Contract for the driver (the caller MUST)
//!
//! - carry out every action of a batch, in order: cancellations, then retirements, then
//!   starts and publishes;
//! - report each started build exactly once, as [`Input::BuildSucceeded`] or
//!   [`Input::BuildFailed`], unless it was cancelled (a late result of a cancelled build is
//!   harmless: it is answered with [`Action::Discard`] or ignored);
//! - feed [`Input::RetryElapsed`] when a timer armed by [`Action::ScheduleRetry`] fires, unless
//!   it was cancelled by [`Action::CancelRetry`] (a late firing is ignored).
//!
//! Why BuildIds: a build is identified by a fresh, never-reused id, so a completion can be
//! matched against "the build currently in flight" by value. Matching by target would let a
//! slow build for `A` (started, superseded by `B`, then `A` again) publish an outdated binding.

use std::fmt;
use std::time::Duration;

use crate::batch::{Batch, IntoIter};

/// The actions produced by one input, in the order the driver must carry them out: the shared
/// inline [`Batch`], since the machine is a plain value type and its hot path must not
/// allocate.
pub type Actions<T> = Batch<Action<T>>;

/// Owning iterator over an [`Actions`] batch.
pub type ActionsIntoIter<T> = IntoIter<Action<T>>;

/// The hop's routability, derived from the machine's state (never stored separately).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lifecycle {
    /// Not yet targeted, or a build for the desired target is under way or waiting to retry.
    Pending,
    /// The held binding serves the desired target: requests may prefill on it.
    Active,
    /// The controller said there is no prefill target, or the machine was shut down.
    Unavailable,
}

impl fmt::Display for Lifecycle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Lifecycle::Pending => "pending",
            Lifecycle::Active => "active",
            Lifecycle::Unavailable => "unavailable",
        })
    }
}

/// Identity of one build attempt. Starts at 1, strictly increases, never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BuildId(pub u64);

impl fmt::Display for BuildId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Delay before rebuilding after a failed build: `initial`, doubling per consecutive failure,
/// capped at `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RetryPolicy {
    /// Delay after the first failure.
    pub initial: Duration,
    /// Upper bound on the delay.
    pub max: Duration,
}

impl Default for RetryPolicy {
    /// 1 s, doubling, up to 30 s.
    fn default() -> Self {
        RetryPolicy {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// A flat delay; upstream Dynamo's behaviour is `fixed(1 s)`.
    pub fn fixed(delay: Duration) -> Self {
        RetryPolicy {
            initial: delay,
            max: delay,
        }
    }

    /// The delay before retry number `attempt` (1-based): `min(initial * 2^(attempt-1), max)`.
    pub fn delay(&self, attempt: u32) -> Duration {
        let shift = attempt.saturating_sub(1);
        let initial = self.initial.as_nanos();
        let cap = self.max.as_nanos();
        // initial * 2^shift in u128 nanoseconds; past the cap (or u128) it is the cap.
        let nanos = if initial == 0 {
            0
        } else if shift >= initial.leading_zeros() {
            cap
        } else {
            (initial << shift).min(cap)
        };
        // nanos <= max.as_nanos(), so it converts back without loss.
        Duration::new(
            (nanos / 1_000_000_000) as u64,
            (nanos % 1_000_000_000) as u32,
        )
    }
}

/// A fact about the world, fed to [`Machine::handle`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Input<T> {
    /// The controller's desired target: `Some(t)` to route prefill to `t`, `None` for no target.
    SetTarget(Option<T>),
    /// The build with this id produced a binding.
    BuildSucceeded(BuildId),
    /// The build with this id failed (a build timeout counts as a failure).
    BuildFailed(BuildId),
    /// The retry timer armed after build `BuildId` failed has fired.
    RetryElapsed(BuildId),
    /// Stop for good: cancel everything and retire the held binding.
    Shutdown,
}

/// An order to the world, returned by [`Machine::handle`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action<T> {
    /// Start building a binding for `target`; report the result with this `build` id.
    StartBuild {
        /// The id the result must carry.
        build: BuildId,
        /// What to build.
        target: T,
    },
    /// Abandon the build; its result, if it still arrives, will be discarded.
    CancelBuild {
        /// The build to abandon.
        build: BuildId,
    },
    /// Make the binding built by `build` the one requests route on.
    Publish {
        /// The build whose binding to publish.
        build: BuildId,
        /// The target it serves.
        target: T,
    },
    /// The binding built by `build` is no longer held: drop the router's reference (requests
    /// already holding it finish on it).
    Retire {
        /// The build whose binding to retire.
        build: BuildId,
    },
    /// The binding produced by `build` is stale: drop it unpublished.
    Discard {
        /// The stale build.
        build: BuildId,
    },
    /// Arm a timer; when it fires, feed [`Input::RetryElapsed`]`(after)`.
    ScheduleRetry {
        /// The failed build the retry follows.
        after: BuildId,
        /// How long to wait.
        delay: Duration,
        /// Consecutive failures so far for this target (1-based).
        attempt: u32,
    },
    /// Disarm the timer armed after build `after`.
    CancelRetry {
        /// The failed build whose retry timer to disarm.
        after: BuildId,
    },
}

impl<T: fmt::Debug> fmt::Display for Action<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::StartBuild { build, target } => write!(f, "start build {build} for {target:?}"),
            Action::CancelBuild { build } => write!(f, "cancel build {build}"),
            Action::Publish { build, target } => write!(f, "publish {build} for {target:?}"),
            Action::Retire { build } => write!(f, "retire {build}"),
            Action::Discard { build } => write!(f, "discard {build}"),
            Action::ScheduleRetry {
                after,
                delay,
                attempt,
            } => write!(
                f,
                "retry after {build} in {delay:?} (attempt {attempt})",
                build = after
            ),
            Action::CancelRetry { after } => write!(f, "cancel retry after {after}"),
        }
    }
}

/// The controller's decision, as far as the machine knows it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Desired<T> {
    /// No `SetTarget` yet.
    Undecided,
    /// The last `SetTarget` (or `Shutdown`, which decides `None`).
    Decided(Option<T>),
}

/// The retarget state machine. See the [module docs](self) for the driving contract.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Machine<T> {
    policy: RetryPolicy,
    desired: Desired<T>,
    /// The published binding kept for serving (Active) or for reuse (after `SetTarget(None)`).
    held: Option<(BuildId, T)>,
    /// The build under way; always for the desired target.
    in_flight: Option<(BuildId, T)>,
    /// The armed retry timer, named by the failed build it follows.
    retry: Option<BuildId>,
    failures: u32,
    next_build: u64,
    shut_down: bool,
}

impl<T: Clone + Eq + fmt::Debug> Machine<T> {
    /// A fresh machine: Pending, nothing held, nothing in flight.
    pub fn new(policy: RetryPolicy) -> Self {
        Machine {
            policy,
            desired: Desired::Undecided,
            held: None,
            in_flight: None,
            retry: None,
            failures: 0,
            next_build: 1,
            shut_down: false,
        }
    }

    /// Apply one input; returns the actions the driver must carry out, in order.
    pub fn handle(&mut self, input: Input<T>) -> Actions<T> {
        let mut out = Actions::default();
        if self.shut_down {
            // Only a late success needs an answer: its binding exists and must be dropped.
            if let Input::BuildSucceeded(build) = input {
                out.push(Action::Discard { build });
            }
            return out;
        }
        match input {
            Input::SetTarget(target) => self.set_target(target, &mut out),
            Input::BuildSucceeded(build) => match self.in_flight.take() {
                Some((current, target)) if current == build => {
                    out.push(Action::Publish {
                        build,
                        target: target.clone(),
                    });
                    self.held = Some((build, target));
                    self.failures = 0;
                }
                other => {
                    // Cancelled, superseded, repeated or unknown: stale-build rejection.
                    self.in_flight = other;
                    out.push(Action::Discard { build });
                }
            },
            Input::BuildFailed(build) => {
                if self.in_flight.as_ref().is_some_and(|(id, _)| *id == build) {
                    self.in_flight = None;
                    self.failures = self.failures.saturating_add(1);
                    self.retry = Some(build);
                    out.push(Action::ScheduleRetry {
                        after: build,
                        delay: self.policy.delay(self.failures),
                        attempt: self.failures,
                    });
                }
            }
            Input::RetryElapsed(after) => {
                if self.retry == Some(after) {
                    self.retry = None;
                    if let Desired::Decided(Some(target)) = &self.desired {
                        let target = target.clone();
                        self.start_build(target, &mut out);
                    }
                }
            }
            Input::Shutdown => {
                self.cancel_pending(&mut out);
                if let Some((build, _)) = self.held.take() {
                    out.push(Action::Retire { build });
                }
                self.desired = Desired::Decided(None);
                self.failures = 0;
                self.shut_down = true;
            }
        }
        out
    }

    fn set_target(&mut self, target: Option<T>, out: &mut Actions<T>) {
        if let Desired::Decided(current) = &self.desired {
            if *current == target {
                return; // Rule 1: same decision, nothing to do.
            }
        }
        self.cancel_pending(out);
        self.failures = 0;
        match &target {
            // Rule 2: keep the held binding for a possible return of its target.
            None => {}
            // Rule 3: the held binding serves the new target already.
            Some(t) if self.held.as_ref().is_some_and(|(_, h)| h == t) => {}
            // Rule 4: anything held serves another target.
            Some(t) => {
                if let Some((build, _)) = self.held.take() {
                    out.push(Action::Retire { build });
                }
                self.start_build(t.clone(), out);
            }
        }
        self.desired = Desired::Decided(target);
    }

    /// Cancel the build in flight and the armed retry (at most one exists, by I2).
    fn cancel_pending(&mut self, out: &mut Actions<T>) {
        if let Some((build, _)) = self.in_flight.take() {
            out.push(Action::CancelBuild { build });
        }
        if let Some(after) = self.retry.take() {
            out.push(Action::CancelRetry { after });
        }
    }

    fn start_build(&mut self, target: T, out: &mut Actions<T>) {
        let build = BuildId(self.next_build);
        self.next_build += 1;
        out.push(Action::StartBuild {
            build,
            target: target.clone(),
        });
        self.in_flight = Some((build, target));
    }

    /// The lifecycle derived from the state.
    pub fn lifecycle(&self) -> Lifecycle {
        match &self.desired {
            Desired::Undecided => Lifecycle::Pending,
            Desired::Decided(None) => Lifecycle::Unavailable,
            Desired::Decided(Some(t)) => match &self.held {
                Some((_, h)) if h == t => Lifecycle::Active,
                _ => Lifecycle::Pending,
            },
        }
    }

    /// The desired target; `None` both before the first `SetTarget` and after `SetTarget(None)`
    /// (tell them apart with [`Machine::is_targeted`]).
    pub fn desired(&self) -> Option<&T> {
        match &self.desired {
            Desired::Decided(Some(t)) => Some(t),
            _ => None,
        }
    }

    /// Whether the controller has decided anything yet (a `SetTarget` or `Shutdown` was handled).
    pub fn is_targeted(&self) -> bool {
        self.desired != Desired::Undecided
    }

    /// The published binding kept (routable iff [`Lifecycle::Active`]).
    pub fn held(&self) -> Option<(BuildId, &T)> {
        self.held.as_ref().map(|(b, t)| (*b, t))
    }

    /// The build under way, if any.
    pub fn in_flight(&self) -> Option<(BuildId, &T)> {
        self.in_flight.as_ref().map(|(b, t)| (*b, t))
    }

    /// The armed retry timer, named by the failed build it follows.
    pub fn retry_armed(&self) -> Option<BuildId> {
        self.retry
    }

    /// Consecutive failed builds for the desired target.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Whether [`Input::Shutdown`] was handled.
    pub fn is_shut_down(&self) -> bool {
        self.shut_down
    }

    /// The id the next `StartBuild` will carry.
    pub fn next_build_id(&self) -> BuildId {
        BuildId(self.next_build)
    }

    /// The retry policy.
    pub fn policy(&self) -> RetryPolicy {
        self.policy
    }
}

impl<T: Clone + Eq + fmt::Debug> Default for Machine<T> {
    fn default() -> Self {
        Machine::new(RetryPolicy::default())
    }
}

#[cfg(test)]
mod tests;
