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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::kv::KvSelector;
use super::view::{InstanceStatus, RoutableView};
use super::DispatchMutant;
use crate::discovery::InstanceId;
use crate::hooks::Seam;
use crate::kv_events::{Applied, EventBatch, KvSnapshot, SnapshotError};
use crate::transport::{KvEventSink, KvStreamError};

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

    fn bump(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// The dispatcher's side of every worker connection's event stream.
pub(super) struct KvFeed {
    kv: Arc<Mutex<KvSelector>>,
    view: RoutableView,
    /// The dispatcher's mutant (`KeepKvOnReconnect` acts here).
    mutant: Seam<DispatchMutant>,
    counts: Arc<KvEventCounts>,
    /// Worker → generation of its pooled connection (at most one entry per pooled worker).
    current: Mutex<HashMap<InstanceId, u64>>,
    next_generation: AtomicU64,
}

impl KvFeed {
    pub(super) fn new(
        kv: Arc<Mutex<KvSelector>>,
        view: RoutableView,
        mutant: Seam<DispatchMutant>,
    ) -> Self {
        KvFeed {
            kv,
            view,
            mutant,
            counts: Arc::default(),
            current: Mutex::new(HashMap::new()),
            next_generation: AtomicU64::new(1),
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
    /// (otherwise its entries are dropped, as for a batch).
    fn apply_snapshot(&self, worker: InstanceId, snapshot: &KvSnapshot) {
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

    /// The connection of `generation` is now `worker`'s pooled one: what the index knew from an
    /// earlier connection is dropped (events in between may be lost).
    pub(super) fn adopt(&self, worker: InstanceId, generation: u64) {
        let previous = self.current.lock().insert(worker, generation);
        if previous.is_some() && !self.mutant.is(DispatchMutant::KeepKvOnReconnect) {
            self.reset(worker);
        }
    }

    /// `worker` departed: its connection's stream no longer applies anything.
    pub(super) fn forget(&self, worker: InstanceId) {
        self.current.lock().remove(&worker);
    }

    fn is_current(&self, worker: InstanceId, generation: u64) -> bool {
        self.current.lock().get(&worker) == Some(&generation)
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
            self.feed.apply_snapshot(self.worker, &snapshot);
        } else {
            KvEventCounts::bump(&self.feed.counts.snapshots_failed, 1);
        }
    }

    fn snapshot_failed(&self, error: SnapshotError) {
        tracing::debug!(worker = self.worker, %error, "KV snapshot failed");
        KvEventCounts::bump(&self.feed.counts.snapshots_failed, 1);
    }

    fn closed(&self) {
        let current = {
            let mut map = self.feed.current.lock();
            let current = map.get(&self.worker) == Some(&self.generation);
            if current {
                map.remove(&self.worker);
            }
            current
        };
        if current && !self.feed.mutant.is(DispatchMutant::KeepKvOnReconnect) {
            self.feed.reset(self.worker);
        }
    }
}
