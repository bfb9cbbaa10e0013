//! The dispatcher's side of the workers' KV event streams: each worker connection's batches, decoded
//! by the transport, reach the binding's [`KvSelector`] here, and the end of a connection drops
//! the worker's entries (no stale credit across a reconnect).
//!
//! Snapshots: every connection's sink asks for them (`transport/feed.rs` sends the requests
//! and reassembles the chunks); a complete one replaces the worker's entries, counted in
//! [`KvEventCounts`].
//!
//! A connection's sink carries a generation: only the worker's current connection (the one the
//! dispatcher pooled) may apply batches or, by closing, reset the worker. A connection that
//! lost a connect race, or an old one whose close arrives late, changes nothing.
//!
//! The same connections carry the workers' load reports ([`crate::load_report`]): the current
//! connection's newest report sets the worker's reported others on the dispatcher's
//! [`LoadBoard`] ([`LoadBoard::set_others`]), and a new, closed or forgotten connection sets
//! them back to zero (the next connection's reports start afresh, and a worker whose reports
//! stopped is counted by the dispatcher's own bookings only).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::kv::KvSelector;
use super::load_board::LoadBoard;
use super::mutant::DispatchMutant;
use super::view::{InstanceStatus, RoutableView};
use crate::discovery::InstanceId;
use crate::hooks::Seam;
use crate::kv_events::{Applied, EventBatch, KvSnapshot, SnapshotError};
use crate::load_report::{self, Load, LoadReport, LoadReportError, ReportedLoad};
use crate::transport::{KvEventSink, KvStreamError};

/// The reported others of an engine whose load is stale: more than any real queue, so it is
/// the last choice while another worker remains (stale means saturated: protocols.md).
#[cfg(feature = "engine")]
const SATURATED_UNITS: u64 = 1 << 40;

/// KV-mode picks by what the index credited the picked worker with: some leading blocks of
/// the prompt, or none. A pool whose picks all find zero overlap is not KV routing but load
/// balancing (a block size or tokenizer that differs from the engines', events that stopped):
/// the ratio says so. Lock-free; shared by every binding of one factory.
#[derive(Debug, Default)]
pub struct KvDecisionCounts {
    overlap: AtomicU64,
    zero_overlap: AtomicU64,
}

impl KvDecisionCounts {
    /// Count one pick that credited `overlap` blocks.
    pub fn record(&self, overlap: usize) {
        let counter = if overlap > 0 {
            &self.overlap
        } else {
            &self.zero_overlap
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Picks whose worker was credited with at least one block of the prompt.
    pub fn with_overlap(&self) -> u64 {
        self.overlap.load(Ordering::Relaxed)
    }

    /// Picks whose worker was credited with none.
    pub fn zero_overlap(&self) -> u64 {
        self.zero_overlap.load(Ordering::Relaxed)
    }
}

/// What the workers' KV event streams delivered to one dispatcher (relaxed counters: read them
/// in tests and metrics, not for synchronisation).
#[derive(Debug, Default)]
pub struct KvEventCounts {
    applied: AtomicU64,
    gaps: AtomicU64,
    stale: AtomicU64,
    refused: AtomicU64,
    lagged: AtomicU64,
    resets: AtomicU64,
    snapshots_requested: AtomicU64,
    snapshots_applied: AtomicU64,
    snapshots_failed: AtomicU64,
    reports_applied: AtomicU64,
    reports_stale: AtomicU64,
    reports_refused: AtomicU64,
}

impl KvEventCounts {
    /// Batches applied in order or starting a worker afresh.
    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::Relaxed)
    }

    /// Batches after a sequence gap (the worker's entries were dropped, then the batch applied).
    pub fn gaps(&self) -> u64 {
        self.gaps.load(Ordering::Relaxed)
    }

    /// Duplicate, late or older-epoch batches, and batches of a connection that is no longer
    /// the worker's current one: ignored.
    pub fn stale(&self) -> u64 {
        self.stale.load(Ordering::Relaxed)
    }

