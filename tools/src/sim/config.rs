//! What one simulated run is: its seed, its length, and (for the oracle tests) a deliberate
//! defect.

use std::time::Duration;

/// Most frontends per binding (see [`sim::frontends`](super::frontends)).
pub const MAX_FRONTENDS: u32 = 4;

/// One simulated run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Everything random in the run derives from this seed.
    pub seed: u64,
    /// Scenario steps before the faults stop (each step is one world event: a request burst,
    /// a retarget, an admission change, a crash, a pause...).
    pub steps: u32,
    /// A deliberately broken part, to show the oracles catch it. `None` for real runs.
    pub mutant: Option<Mutant>,
    /// Run the router with the conditional disaggregation policy
    /// [`sim::conditional::POLICY`](super::conditional::POLICY) (off by default; the
    /// conditional mutants turn it on).
    pub conditional: bool,
    /// Give requests session keys and the bindings session affinity with
    /// [`sim::sessions::TTL`](super::sessions::TTL), under the affinity oracles (off by
    /// default; the affinity mutants turn it on).
    pub sessions: bool,
    /// Run the bindings in KV mode with workers that publish KV cache events, some batches
    /// lost or delayed, under the stale-credit oracle (off by default; the KV mutant turns it
    /// on). See [`sim::kv_events`](super::kv_events).
    pub kv_events: bool,
    /// Independent frontends (dispatchers with their own bookings) per binding, sharing the
    /// simulated workers, which keep a real load ledger and publish load reports, some lost
    /// or late, under the no-leak and no-double-count oracles (1, the default: one frontend,
    /// no load reports). See [`sim::frontends`](super::frontends).
    pub frontends: u32,
}

impl SimConfig {
    /// A run of `steps` steps from `seed`, without mutant.
    pub fn new(seed: u64, steps: u32) -> Self {
        SimConfig {
            seed,
            steps,
            mutant: None,
            conditional: false,
            sessions: false,
            kv_events: false,
            frontends: 1,
        }
    }

    /// The same run with `n` frontends per binding sharing the workers, which publish load
    /// reports (`n` is clamped to `1..=`[`MAX_FRONTENDS`];
    /// 1 turns the mode off). Session affinity mirrors one table per binding, so a run with
    /// sessions keeps one frontend.
    pub fn with_frontends(mut self, n: u32) -> Self {
        self.frontends = n.clamp(1, MAX_FRONTENDS);
        self
    }

    /// Frontends per binding in this run: as asked (a load-report mutant asks for at least
    /// two), one with sessions.
    pub(crate) fn frontends_on(&self) -> u32 {
        let asked = match self.mutant {
            Some(Mutant::ReportsOwnWork | Mutant::LedgerKeepsFailedWork) => self.frontends.max(2),
            _ => self.frontends,
        };
        if self.sessions_on() {
            1
        } else {
            asked.clamp(1, MAX_FRONTENDS)
        }
    }

    /// The same run with KV events (and KV routing) on.
    pub fn with_kv_events(mut self) -> Self {
        self.kv_events = true;
        self
    }

    /// Whether the run has KV events (asked for, or the KV mutant).
    pub(crate) fn kv_events_on(&self) -> bool {
        self.kv_events || self.mutant == Some(Mutant::KvIgnoresRemovals)
    }

    /// The same run with sessions and session affinity on.
    pub fn with_sessions(mut self) -> Self {
        self.sessions = true;
        self
    }

    /// Whether requests carry sessions (asked for, or an affinity mutant).
    pub(crate) fn sessions_on(&self) -> bool {
        self.sessions
            || matches!(
                self.mutant,
                Some(
                    Mutant::AffinityIgnoresRoutable
                        | Mutant::AffinityKeepsLiveEntry
                        | Mutant::AffinityInheritedByRebuild
                )
            )
    }

    /// The same run with the conditional disaggregation policy on.
    pub fn with_conditional(mut self) -> Self {
        self.conditional = true;
        self
    }

    /// Whether the router runs the conditional policy (asked for, or a conditional mutant).
    pub(crate) fn conditional_on(&self) -> bool {
        self.conditional
            || matches!(
                self.mutant,
                Some(Mutant::ConditionalProbeLies | Mutant::ConditionalPrefillOnProbe)
            )
    }

    /// The same run with `mutant` planted.
    pub fn with_mutant(mut self, mutant: Mutant) -> Self {
        self.mutant = Some(mutant);
        self
    }
}

/// Where a run's prefill targets come from (drawn from the seed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TargetSource {
    /// A seeded controller hears topology changes through a faulty feed and calls
    /// `set_target` itself: retarget bursts, returns to old generations, admission sets
    /// emptied before or after the clear.
    Controller,
    /// Workers register in the in-memory discovery store and the real topology watcher
    /// derives the target from a faulty namespace watch (first-wins admission, generations).
    Watcher,
}

