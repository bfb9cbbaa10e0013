//! What the router reports about itself: [`RouterStatus`] and its counters.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use super::conditional::ConditionalSkip;
use crate::binding::{BindingHealth, WorkerSetTargetId};
use crate::lifecycle::{BuildId, Lifecycle};
use crate::snapshot::BypassReason;

/// Every bypass reason, in a fixed order (indexes of the per-reason counters).
pub(crate) const REASONS: [BypassReason; 5] = [
    BypassReason::NotYetTargeted,
    BypassReason::Building,
    BypassReason::RetryingAfterFailure,
    BypassReason::NoTarget,
    BypassReason::ShutDown,
];

fn reason_index(reason: BypassReason) -> usize {
    match reason {
        BypassReason::NotYetTargeted => 0,
        BypassReason::Building => 1,
        BypassReason::RetryingAfterFailure => 2,
        BypassReason::NoTarget => 3,
        BypassReason::ShutDown => 4,
    }
}

/// Counters since the router was created.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RouterCounters {
    /// Builds started.
    pub builds_started: u64,
    /// Bindings published (activations).
    pub activations: u64,
    /// Builds that failed, timeouts included.
    pub build_failures: u64,
    /// Builds that hit the build timeout.
    pub build_timeouts: u64,
    /// Bindings from stale builds dropped unpublished.
    pub stale_builds_discarded: u64,
    /// Held bindings retired.
    pub retired: u64,
    /// Retired bindings still alive (held by in-flight requests).
    pub retired_alive: usize,
    /// Requests that prefilled on a binding (whatever the prefill's result).
    pub prefilled: u64,
    /// Prefills that failed (each failed its request).
    pub prefill_errors: u64,
    /// Requests sent to decode without prefill, by the reason the hop was not Active.
    pub bypassed: BTreeMap<BypassReason, u64>,
    /// Requests the conditional policy sent to decode whole although the hop was Active, by
    /// reason (see [`conditional`](super::conditional); in the `bypassed_total` metric under
    /// the labels `conditional_short` and `conditional_busy`).
    pub conditional_skips: BTreeMap<ConditionalSkip, u64>,
    /// Requests rejected with `NotActivated`, by reason.
    pub rejected: BTreeMap<BypassReason, u64>,
    /// Requests that waited for activation (policy `WaitUpTo`).
    pub waited: u64,
    /// Prefills cut off by the drain cap after their binding was retired.
    pub drained: u64,
    /// Requests routed again because their binding was retired, and its admission emptied,
    /// before they could pick a worker (see [`PrefillRouter::generate`](super::PrefillRouter::generate)).
    pub rerouted: u64,
    /// Requests whose prefill found no reachable worker (none routable, or every attempt
    /// failed to reach its worker) and that the fallback policy sent to decode whole.
    pub unreachable_bypassed: u64,
    /// How the single-use prefill handoffs ended (docs/engines.md, "The handoff rules").
    pub handoffs: super::HandoffCounts,
}

/// A picture of the router, for status pages and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RouterStatus {
    /// The router's configured name.
    pub name: String,
    /// The published lifecycle.
    pub lifecycle: Lifecycle,
    /// Whether the controller has called `set_target` yet.
    pub targeted: bool,
    /// The target the controller asked for.
    pub desired: Option<WorkerSetTargetId>,
    /// The target of the held binding (serving when Active, kept for reuse otherwise).
    pub held: Option<WorkerSetTargetId>,
    /// The build under way and its target.
    pub build_in_flight: Option<(BuildId, WorkerSetTargetId)>,
    /// Whether a retry timer is armed.
    pub retry_armed: bool,
    /// Consecutive failed builds for the desired target.
    pub consecutive_failures: u32,
    /// The last accepted build failure's text; cleared by the next activation.
    pub last_error: Option<String>,
    /// Whether the router was shut down.
    pub shut_down: bool,
    /// Publication counter of the route cell.
    pub epoch: u64,
    /// Counters since creation.
    pub counters: RouterCounters,
    /// The health of the workers of the binding serving now ([`Binding::health`](crate::binding::Binding::health));
    /// empty while the hop is not Active.
    pub health: BindingHealth,
}

/// Lock-free counters kept by the driver and the request path.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) builds_started: AtomicU64,
    pub(crate) build_failures: AtomicU64,
    pub(crate) build_timeouts: AtomicU64,
    pub(crate) prefilled: AtomicU64,
    pub(crate) prefill_errors: AtomicU64,
    pub(crate) waited: AtomicU64,
    pub(crate) drained: AtomicU64,
    pub(crate) rerouted: AtomicU64,
    pub(crate) unreachable_bypassed: AtomicU64,
    pub(crate) handoffs: super::handoffs::HandoffTally,
    bypassed: [AtomicU64; 5],
    rejected: [AtomicU64; 5],
    skipped: [AtomicU64; 2],
}

pub(crate) fn bump(counter: &AtomicU64) {
    // Relaxed: counters are independent statistics; nothing is ordered by them.
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Tally {
    pub(crate) fn bypass(&self, reason: BypassReason) {
        bump(&self.bypassed[reason_index(reason)]);
    }

    pub(crate) fn skip(&self, skip: ConditionalSkip) {
        bump(&self.skipped[skip as usize]);
    }

    pub(crate) fn reject(&self, reason: BypassReason) {
        bump(&self.rejected[reason_index(reason)]);
    }

    /// Copy the request/driver counters into `out` (the control core's are filled by the caller).
    pub(crate) fn fill(&self, out: &mut RouterCounters) {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        out.builds_started = get(&self.builds_started);
        out.build_failures = get(&self.build_failures);
        out.build_timeouts = get(&self.build_timeouts);
        out.prefilled = get(&self.prefilled);
        out.prefill_errors = get(&self.prefill_errors);
        out.waited = get(&self.waited);
        out.drained = get(&self.drained);
        out.rerouted = get(&self.rerouted);
        out.unreachable_bypassed = get(&self.unreachable_bypassed);
        out.handoffs = self.handoffs.snapshot();
        out.bypassed = REASONS
            .iter()
            .map(|r| (*r, get(&self.bypassed[reason_index(*r)])))
            .collect();
        out.conditional_skips = ConditionalSkip::ALL
            .iter()
            .map(|s| (*s, get(&self.skipped[*s as usize])))
            .collect();
        out.rejected = REASONS
            .iter()
            .map(|r| (*r, get(&self.rejected[reason_index(*r)])))
            .collect();
    }
}
