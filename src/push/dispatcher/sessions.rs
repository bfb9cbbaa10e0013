//! The dispatcher's session-affinity pick: the session's first usable worker in its rendezvous
//! order over the routable set, so every frontend that sees the same set picks the same
//! worker without talking to the others (docs/router.md, "Session affinity across frontends").

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::booking::Booking;
use super::picked::{Candidates, Pick};
use super::{DispatchMutant, Dispatcher, PushMode, WorkerLink};
use crate::discovery::{Instance, InstanceId};
use crate::kv_events::block_hashes;
use crate::push::affinity::{
    first_index, rendezvous_order, session_key, AffinityOutcome, AffinityTable,
};
use crate::push::select::is_busy;
use crate::push::{LoadBoard, PushError};
use crate::request::GenerateRequest;

/// A session pick before its outcome is known: the worker, the KV overlap expected there and
/// the work booked on it (KV mode).
type Placed = (Arc<Instance>, Option<usize>, Option<Booking>);

impl<L: WorkerLink> Dispatcher<L> {
    /// The pick for a request of `session`: the first worker of the session's rendezvous order
    /// among `routable` (admitted, discovered, breaker closed, not already failed by this
    /// request) that is not over the busy threshold (KV mode). The table only classifies it
    /// against where the session went last (hit, miss, re-pick) and remembers it. The clock is
    /// tokio's, so a paused runtime (the simulator) controls expiry.
    pub(super) fn pick_for_session(
        &self,
        table: &AffinityTable,
        session: &str,
        request: &GenerateRequest,
        (all, routable, _): Candidates<'_>,
    ) -> Result<Pick, PushError> {
        let key = session_key(session);
        let now = Instant::now();
        let remembered = table.remembered(key, now);
        let placed = match remembered.as_ref() {
            // The broken rule the affinity checks must catch: a live entry wins unchecked.
            Some(r) if self.mutant.is(DispatchMutant::AffinityIgnoresRoutable) => {
                self.place_on(request, Arc::clone(r))
            }
            // The old per-frontend rule: a live entry wins while its worker is routable.
            Some(r)
                if self.mutant.is(DispatchMutant::AffinityKeepsLiveEntry)
                    && routable.iter().any(|i| i.instance_id == r.instance_id) =>
            {
                self.place_on(request, Arc::clone(r))
            }
            _ => self.place_by_rendezvous(key, request, all, routable)?,
        };
        let (instance, overlap, booking) = placed;
        let outcome = match remembered {
            None => AffinityOutcome::Miss,
            Some(r) if r.instance_id == instance.instance_id => AffinityOutcome::Hit,
            Some(_) => AffinityOutcome::Repick,
        };
        table.remember(key, Arc::clone(&instance), now);
        table.counts().record(outcome);
        tracing::trace!(
            session,
            worker = instance.instance_id,
            ?outcome,
            "session affinity"
        );
        Ok(Pick {
            instance,
            overlap,
            affinity: Some(outcome),
            booking,
        })
    }

    /// The session's worker among `routable` (not empty): the first of its rendezvous order,
    /// or in KV mode the first not over the busy threshold, with the request attributed and
    /// booked there as a KV pick would. Every worker over the threshold is
    /// [`PushError::Overloaded`], which the caller waits on as for any pick.
    fn place_by_rendezvous(
        &self,
        key: u64,
        request: &GenerateRequest,
        all: &Arc<[Arc<Instance>]>,
        routable: &[Arc<Instance>],
    ) -> Result<Placed, PushError> {
        let first = first_index(key, routable.iter().map(|i| i.instance_id))
            .ok_or(PushError::NoRoutableInstances)?;
        let (PushMode::Kv { .. }, Some(kv)) = (&self.mode, self.kv.as_ref()) else {
            // No load term outside KV mode: the first choice, always.
            return Ok((Arc::clone(&routable[first]), None, None));
        };
        let threshold = self.busy_threshold();
        let mut board = self.loads.board();
        self.sync_board(&mut board, all, kv);
        let has_room = |board: &LoadBoard, id: InstanceId| !is_busy(board.combined(id), threshold);
        // The common case, the first choice with room, costs one pass and no sort.
        let chosen = if has_room(&board, routable[first].instance_id) {
            Some(Arc::clone(&routable[first]))
        } else {
            let ids: Vec<InstanceId> = routable.iter().map(|i| i.instance_id).collect();
            rendezvous_order(key, &ids)
                .into_iter()
                .find(|&id| has_room(&board, id))
                .and_then(|id| routable.iter().find(|i| i.instance_id == id).cloned())
        };
        let Some(instance) = chosen else {
            return Err(PushError::Overloaded {
                threshold: threshold.unwrap_or(0),
                waited: Duration::ZERO,
            });
        };
        let (overlap, booking) = self.attribute(request, &instance, &mut board);
        Ok((instance, overlap, booking))
    }

    /// `instance` as the pick, whatever its state (the affinity mutants).
    fn place_on(&self, request: &GenerateRequest, instance: Arc<Instance>) -> Placed {
        let mut board = self.loads.board();
        let (overlap, booking) = self.attribute(request, &instance, &mut board);
        (instance, overlap, booking)
    }

    /// In KV mode, what the selector expects `worker` to hold of the request, with its
    /// uncached tokens booked on it in the locked `board` (the lock the choice was made under),
    /// and the request's blocks attributed to it (as a KV pick does); `(None, None)` in other
    /// modes.
    fn attribute(
        &self,
        request: &GenerateRequest,
        worker: &Instance,
        board: &mut LoadBoard,
    ) -> (Option<usize>, Option<Booking>) {
        let (PushMode::Kv { block_size, .. }, Some(kv)) = (&self.mode, self.kv.as_ref()) else {
            return (None, None);
        };
        let id = worker.instance_id;
        let hashes = block_hashes(&request.token_ids, *block_size);
        let mut kv = kv.lock();
        let overlap = kv.overlap(&hashes, id);
        let uncached = kv.cost().uncached(request.token_ids.len() as u64, overlap);
        kv.record(&hashes, id);
        let booked = kv.cost().booking(uncached);
        kv.record_pick(&hashes, overlap, id, booked);
        drop(kv);
        let booking = self.loads.book(board, id, booked);
        (Some(overlap), Some(booking))
    }
}
