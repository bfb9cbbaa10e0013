//! The dispatcher's side of the workers' KV events: batches and resets go to its feed
//! (`push/kv_feed.rs`), and departed workers leave the index.

use super::{Dispatcher, WorkerLink};
use crate::discovery::InstanceId;
use crate::kv_events::{Applied, EventBatch, KvSnapshot};
use crate::load_report::LoadReport;
use crate::push::kv::KvSelector;
use crate::push::view::InstanceStatus;

impl<L: WorkerLink> Dispatcher<L> {
    /// Apply one batch of `worker`'s KV cache events to the KV index (see
    /// [`KvSelector::apply_events`]). `None` when not in KV mode, or when the worker is not
    /// discovered and admitted: then whatever the index held for it is dropped and the batch
    /// ignored (a worker outside admission earns no credit; its next batch once admitted
    /// starts it afresh).
    pub fn apply_kv_events(&self, worker: InstanceId, batch: &EventBatch) -> Option<Applied> {
        self.kv_feed.as_ref()?.apply(worker, batch)
    }

    /// Apply a load report of `worker` that reached this dispatcher without a connection (an
    /// in-process link; connections apply their own reports): its others' work then counts in
    /// the worker's load ([`crate::load_report`]). `None` when not in KV mode (no load board
    /// to order).
    pub fn apply_load_report(
        &self,
        worker: InstanceId,
        report: LoadReport,
    ) -> Option<crate::load_report::Applied> {
        Some(self.kv_feed.as_ref()?.load_report_direct(worker, report))
    }

    /// Replace what the KV index knows of `worker` with `snapshot` of its cache, delivered
    /// without a connection (an in-process link, as the replay's late-joining frontend: the
    /// TCP request plane asks for and applies its snapshots itself, `transport/feed.rs`). From
    /// then on the worker is scored by its events: live batches with a larger `seq` than the
    /// snapshot's apply after it, older ones are stale (the index's sequence rule). Counted in
    /// [`kv_event_counts`](Self::kv_event_counts) as applied or failed snapshots. `None` when
    /// not in KV mode; [`Applied::Stale`] (ignored) for a snapshot of an older epoch than the
    /// index holds; [`Applied::Overflowed`] (entries dropped) when the worker is not
    /// discovered and admitted, or the snapshot is past the index's block limit; else
    /// [`Applied::Started`].
    pub fn apply_kv_snapshot(&self, worker: InstanceId, snapshot: &KvSnapshot) -> Option<Applied> {
        Some(self.kv_feed.as_ref()?.apply_snapshot(worker, snapshot))
    }

    /// Drop what the KV index knows of `worker` (its event stream reconnected or was lost):
    /// until its next batch it is scored by prediction.
    pub fn reset_kv_events(&self, worker: InstanceId) {
        if let Some(feed) = &self.kv_feed {
            feed.reset(worker);
        }
    }

    /// Whether the KV index scores `worker` from its events (false when not in KV mode, or
    /// when the worker is scored by prediction).
    pub fn kv_indexed(&self, worker: InstanceId) -> bool {
        self.kv
            .as_ref()
            .is_some_and(|kv| kv.lock().index().publishes(worker))
    }

    /// The leading blocks of `token_ids` the KV index credits `worker` with, from its events
    /// (`None` when not in KV mode or `worker` publishes none): what the router expects the
    /// worker to find cached, to compare with what it reports.
    pub fn kv_indexed_overlap(&self, token_ids: &[u32], worker: InstanceId) -> Option<usize> {
        let kv = self.kv.as_ref()?.lock();
        let index = kv.index();
        if !index.publishes(worker) {
            return None;
        }
        let hashes = crate::kv_events::block_hashes(token_ids, kv.block_size());
        Some(index.overlap(&hashes, worker))
    }

    /// Drop indexed workers that are no longer discovered and admitted.
    pub(super) fn prune_kv_index(&self, kv: &mut KvSelector) {
        kv.retain_indexed(|w| {
            matches!(
                self.view.status(w),
                InstanceStatus::Routable(_) | InstanceStatus::Unhealthy(_)
            )
        });
    }

    /// Forget a departed worker in the KV index (callers may call it on `Removed` events; the
    /// dispatcher also works without, since only routable workers are scored).
    pub fn forget(&self, id: InstanceId) {
        if let Some(kv) = &self.kv {
            kv.lock().forget(id);
        }
        if let Some(feed) = &self.kv_feed {
            feed.forget(id);
        }
        self.link.forget(id);
    }
}