/// A deliberate defect in the simulated parts, each one an oracle must flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Mutant {
    /// Bindings build their routable view without the target's admission set, so they may
    /// dispatch to discovered but unadmitted workers (oracle: dispatch outside admission).
    IgnoreAdmission,
    /// The factory keeps a reference to every binding it builds (oracle: retired binding not
    /// released).
    LeakBindings,
    /// The in-memory transport forgets its request deadline, so a hung worker hangs the request
    /// (oracle: request past its deadline).
    NoPrefillTimeout,
    /// The controller's decision reaches the router a millisecond after `set_target` has
    /// returned, as with a router whose retarget is asynchronous (oracle: dispatch on a
    /// replaced target).
    DeferredSetTarget,
    /// Every probe reads as failed, so a breaker never closes again (oracle: a recovered
    /// worker stays unroutable).
    BreakerNeverCloses,
    /// A prefill retry goes back to the worker that just failed instead of another one
    /// (oracle: a request failed while a healthy admitted worker was available).
    RetryReusesFailedWorker,
    /// Bindings report every probe with an empty prompt, so every request looks short
    /// (oracle: a skip without its condition).
    ConditionalProbeLies,
    /// A binding's pick already starts the remote prefill, as a probe that dispatches would
    /// (oracle: a request both prefilled remotely and skipped).
    ConditionalPrefillOnProbe,
    /// A session goes to its remembered worker while the entry lives, whether or not that
    /// worker is still routable (oracle: an affinity hit outside the routable set).
    AffinityIgnoresRoutable,
    /// A session stays on its live entry's worker while that worker is usable, even when it
    /// is no longer first in the session's rendezvous order: the per-frontend stickiness that
    /// rendezvous affinity replaced (oracle: a pick off the rendezvous order).
    AffinityKeepsLiveEntry,
    /// Every binding shares the first binding's affinity table, so a rebuilt binding inherits
    /// the old sessions (oracle: affinity survived a rebuild).
    AffinityInheritedByRebuild,
    /// Workers publish their KV event batches without the removals, so evicted blocks stay
    /// credited (oracle: stale credit with no batch lost or late).
    KvIgnoresRemovals,
    /// Workers report their ledger's total load to every frontend, the receiving connection's
    /// own work included, instead of `LoadLedger::report_for` (oracle: a frontend's view
    /// counts its own work twice).
    ReportsOwnWork,
    /// A worker never finishes in its load ledger the work of an attempt that failed or was
    /// cancelled (only answered ones end there), so it stays reported to the other frontends
    /// (oracle: load leaked).
    LedgerKeepsFailedWork,
}

/// Time constants of the simulated world (all simulated time: the clock is paused and jumps).
pub(crate) mod timing {
    use super::Duration;

    /// Builds that hang are cut off by the router after this long.
    pub const BUILD_TIMEOUT: Duration = Duration::from_millis(100);
    /// First retry delay after a failed build.
    pub const RETRY_INITIAL: Duration = Duration::from_millis(20);
    /// Retry delay cap.
    pub const RETRY_MAX: Duration = Duration::from_millis(200);
    /// The bindings' health backoff (the real default caps at 10 s, past a whole run).
    pub const HEALTH: prefill_router::health::BackoffPolicy =
        prefill_router::health::BackoffPolicy {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(200),
        };
    /// Slack on top of the probe cap before a recovered worker must be routable (probes are
    /// instant; a failure reported in the same instant the worker came back re-arms once).
    pub const HEALTH_SLACK: Duration = Duration::from_millis(20);
    /// Retries of a prefill on another worker (the dispatcher's default budget).
    pub const RETRY_BUDGET: u32 = 2;
    /// The in-memory transport's prefill deadline (a hung worker answers with a timeout).
    pub const PREFILL_TIMEOUT: Duration = Duration::from_millis(60);
    /// Longest healthy prefill.
    pub const PREFILL_MAX_MS: u64 = 40;
    /// Longest gap between two decode tokens.
    pub const TOKEN_MAX_MS: u64 = 3;
    /// Most tokens a simulated request asks for.
    pub const MAX_TOKENS: u32 = 6;
    /// Longest a `WaitUpTo` fallback may wait.
    pub const WAIT_MAX_MS: u64 = 80;
    /// Slack on top of the worst-case request time before a request counts as hung.
    pub const DEADLINE_SLACK: Duration = Duration::from_millis(20);
    /// Longest discovery delivery delay while faults are on.
    pub const FEED_DELAY_MAX_MS: u64 = 30;
    /// Period of the discovery resync that heals lost events.
    pub const RESYNC_PERIOD: Duration = Duration::from_millis(150);
    /// How long after the faults stop the router must have converged.
    pub const CONVERGE_WITHIN: Duration = Duration::from_secs(2);
}
