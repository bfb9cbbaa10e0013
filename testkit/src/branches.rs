//! Which branches of `Machine::handle` a step took, judged from the state before the step and
//! the input (not from the machine's code), to measure what a corpus exercises.
//!
//! One branch of `Machine::handle` is deliberately absent: a retry firing while no target is
//! desired. It is unreachable, because every retarget and the shutdown disarm the retry.

use std::fmt;

use crate::reference::MachineView;
use prefill_router::lifecycle::{Action, Input, RetryPolicy};

/// A branch of the machine's transition function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Branch {
    /// After shutdown: a late success, whose binding is discarded.
    ShutDownLateSuccessDiscarded,
    /// After shutdown: any other input, ignored.
    ShutDownInputIgnored,
    /// Rule 1: the same decision again.
    SetTargetUnchanged,
    /// Rule 2: no target (the held binding is kept for reuse).
    SetTargetNone,
    /// Rule 3: the held binding serves the new target.
    SetTargetReusesHeld,
    /// Rule 4: a build starts for the new target.
    SetTargetStartsBuild,
    /// Rule 4 with a binding held for another target: it is retired.
    RetargetRetiresHeld,
    /// A retarget or shutdown cancels the build in flight.
    CancelsBuildInFlight,
    /// A retarget or shutdown disarms the retry timer.
    CancelsArmedRetry,
    /// The build in flight succeeded: published.
    SuccessPublished,
    /// Another build succeeded while one is in flight: discarded.
    SuccessStaleWhileBuilding,
    /// A build succeeded while none is in flight: discarded.
    SuccessStaleIdle,
    /// The build in flight failed: a retry is scheduled.
    FailureSchedulesRetry,
    /// A failure of a build not in flight: ignored.
    FailureIgnored,
    /// A scheduled retry's delay is below the policy's cap.
    BackoffBelowCap,
    /// A scheduled retry's delay is the policy's cap.
    BackoffCapped,
    /// The armed retry fired: the target is rebuilt.
    RetryRebuilds,
    /// A retry firing that is not the armed one: ignored.
    RetryIgnored,
    /// Shutdown with a binding held: retired.
    ShutdownRetiresHeld,
    /// Shutdown with nothing held.
    ShutdownNothingHeld,
}

impl Branch {
    /// Every reachable branch.
    pub const ALL: [Branch; 20] = [
        Branch::ShutDownLateSuccessDiscarded,
        Branch::ShutDownInputIgnored,
        Branch::SetTargetUnchanged,
        Branch::SetTargetNone,
        Branch::SetTargetReusesHeld,
        Branch::SetTargetStartsBuild,
        Branch::RetargetRetiresHeld,
        Branch::CancelsBuildInFlight,
        Branch::CancelsArmedRetry,
        Branch::SuccessPublished,
        Branch::SuccessStaleWhileBuilding,
        Branch::SuccessStaleIdle,
        Branch::FailureSchedulesRetry,
        Branch::FailureIgnored,
        Branch::BackoffBelowCap,
        Branch::BackoffCapped,
        Branch::RetryRebuilds,
        Branch::RetryIgnored,
        Branch::ShutdownRetiresHeld,
        Branch::ShutdownNothingHeld,
    ];

    /// The branches a step from state `before` on `input` takes (`actions` give the delay).
    pub fn classify<T: Clone + Eq + fmt::Debug>(
        before: &MachineView<T>,
        input: &Input<T>,
        actions: &[Action<T>],
        policy: RetryPolicy,
    ) -> Vec<Branch> {
        let mut out = Vec::new();
        let cancels = |out: &mut Vec<Branch>| {
            if before.in_flight.is_some() {
                out.push(Branch::CancelsBuildInFlight);
            }
            if before.retry_armed.is_some() {
                out.push(Branch::CancelsArmedRetry);
            }
        };
        let in_flight = before.in_flight.as_ref().map(|(b, _)| *b);
        if before.shut_down {
            out.push(match input {
                Input::BuildSucceeded(_) => Branch::ShutDownLateSuccessDiscarded,
                _ => Branch::ShutDownInputIgnored,
            });
            return out;
        }
        match input {
            Input::SetTarget(x) if before.targeted && *x == before.desired => {
                out.push(Branch::SetTargetUnchanged);
            }
            Input::SetTarget(x) => {
                cancels(&mut out);
                match x {
                    None => out.push(Branch::SetTargetNone),
                    Some(t) if before.held.as_ref().is_some_and(|(_, h)| h == t) => {
                        out.push(Branch::SetTargetReusesHeld);
                    }
                    Some(_) => {
                        out.push(Branch::SetTargetStartsBuild);
                        if before.held.is_some() {
                            out.push(Branch::RetargetRetiresHeld);
                        }
                    }
                }
            }
            Input::BuildSucceeded(b) => out.push(match in_flight {
                Some(current) if current == *b => Branch::SuccessPublished,
                Some(_) => Branch::SuccessStaleWhileBuilding,
                None => Branch::SuccessStaleIdle,
            }),
            Input::BuildFailed(b) if in_flight == Some(*b) => {
                out.push(Branch::FailureSchedulesRetry);
                for action in actions {
                    if let Action::ScheduleRetry { delay, .. } = action {
                        out.push(if *delay == policy.max {
                            Branch::BackoffCapped
                        } else {
                            Branch::BackoffBelowCap
                        });
                    }
                }
            }
            Input::BuildFailed(_) => out.push(Branch::FailureIgnored),
            Input::RetryElapsed(b) if before.retry_armed == Some(*b) => {
                out.push(Branch::RetryRebuilds);
            }
            Input::RetryElapsed(_) => out.push(Branch::RetryIgnored),
            Input::Shutdown => {
                cancels(&mut out);
                out.push(if before.held.is_some() {
                    Branch::ShutdownRetiresHeld
                } else {
                    Branch::ShutdownNothingHeld
                });
            }
        }
        out
    }
}

/// How often each branch was taken.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BranchSet {
    hits: [u64; Branch::ALL.len()],
}

impl BranchSet {
    /// Count one step's branches.
    pub fn record_all(&mut self, branches: impl IntoIterator<Item = Branch>) {
        for branch in branches {
            self.hits[branch as usize] += 1;
        }
    }

    /// How often `branch` was taken.
    pub fn hits(&self, branch: Branch) -> u64 {
        self.hits[branch as usize]
    }

    /// The branches never taken.
    pub fn missed(&self) -> Vec<Branch> {
        Branch::ALL
            .into_iter()
            .filter(|b| self.hits(*b) == 0)
            .collect()
    }
}
