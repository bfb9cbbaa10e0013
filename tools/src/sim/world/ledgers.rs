//! What the world records for each optional feature (conditional disaggregation, session
//! affinity, KV events), as plain data.
//!
//! A leaf: the world holds these ledgers, and the features' oracles (`sim/conditional.rs`,
//! `sim/sessions.rs`, `sim/kv_events.rs`) read and write them through the world. Keeping them
//! apart from the oracles lets the world know what it stores without knowing who judges it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::mock::BlockCache;
use prefill_router::binding::PrefillEstimate;
use prefill_router::discovery::InstanceId;
use prefill_router::kv_events::EventBatch;
use prefill_router::load_report::{Applied, Load, LoadLedger, LoadReport};
use prefill_router::push::{
    AffinityOutcome, AffinityStats, AffinityTable, Dispatcher, WorkerLink,
    DEFAULT_AFFINITY_CAPACITY,
};
use prefill_router::router::{ConditionalPolicy, ConditionalSkip};

/// What the world knows of the run's conditional decisions.
#[derive(Debug, Default)]
pub(crate) struct ConditionalLedger {
    /// The policy the router runs (`None`: off).
    pub(crate) policy: Option<ConditionalPolicy>,
    /// Requests picked and not yet dispatched or decoded: the binding serial and the truth.
    pub(crate) open: BTreeMap<u64, (u64, PrefillEstimate)>,
    /// Requests decode received as skips.
    pub(crate) skipped: BTreeSet<u64>,
    /// Requests prefilled on a pick.
    pub(crate) dispatched: BTreeSet<u64>,
    /// Skips seen at decode, by the reason the truthful probe gives.
    pub(crate) seen: BTreeMap<ConditionalSkip, u64>,
}

/// The mirror of the bindings' affinity tables.
#[derive(Debug, Default)]
pub(crate) struct SessionLedger {
    /// Whether the run gives requests sessions.
    pub(crate) on: bool,
    /// `(binding serial, session)` → the worker its table remembers and when it last used it.
    pub(crate) remembered: BTreeMap<(u64, String), (InstanceId, Instant)>,
    /// The `AffinityInheritedByRebuild` mutant's table, shared by every binding.
    pub(crate) shared: Option<AffinityMirror>,
}

/// A binding dispatcher's affinity table, and its counters as of its latest pick: what one
/// pick counted is the difference (the table's counters move only in picks, and the link
/// reads them in the same poll as each pick, so no other pick comes between).
#[derive(Clone, Debug)]
pub(crate) struct AffinityMirror {
    pub(crate) table: Arc<AffinityTable>,
    seen: Arc<parking_lot::Mutex<AffinityStats>>,
}

impl AffinityMirror {
    /// A fresh table whose entries live `ttl`, nothing counted yet.
    pub(crate) fn fresh(ttl: Duration) -> Self {
        AffinityMirror {
            table: Arc::new(AffinityTable::new(
                ttl,
                DEFAULT_AFFINITY_CAPACITY,
                Arc::default(),
            )),
            seen: Arc::default(),
        }
    }

    /// The outcomes counted since the previous call (on any binding sharing the table).
    pub(crate) fn counted_since_last_pick(&self) -> Vec<AffinityOutcome> {
        let now = self.table.counts().snapshot();
        let before = std::mem::replace(&mut *self.seen.lock(), now);
        outcome_between(before, now)
    }
}

/// The affinity outcome of one pick, from the binding's counters before and after it.
fn outcome_between(before: AffinityStats, after: AffinityStats) -> Vec<AffinityOutcome> {
    let mut outcomes = Vec::new();
    for (outcome, b, a) in [
        (AffinityOutcome::Hit, before.hits, after.hits),
        (AffinityOutcome::Miss, before.misses, after.misses),
        (AffinityOutcome::Repick, before.repicks, after.repicks),
    ] {
        outcomes.extend(std::iter::repeat_n(outcome, a.saturating_sub(b) as usize));
    }
    outcomes
}

/// Why a worker's index entries may lag its cache for now.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Lag {
    /// Batches delayed and not yet delivered.
    pub(crate) delayed: u32,
    /// A batch was lost or arrived late, and no batch has been delivered on time since: an
    /// index may hold a gap it has not seen yet, or have started afresh from the late batch
    /// (a binding built meanwhile), crediting blocks a newer batch removed.
    pub(crate) unsettled: bool,
}

