//! What a request does when the hop is not Active.
//!
//! Upstream bypasses silently to decode; its users asked for strictness (Dynamo PRs 4286,
//! 6957, 7379: a decode worker that requires disaggregated parameters crashes on a bypassed
//! request). The policy is the caller's choice; every bypass and rejection is counted by
//! reason either way.

use std::time::Duration;

use crate::snapshot::BypassReason;

/// The policy for requests arriving while the hop is not Active.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FallbackPolicy {
    /// Send the request to decode directly (aggregated), as upstream does.
    #[default]
    Decode,
    /// Fail the request with [`GenerateError::NotActivated`](super::GenerateError::NotActivated);
    /// nothing is sent anywhere.
    Reject,
    /// Wait for the hop to become Active for at most `timeout`, then prefill; at the deadline
    /// do what `then` says.
    WaitUpTo {
        /// The longest a request waits.
        timeout: Duration,
        /// What to do if the hop is still not Active at the deadline.
        then: AfterWait,
    },
}

/// What a [`FallbackPolicy::WaitUpTo`] request does at its deadline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AfterWait {
    /// Bypass to decode.
    #[default]
    Decode,
    /// Fail with `NotActivated`.
    Reject,
}

/// The decision for one request that found the hop not Active.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fallback {
    /// Decided now.
    Now(Final),
    /// Wait (at most this long) for Active; if it does not come, `then`.
    Wait(Duration, AfterWait),
}

/// What a request that will not prefill does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Final {
    /// Go to decode directly.
    Bypass(BypassReason),
    /// Fail the request.
    Reject(BypassReason),
}

impl FallbackPolicy {
    /// What a request that found the hop bypassing for `reason` does.
    pub(crate) fn decide(self, reason: BypassReason) -> Fallback {
        match self {
            // After shutdown nothing will ever become Active: waiting would only add latency.
            FallbackPolicy::WaitUpTo { then, .. } if reason == BypassReason::ShutDown => {
                Fallback::Now(then.apply(reason))
            }
            FallbackPolicy::Decode => Fallback::Now(Final::Bypass(reason)),
            FallbackPolicy::Reject => Fallback::Now(Final::Reject(reason)),
            FallbackPolicy::WaitUpTo { timeout, then } => Fallback::Wait(timeout, then),
        }
    }
}

impl AfterWait {
    /// The decision at the deadline of a wait.
    pub(crate) fn apply(self, reason: BypassReason) -> Final {
        match self {
            AfterWait::Decode => Final::Bypass(reason),
            AfterWait::Reject => Final::Reject(reason),
        }
    }
}