    /// Batches refused as oversize or undecodable ([`KvStreamError::Oversize`],
    /// [`KvStreamError::Malformed`]).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Batches dropped because the dispatcher fell behind ([`KvStreamError::Lagged`]).
    pub fn lagged(&self) -> u64 {
        self.lagged.load(Ordering::Relaxed)
    }

    /// Times a worker's entries were dropped for its stream: a refused or lagged batch, a
    /// closed or replaced connection, a batch from a worker outside admission.
    pub fn resets(&self) -> u64 {
        self.resets.load(Ordering::Relaxed)
    }

    /// Snapshots of a worker's cache asked for (on subscribe, after a lost batch; at most
    /// one per connection per [`KV_SNAPSHOT_RETRY`](crate::transport::KV_SNAPSHOT_RETRY)).
    pub fn snapshots_requested(&self) -> u64 {
        self.snapshots_requested.load(Ordering::Relaxed)
    }

    /// Snapshots that replaced a worker's entries.
    pub fn snapshots_applied(&self) -> u64 {
        self.snapshots_applied.load(Ordering::Relaxed)
    }

    /// Snapshots asked for that did not replace the worker's entries: not supported by the
    /// worker, a bad chunk, a batch lost while streaming, a timeout, or a worker outside
    /// admission, of an older epoch or past the block limit.
    pub fn snapshots_failed(&self) -> u64 {
        self.snapshots_failed.load(Ordering::Relaxed)
    }

    /// Load reports applied (newer than the worker connection's last one; a report that a
    /// connection sent before the dispatcher pooled it is kept and applied at the pooling).
    pub fn reports_applied(&self) -> u64 {
        self.reports_applied.load(Ordering::Relaxed)
    }

    /// Load reports ignored: not newer than the last applied, or from a connection that is no
    /// longer the worker's current one.
    pub fn reports_stale(&self) -> u64 {
        self.reports_stale.load(Ordering::Relaxed)
    }

    /// Load reports refused as undecodable (counted and ignored; the connection stays).
    pub fn reports_refused(&self) -> u64 {
        self.reports_refused.load(Ordering::Relaxed)
    }

