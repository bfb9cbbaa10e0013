//! A reference model of the lifecycle machine, restated as plainly as possible from the rules of
//! `docs/design.md` (it shares no code with `lifecycle`), and the observable state both expose.

use std::fmt;
use std::time::Duration;

use prefill_router::lifecycle::{Action, BuildId, Input, Lifecycle, Machine, RetryPolicy};

/// Everything a driver can observe of a machine, as one comparable value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MachineView<T> {
    /// [`Machine::lifecycle`].
    pub lifecycle: Lifecycle,
    /// [`Machine::desired`].
    pub desired: Option<T>,
    /// [`Machine::is_targeted`].
    pub targeted: bool,
    /// [`Machine::held`].
    pub held: Option<(BuildId, T)>,
    /// [`Machine::in_flight`].
    pub in_flight: Option<(BuildId, T)>,
    /// [`Machine::retry_armed`].
    pub retry_armed: Option<BuildId>,
    /// [`Machine::failures`].
    pub failures: u32,
    /// [`Machine::is_shut_down`].
    pub shut_down: bool,
    /// [`Machine::next_build_id`].
    pub next_build: BuildId,
}

impl<T: Clone + Eq + fmt::Debug> MachineView<T> {
    /// Read every getter of `machine`.
    pub fn of(machine: &Machine<T>) -> Self {
        MachineView {
            lifecycle: machine.lifecycle(),
            desired: machine.desired().cloned(),
            targeted: machine.is_targeted(),
            held: machine.held().map(|(b, t)| (b, t.clone())),
            in_flight: machine.in_flight().map(|(b, t)| (b, t.clone())),
            retry_armed: machine.retry_armed(),
            failures: machine.failures(),
            shut_down: machine.is_shut_down(),
            next_build: machine.next_build_id(),
        }
    }

    /// The id of the most recently started build (`#0` before the first).
    pub fn latest_build(&self) -> BuildId {
        BuildId(self.next_build.0.saturating_sub(1))
    }
}

/// The documented backoff, `min(initial * 2^(attempt-1), max)`, in exact arithmetic (no
/// intermediate saturation), so that it can disagree with a wrong implementation.
pub fn documented_delay(policy: RetryPolicy, attempt: u32) -> Duration {
    let shift = attempt.saturating_sub(1);
    let max = policy.max.as_nanos();
    let grown = 1u128
        .checked_shl(shift)
        .and_then(|factor| policy.initial.as_nanos().checked_mul(factor))
        .unwrap_or(u128::MAX);
    if grown >= max {
        policy.max
    } else {
        // `grown < max`, and `max` came from a Duration: the parts fit.
        Duration::new(
            (grown / 1_000_000_000) as u64,
            (grown % 1_000_000_000) as u32,
        )
    }
}

/// The reference model. Field names follow the design document, not the machine.
#[derive(Clone, Debug)]
pub struct Reference<T> {
    policy: RetryPolicy,
    decided: bool,
    desired: Option<T>,
    held: Option<(u64, T)>,
    building: Option<(u64, T)>,
    retry_after: Option<u64>,
    failures: u32,
    last_id: u64,
    stopped: bool,
}

impl<T: Clone + Eq + fmt::Debug> Reference<T> {
    /// A fresh model: nothing decided, held, built or armed.
    pub fn new(policy: RetryPolicy) -> Self {
        Reference {
            policy,
            decided: false,
            desired: None,
            held: None,
            building: None,
            retry_after: None,
            failures: 0,
            last_id: 0,
            stopped: false,
        }
    }

    fn lifecycle(&self) -> Lifecycle {
        if !self.decided {
            return Lifecycle::Pending;
        }
        match (&self.desired, &self.held) {
            (None, _) => Lifecycle::Unavailable,
            (Some(t), Some((_, h))) if t == h => Lifecycle::Active,
            _ => Lifecycle::Pending,
        }
    }

    /// The state the machine must show after the same inputs.
    pub fn view(&self) -> MachineView<T> {
        MachineView {
            lifecycle: self.lifecycle(),
            desired: self.desired.clone(),
            targeted: self.decided,
            held: self.held.clone().map(|(b, t)| (BuildId(b), t)),
            in_flight: self.building.clone().map(|(b, t)| (BuildId(b), t)),
            retry_armed: self.retry_after.map(BuildId),
            failures: self.failures,
            shut_down: self.stopped,
            next_build: BuildId(self.last_id + 1),
        }
    }

    fn new_build(&mut self, target: T, out: &mut Vec<Action<T>>) {
        self.last_id += 1;
        self.building = Some((self.last_id, target.clone()));
        out.push(Action::StartBuild {
            build: BuildId(self.last_id),
            target,
        });
    }

    fn cancel_all(&mut self, out: &mut Vec<Action<T>>) {
        if let Some((b, _)) = self.building.take() {
            out.push(Action::CancelBuild { build: BuildId(b) });
        }
        if let Some(a) = self.retry_after.take() {
            out.push(Action::CancelRetry { after: BuildId(a) });
        }
    }

    /// Apply one input; returns the actions the machine must produce for it, in order.
    pub fn step(&mut self, input: &Input<T>) -> Vec<Action<T>> {
        let mut out = Vec::new();
        if self.stopped {
            // After shutdown only a late binding needs an answer: it must be dropped.
            if let Input::BuildSucceeded(b) = input {
                out.push(Action::Discard { build: *b });
            }
            return out;
        }
        match input {
            Input::SetTarget(x) if self.decided && *x == self.desired => {}
            Input::SetTarget(x) => {
                self.cancel_all(&mut out);
                self.failures = 0;
                if let Some(x) = x {
                    let reuse = matches!(&self.held, Some((_, h)) if h == x);
                    if !reuse {
                        if let Some((b, _)) = self.held.take() {
                            out.push(Action::Retire { build: BuildId(b) });
                        }
                        self.new_build(x.clone(), &mut out);
                    }
                }
                self.decided = true;
                self.desired = x.clone();
            }
            Input::BuildSucceeded(BuildId(b)) => match self.building.take() {
                Some((cur, t)) if cur == *b => {
                    out.push(Action::Publish {
                        build: BuildId(*b),
                        target: t.clone(),
                    });
                    self.held = Some((*b, t));
                    self.failures = 0;
                }
                other => {
                    self.building = other;
                    out.push(Action::Discard { build: BuildId(*b) });
                }
            },
            Input::BuildFailed(BuildId(b)) => {
                if matches!(self.building, Some((cur, _)) if cur == *b) {
                    self.building = None;
                    self.failures += 1;
                    self.retry_after = Some(*b);
                    out.push(Action::ScheduleRetry {
                        after: BuildId(*b),
                        delay: documented_delay(self.policy, self.failures),
                        attempt: self.failures,
                    });
                }
            }
            Input::RetryElapsed(BuildId(b)) => {
                if self.retry_after == Some(*b) {
                    self.retry_after = None;
                    // A retry is armed only while a target is desired (retargets cancel it).
                    if let Some(t) = self.desired.clone() {
                        self.new_build(t, &mut out);
                    }
                }
            }
            Input::Shutdown => {
                self.cancel_all(&mut out);
                if let Some((b, _)) = self.held.take() {
                    out.push(Action::Retire { build: BuildId(b) });
                }
                self.decided = true;
                self.desired = None;
                self.failures = 0;
                self.stopped = true;
            }
        }
        out
    }
}
