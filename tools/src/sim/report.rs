//! What a run reports: its statistics, the violations found, and how to reproduce it.

use std::fmt;
use std::time::Duration;

use super::config::{Mutant, SimConfig, TargetSource};
use super::oracle::Violation;
use prefill_router::router::FallbackPolicy;

/// Counts of what happened in a run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SimStats {
    /// Requests started.
    pub requests: u64,
    /// Requests that prefilled on a binding and then completed decode.
    pub prefilled_ok: u64,
    /// Requests that went to decode without prefill (fallback) and completed.
    pub bypassed_ok: u64,
    /// Requests rejected by the fallback policy (`NotActivated`).
    pub rejected: u64,
    /// Requests whose binding had no routable worker (empty admission set, workers down):
    /// they fail fast.
    pub unroutable: u64,
    /// Requests whose prefill failed otherwise (worker crash, rejection, timeout).
    pub prefill_failed: u64,
    /// Requests whose decode failed mid-stream.
    pub decode_failed: u64,
    /// Requests the router handed to a binding's `prefill` (whatever happened next).
    pub prefill_calls: u64,
    /// Requests the router sent to decode without prefill (whatever decode did).
    pub bypass_calls: u64,
    /// Prefill dispatches to a worker.
    pub dispatches: u64,
    /// Clears the controller applied after the cleared generation's admission set had
    /// already emptied (one of the two orders a clear and its admission change may arrive in).
    pub clears_after_admission_emptied: u64,
    /// Clears applied while the cleared generation still admitted workers (the other order).
    pub clears_before_admission_emptied: u64,
    /// `set_target` calls.
    pub retargets: u64,
    /// Builds the factory was asked for.
    pub builds: u64,
    /// Bindings the factory produced.
    pub bindings_built: u64,
    /// Builds that failed on purpose.
    pub builds_failed: u64,
    /// Builds that hang until the router's timeout or cancellation.
    pub builds_hung: u64,
    /// Discovery events lost (healed by the next resync).
    pub events_lost: u64,
    /// Discovery events delivered twice.
    pub events_duplicated: u64,
    /// Worker crashes.
    pub crashes: u64,
    /// Worker blips (connections fail for a while, the registration stays).
    pub blips: u64,
    /// Prefill attempts retried on another worker.
    pub retries: u64,
    /// Requests the conditional policy skipped as short (runs with the policy on).
    pub conditional_short: u64,
    /// Requests the conditional policy skipped as busy.
    pub conditional_busy: u64,
    /// Picks that landed on the worker the session's live entry names (runs with sessions).
    pub affinity_hits: u64,
    /// Picks of a session with no live entry on the binding.
    pub affinity_misses: u64,
    /// Picks whose remembered worker was not routable (or failed by the request): moved.
    pub affinity_repicks: u64,
    /// KV event batches lost (runs with KV events).
    pub kv_batches_lost: u64,
    /// KV event batches delivered late.
    pub kv_batches_delayed: u64,
    /// KV picks whose credit exceeded the cache while a batch of the worker was lost or late
    /// (allowed; shows the oracle's window is exercised).
    pub kv_stale_while_lagging: u64,
    /// Load reports the workers made (runs with several frontends).
    pub load_reports: u64,
    /// Load reports lost (faults on, or the worker down).
    pub load_reports_lost: u64,
    /// Load reports delivered late.
    pub load_reports_late: u64,
    /// Picks whose frontend counted other frontends' work on the picked worker (the reports
    /// are exercised).
    pub picks_with_others: u64,
    /// Picks on an exact view (the newest report made for the connection delivered), where
    /// the bounded no-leak check ran.
    pub picks_on_exact_view: u64,
    /// Frontend views of a worker checked at the quiescent checkpoint.
    pub quiescent_views_checked: u64,
}

/// The outcome of one simulated run.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SimReport {
    /// The run's configuration.
    pub config: SimConfig,
    /// What happened.
    pub stats: SimStats,
    /// Broken properties, in the order found; empty for a passing run.
    pub violations: Vec<Violation>,
    /// Simulated time the run covered.
    pub simulated: Duration,
    /// A hash of the observed history (events and their simulated times). Two runs of one
    /// seed agree on it whenever [`exact_replay`](Self::exact_replay) holds.
    pub digest: u64,
    /// The fallback policy the seed drew for the router.
    pub fallback: FallbackPolicy,
    /// Where the seed's targets came from.
    pub source: TargetSource,
    /// Whether the run ended by shutting the router down with requests in flight and faults
    /// on (instead of stopping the faults and checking convergence).
    pub shutdown_in_flight: bool,
}

impl SimReport {
    /// Whether every oracle held.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// Whether this run replays event for event from its seed. tokio wakes the waiters of
    /// one watch channel in an order drawn from its own RNG, which only `--cfg tokio_unstable`
    /// lets the simulator seed; the router's requests wait on such a channel only under
    /// [`FallbackPolicy::WaitUpTo`]. Without exact replay the seed still fixes every fault
    /// the simulator injects, and a failure usually reproduces; see `docs/simulation.md`.
    pub fn exact_replay(&self) -> bool {
        cfg!(tokio_unstable) || !matches!(self.fallback, FallbackPolicy::WaitUpTo { .. })
    }

    /// Whether some violation of this kind (see [`Violation::kind`]) was found.
    pub fn found(&self, kind: &str) -> bool {
        self.violations.iter().any(|v| v.kind() == kind)
    }

    /// The one-line command that replays this run.
    pub fn repro_command(&self) -> String {
        repro_command(&self.config)
    }
}