    fn bump(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// The dispatcher's side of every worker connection's event stream.
pub(crate) struct KvFeed {
    kv: Arc<Mutex<KvSelector>>,
    view: RoutableView,
    /// The dispatcher's mutant (`KeepKvOnReconnect` acts here).
    mutant: Seam<DispatchMutant>,
    counts: Arc<KvEventCounts>,
    /// Worker → its pooled connection (at most one entry per pooled worker). Load reports are
    /// checked and applied under this lock, so a report of a replaced connection can never
    /// land after its successor's reset.
    current: Mutex<HashMap<InstanceId, Current>>,
    /// Generation → the newest report of a connection not pooled yet (at most one entry per
    /// connection being opened; taken by `adopt`, dropped by its close). Locked after
    /// `current`.
    pending: Mutex<HashMap<u64, ReportedLoad>>,
    next_generation: AtomicU64,
    /// The dispatcher's load board, where reported others are set.
    board: Arc<Mutex<LoadBoard>>,
    /// Wakes the requests waiting for room (a report lowered a worker's load).
    wake: Box<dyn Fn() + Send + Sync>,
}

/// A worker's pooled connection: its generation and the newest load report applied from it.
#[derive(Clone, Copy, Debug)]
struct Current {
    generation: u64,
    reported: ReportedLoad,
}

impl KvFeed {
    pub(super) fn new(
        kv: Arc<Mutex<KvSelector>>,
        view: RoutableView,
        mutant: Seam<DispatchMutant>,
        (board, wake): (Arc<Mutex<LoadBoard>>, Box<dyn Fn() + Send + Sync>),
    ) -> Self {
        KvFeed {
            kv,
            view,
            mutant,
            counts: Arc::default(),
            current: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            next_generation: AtomicU64::new(1),
            board,
            wake,
        }
    }

    /// Reports kept aside for connections not pooled yet.
    #[cfg(test)]
    pub(super) fn pending_len(&self) -> usize {
        self.pending.lock().len()
    }

    /// What `worker`'s current connection last reported (`None`: no pooled connection).
    pub(super) fn reported(&self, worker: InstanceId) -> Option<ReportedLoad> {
        self.current.lock().get(&worker).map(|c| c.reported)
    }

    /// `load` in the unit of this dispatcher's bookings: uncached tokens plus the fixed cost of
    /// each request (the selector's request overhead), as its own picks book.
    fn booking_units(&self, load: Load) -> u64 {
        let overhead = self.kv.lock().cost().request_overhead;
        load.tokens
            .saturating_add(overhead.saturating_mul(load.requests))
    }

    /// Apply a load report of `worker`'s connection `generation`. A connection not yet pooled
    /// keeps its newest report aside (a worker reports as soon as the subscription arrives,
    /// before the dispatcher adopts the connection); a replaced one's is stale.
    fn load_report(&self, worker: InstanceId, generation: u64, report: LoadReport) {
        let units = self.booking_units(report.others);
        let mut current = self.current.lock();
        let applied = match current.get_mut(&worker) {
            Some(c) if c.generation == generation => {
                let applied = c.reported.apply(report);
                if applied == load_report::Applied::Newer {
                    self.set_reported(worker, units);
                }
                applied
            }
            Some(c) if c.generation > generation => load_report::Applied::Stale,
            _ => self
                .pending
                .lock()
                .entry(generation)
                .or_default()
                .apply(report),
        };
        drop(current);
        let counter = match applied {
            load_report::Applied::Newer => &self.counts.reports_applied,
            load_report::Applied::Stale => &self.counts.reports_stale,
        };
        KvEventCounts::bump(counter, 1);
    }

    /// Apply `report` of `worker` delivered without a connection (an in-process link, as the
    /// replay's): the worker's one report stream, newest wins, no generation to check.
    pub(super) fn load_report_direct(
        &self,
        worker: InstanceId,
        report: LoadReport,
    ) -> load_report::Applied {
        let units = self.booking_units(report.others);
        let mut current = self.current.lock();
        let entry = current.entry(worker).or_insert(Current {
            generation: 0,
            reported: ReportedLoad::new(),
        });
        let applied = entry.reported.apply(report);
        if applied == load_report::Applied::Newer {
            self.set_reported(worker, units);
        }
        drop(current);
        let counter = match applied {
            load_report::Applied::Newer => &self.counts.reports_applied,
            load_report::Applied::Stale => &self.counts.reports_stale,
        };
        KvEventCounts::bump(counter, 1);
        applied
    }

    /// Set `worker`'s reported others on the board (0: its report stream ended or restarts);
    /// a lower load wakes the requests waiting for room.
    fn set_reported(&self, worker: InstanceId, units: u64) {
        let mut board = self.board.lock();
        let lower = units < board.others(worker);
        board.set_others(worker, units);
        drop(board);
        if lower {
            (self.wake)();
        }
    }

    pub(super) fn counts(&self) -> &Arc<KvEventCounts> {
        &self.counts
    }

    /// Apply one batch of `worker`'s events; `None` (and the worker's entries dropped) when the
    /// worker is not discovered and admitted.
    pub(super) fn apply(&self, worker: InstanceId, batch: &EventBatch) -> Option<Applied> {
        let member = matches!(
            self.view.status(worker),
            InstanceStatus::Routable(_) | InstanceStatus::Unhealthy(_)
        );
        let mut kv = self.kv.lock();
        if !member {
            kv.reset_events(worker);
            KvEventCounts::bump(&self.counts.resets, 1);
            return None;
        }
        let applied = kv.apply_events(worker, batch);
        drop(kv);
        let counter = match applied {
            Applied::InOrder | Applied::Started => &self.counts.applied,
            Applied::Resynced => &self.counts.gaps,
            Applied::Stale => &self.counts.stale,
            Applied::Overflowed => &self.counts.resets,
        };
        KvEventCounts::bump(counter, 1);
        if matches!(applied, Applied::Resynced | Applied::Overflowed) {
            tracing::debug!(
                worker,
                seq = batch.seq,
                ?applied,
                "KV events: worker's entries dropped"
            );
        }
        Some(applied)
    }

    /// Replace `worker`'s entries with `snapshot`, if the worker is discovered and admitted
    /// (otherwise its entries are dropped, as for a batch, and [`Applied::Overflowed`] is
    /// returned). Connections call it for a reassembled snapshot; an in-process link calls it
    /// through [`Dispatcher::apply_kv_snapshot`](super::Dispatcher::apply_kv_snapshot).
    pub(super) fn apply_snapshot(&self, worker: InstanceId, snapshot: &KvSnapshot) -> Applied {
        let member = matches!(
            self.view.status(worker),
            InstanceStatus::Routable(_) | InstanceStatus::Unhealthy(_)
        );
        let mut kv = self.kv.lock();
        let applied = if member {
            kv.apply_snapshot(worker, snapshot)
        } else {
            kv.reset_events(worker);
            Applied::Overflowed
        };
        drop(kv);
        let counter = if applied == Applied::Started {
            &self.counts.snapshots_applied
        } else {
            &self.counts.snapshots_failed
        };
        KvEventCounts::bump(counter, 1);
        tracing::debug!(
            worker,
            blocks = snapshot.block_count(),
            seq = ?snapshot.seq,
            ?applied,
            "KV snapshot"
        );
        applied
    }

    /// Drop what the index knows of `worker`.
    pub(super) fn reset(&self, worker: InstanceId) {
        self.kv.lock().reset_events(worker);
        KvEventCounts::bump(&self.counts.resets, 1);
    }

    /// A sink for a new connection to `worker`, and its generation; it applies nothing until
    /// [`adopt`](Self::adopt)ed.
    pub(super) fn sink(self: &Arc<Self>, worker: InstanceId) -> (Arc<dyn KvEventSink>, u64) {
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let sink = ConnectionSink {
            feed: Arc::clone(self),
            worker,
            generation,
        };
        (Arc::new(sink), generation)
    }

    /// A sink for an engine's event feed (`engine::kv_events`), adopted at once: the feed is
    /// `worker`'s only source of events, and what an earlier feed said is dropped.
    #[cfg(feature = "engine")]
    /// An engine's own load (feature `engine`, [`crate::engine::load`]) as `worker`'s reported
    /// others: the engine's requests, each weighed as this dispatcher's mean booking, less
    /// what this dispatcher booked there itself (which the engine counts too). Unknown load
    /// adds nothing (the bookings alone score it); stale load is saturated.
    #[cfg(feature = "engine")]
    pub(crate) fn engine_load(&self, worker: InstanceId, reading: &crate::engine::LoadReading) {
        use crate::engine::LoadReading;
        let units = match reading {
            LoadReading::Known(load) => {
                let overhead = self.kv.lock().cost().request_overhead.max(1);
                let board = self.board.lock();
                // Before the first booking there is no mean: a request weighs its overhead.
                let each = board.mean_booking().unwrap_or(overhead);
                load.requests()
                    .saturating_mul(each)
                    .saturating_sub(board.load(worker))
            }
            LoadReading::Unknown(_) => 0,
            LoadReading::Stale => SATURATED_UNITS,
        };
        self.set_reported(worker, units);
    }

    /// The sink of an engine's event feed (the engine's feed is its one connection: adopted
    /// at once).
    #[cfg(feature = "engine")]
    pub(crate) fn engine_sink(self: &Arc<Self>, worker: InstanceId) -> Arc<dyn KvEventSink> {
        let (sink, generation) = self.sink(worker);
        self.adopt(worker, generation);
        sink
    }

    /// The connection of `generation` is now `worker`'s pooled one: what the index knew from an
    /// earlier connection is dropped (events in between may be lost).
    pub(super) fn adopt(&self, worker: InstanceId, generation: u64) {
        let mut current = self.current.lock();
        // What the connection reported before it was pooled, if anything.
        let reported = self.pending.lock().remove(&generation).unwrap_or_default();
        let units = self.booking_units(reported.others());
        let previous = current.insert(
            worker,
            Current {
                generation,
                reported,
            },
        );
        // Under the lock: no report of the old connection lands after this reset.
        self.set_reported(worker, units);
        drop(current);
        if previous.is_some() && !self.mutant.is(DispatchMutant::KeepKvOnReconnect) {
            self.reset(worker);
        }
    }

    /// `worker` departed: its connection's stream no longer applies anything.
    pub(super) fn forget(&self, worker: InstanceId) {
        let mut current = self.current.lock();
        current.remove(&worker);
        self.set_reported(worker, 0);
    }

    fn is_current(&self, worker: InstanceId, generation: u64) -> bool {
        self.current
            .lock()
            .get(&worker)
            .is_some_and(|c| c.generation == generation)
    }
}

/// One connection's sink.
struct ConnectionSink {
    feed: Arc<KvFeed>,
    worker: InstanceId,
    generation: u64,
}

impl KvEventSink for ConnectionSink {
    fn batch(&self, batch: EventBatch) {
        if self.feed.is_current(self.worker, self.generation) {
            self.feed.apply(self.worker, &batch);
        } else {
            KvEventCounts::bump(&self.feed.counts.stale, 1);
        }
    }

    fn error(&self, error: KvStreamError) {
        let counter = match error {
            KvStreamError::Lagged { dropped } => {
                KvEventCounts::bump(&self.feed.counts.lagged, dropped);
                None
            }
            _ => Some(&self.feed.counts.refused),
        };
        if let Some(counter) = counter {
            KvEventCounts::bump(counter, 1);
        }
        // A lost batch: the worker's entries may now miss a removal, so none are trusted.
        if self.feed.is_current(self.worker, self.generation) {
            tracing::debug!(worker = self.worker, %error, "KV events: worker's entries dropped");
            self.feed.reset(self.worker);
        }
    }

    fn wants_snapshots(&self) -> bool {
        true
    }

    fn snapshot_requested(&self) {
        KvEventCounts::bump(&self.feed.counts.snapshots_requested, 1);
    }

    fn snapshot(&self, snapshot: KvSnapshot) {
        if self.feed.is_current(self.worker, self.generation) {
            let _ = self.feed.apply_snapshot(self.worker, &snapshot);
        } else {
            KvEventCounts::bump(&self.feed.counts.snapshots_failed, 1);
        }
    }

    fn snapshot_failed(&self, error: SnapshotError) {
        tracing::debug!(worker = self.worker, %error, "KV snapshot failed");
        KvEventCounts::bump(&self.feed.counts.snapshots_failed, 1);
    }

    fn load_report(&self, report: Result<LoadReport, LoadReportError>) {
        match report {
            Ok(report) => self.feed.load_report(self.worker, self.generation, report),
            Err(error) => {
                KvEventCounts::bump(&self.feed.counts.reports_refused, 1);
                tracing::debug!(worker = self.worker, %error, "load report refused");
            }
        }
    }

    fn closed(&self) {
        let current = {
            let mut map = self.feed.current.lock();
            let current = map
                .get(&self.worker)
                .is_some_and(|c| c.generation == self.generation);
            if current {
                map.remove(&self.worker);
                // The worker's reports stopped: its frontend-wide load is unknown again.
                self.feed.set_reported(self.worker, 0);
            } else {
                // Never pooled (or replaced): what it kept aside goes.
                self.feed.pending.lock().remove(&self.generation);
            }
            current
        };
        if current && !self.feed.mutant.is(DispatchMutant::KeepKvOnReconnect) {
            self.feed.reset(self.worker);
        }
    }
}