/// A binding's dispatcher as a receiver of KV event batches. A trait object so that the
/// ledger need not name the simulated link the dispatchers send through.
pub(crate) trait KvSubscriber: Send + Sync {
    /// Applies `batch` of `worker` to the dispatcher's index.
    fn apply(&self, worker: InstanceId, batch: &EventBatch);
}

impl<L: WorkerLink> KvSubscriber for Dispatcher<L> {
    fn apply(&self, worker: InstanceId, batch: &EventBatch) {
        self.apply_kv_events(worker, batch);
    }
}

/// The simulated caches, the dispatchers they publish to, and the lag windows.
#[derive(Default)]
pub(crate) struct KvLedger {
    /// Whether the run has KV events.
    pub(crate) on: bool,
    pub(crate) caches: BTreeMap<InstanceId, BlockCache>,
    pub(crate) subscribers: Vec<Weak<dyn KvSubscriber>>,
    pub(crate) lag: BTreeMap<InstanceId, Lag>,
    /// Batches published so far (numbers the fate draws).
    pub(crate) published: u64,
}

/// A frontend's dispatcher as a receiver of load reports, and what its view of a worker's
/// load is. A trait object so that the ledger need not name the simulated link.
pub(crate) trait LoadSubscriber: Send + Sync {
    /// Applies `report` of `worker` (`None`: the dispatcher has no load board).
    fn apply_report(&self, worker: InstanceId, report: LoadReport) -> Option<Applied>;
    /// The others' load the dispatcher counts for `worker` (zero before a first report).
    fn others(&self, worker: InstanceId) -> Load;
    /// The dispatcher's own bookings on `worker`.
    fn booked(&self, worker: InstanceId) -> u64;
    /// The load the dispatcher orders `worker` by: its bookings plus the others'.
    fn combined(&self, worker: InstanceId) -> u64;
}

impl<L: WorkerLink> LoadSubscriber for Dispatcher<L> {
    fn apply_report(&self, worker: InstanceId, report: LoadReport) -> Option<Applied> {
        self.apply_load_report(worker, report)
    }

    fn others(&self, worker: InstanceId) -> Load {
        self.reported_load(worker)
            .map_or(Load::ZERO, |r| r.others())
    }

    fn booked(&self, worker: InstanceId) -> u64 {
        self.booked_work(worker)
    }

    fn combined(&self, worker: InstanceId) -> u64 {
        self.combined_work(worker)
    }
}

/// One connection's report stream from one worker, as the oracles follow it.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ReportStream {
    /// The newest report made (its seq; 0: none).
    pub(crate) made: u64,
    /// The newest report delivered: its seq, and what the other connections and the receiving
    /// one held when it was made.
    pub(crate) delivered: Option<(u64, Load, Load)>,
}

/// The workers' load ledgers, the frontends they report to, and the ghost truth of the work
/// each connection holds at each worker.
#[derive(Default)]
pub(crate) struct ReportLedger {
    /// Frontends per binding (1: the mode is off).
    pub(crate) frontends: u32,
    /// Each worker's real ledger.
    pub(crate) ledgers: BTreeMap<InstanceId, LoadLedger>,
    /// Ghost truth: worker → connection → attempt key → tokens, kept beside the ledger by the
    /// simulator's own records of the attempts a worker holds.
    pub(crate) held: BTreeMap<InstanceId, BTreeMap<u64, BTreeMap<u64, u64>>>,
    /// Open connections: their frontend's dispatcher.
    pub(crate) conns: BTreeMap<u64, Weak<dyn LoadSubscriber>>,
    /// `(connection, worker)` → its report stream.
    pub(crate) streams: BTreeMap<(u64, InstanceId), ReportStream>,
    pub(crate) next_conn: u64,
    /// Reports made so far (numbers the fate draws).
    pub(crate) published: u64,
    /// The quiescent checkpoint: reports are delivered on time, whatever the faults.
    pub(crate) quiet: bool,
    /// Checks already reported (one violation of each per run is enough).
    pub(crate) flagged: BTreeSet<&'static str>,
}

impl ReportLedger {
    /// What the connections other than `conn` hold at `worker`, and what `conn` holds.
    pub(crate) fn truth(&self, worker: InstanceId, conn: u64) -> (Load, Load) {
        let mut others = Load::ZERO;
        let mut own = Load::ZERO;
        for (c, work) in self.held.get(&worker).into_iter().flatten() {
            let into = if *c == conn { &mut own } else { &mut others };
            for tokens in work.values() {
                into.tokens += tokens;
                into.requests += 1;
            }
        }
        (others, own)
    }
}