/// The one-line command that replays `config`.
pub fn repro_command(config: &SimConfig) -> String {
    let mutant = match config.mutant {
        None => String::new(),
        Some(m) => format!(" --mutant {}", mutant_name(m)),
    };
    let conditional = if config.conditional {
        " --conditional"
    } else {
        ""
    };
    let sessions = if config.sessions { " --sessions" } else { "" };
    let kv = if config.kv_events { " --kv-events" } else { "" };
    let frontends = if config.frontends > 1 {
        format!(" --frontends {}", config.frontends)
    } else {
        String::new()
    };
    format!(
        "cargo run --release -- simulate --seed {} --steps {}{mutant}{conditional}{sessions}{kv}{frontends}",
        config.seed, config.steps
    )
}

/// The command-line name of a mutant.
pub fn mutant_name(mutant: Mutant) -> &'static str {
    match mutant {
        Mutant::IgnoreAdmission => "ignore-admission",
        Mutant::LeakBindings => "leak-bindings",
        Mutant::NoPrefillTimeout => "no-prefill-timeout",
        Mutant::DeferredSetTarget => "deferred-set-target",
        Mutant::BreakerNeverCloses => "breaker-never-closes",
        Mutant::RetryReusesFailedWorker => "retry-reuses-failed-worker",
        Mutant::ConditionalProbeLies => "conditional-probe-lies",
        Mutant::ConditionalPrefillOnProbe => "conditional-prefill-on-probe",
        Mutant::AffinityIgnoresRoutable => "affinity-ignores-routable",
        Mutant::AffinityKeepsLiveEntry => "affinity-keeps-live-entry",
        Mutant::AffinityInheritedByRebuild => "affinity-inherited-by-rebuild",
        Mutant::KvIgnoresRemovals => "kv-ignores-removals",
        Mutant::ReportsOwnWork => "reports-own-work",
        Mutant::LedgerKeepsFailedWork => "ledger-keeps-failed-work",
    }
}

/// The mutant a command-line name denotes.
pub fn parse_mutant(name: &str) -> Option<Mutant> {
    [
        Mutant::IgnoreAdmission,
        Mutant::LeakBindings,
        Mutant::NoPrefillTimeout,
        Mutant::DeferredSetTarget,
        Mutant::BreakerNeverCloses,
        Mutant::RetryReusesFailedWorker,
        Mutant::ConditionalProbeLies,
        Mutant::ConditionalPrefillOnProbe,
        Mutant::AffinityIgnoresRoutable,
        Mutant::AffinityKeepsLiveEntry,
        Mutant::AffinityInheritedByRebuild,
        Mutant::KvIgnoresRemovals,
        Mutant::ReportsOwnWork,
        Mutant::LedgerKeepsFailedWork,
    ]
    .into_iter()
    .find(|m| mutant_name(*m) == name)
}

impl fmt::Display for SimReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.stats;
        writeln!(
            f,
            "seed {} steps {}: {} ({:?} simulated, targets from {:?}, fallback {:?}, {}, digest \
             {:016x}{})",
            self.config.seed,
            self.config.steps,
            if self.passed() { "PASS" } else { "FAIL" },
            self.simulated,
            self.source,
            self.fallback,
            if self.shutdown_in_flight {
                "shutdown in flight"
            } else {
                "converge"
            },
            self.digest,
            if self.exact_replay() {
                ""
            } else {
                ", replay not exact"
            }
        )?;
        writeln!(
            f,
            "  requests {} (prefilled {}, bypassed {}, rejected {}, unroutable {}, prefill failed \
             {}, decode failed {}), dispatches {}",
            s.requests,
            s.prefilled_ok,
            s.bypassed_ok,
            s.rejected,
            s.unroutable,
            s.prefill_failed,
            s.decode_failed,
            s.dispatches
        )?;
        writeln!(
            f,
            "  retargets {} (clears after / before admission emptied {} / {}), builds {} \
             (bindings {}, failed {}, hung {}), crashes {}, blips {}, retries {}, discovery events lost {} duplicated {}",
            s.retargets,
            s.clears_after_admission_emptied,
            s.clears_before_admission_emptied,
            s.builds,
            s.bindings_built,
            s.builds_failed,
            s.builds_hung,
            s.crashes,
            s.blips,
            s.retries,
            s.events_lost,
            s.events_duplicated
        )?;
        if s.affinity_hits + s.affinity_misses + s.affinity_repicks > 0 {
            writeln!(
                f,
                "  session affinity: {} hits, {} misses, {} re-picks",
                s.affinity_hits, s.affinity_misses, s.affinity_repicks
            )?;
        }
        if s.kv_batches_lost + s.kv_batches_delayed + s.kv_stale_while_lagging > 0 {
            writeln!(
                f,
                "  KV events: {} batches lost, {} late, {} picks over-credited while lagging",
                s.kv_batches_lost, s.kv_batches_delayed, s.kv_stale_while_lagging
            )?;
        }
        if s.load_reports > 0 {
            writeln!(
                f,
                "  load reports: {} made, {} lost, {} late; picks counting others {}, on an exact view \
                 {}; views checked at the quiescent checkpoint {}",
                s.load_reports,
                s.load_reports_lost,
                s.load_reports_late,
                s.picks_with_others,
                s.picks_on_exact_view,
                s.quiescent_views_checked
            )?;
        }
        for v in &self.violations {
            writeln!(f, "  VIOLATION [{}] {v}", v.kind())?;
        }
        if !self.passed() {
            writeln!(f, "  reproduce: {}", self.repro_command())?;
        }
        Ok(())
    }
}
