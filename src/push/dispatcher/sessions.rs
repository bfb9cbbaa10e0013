//! The dispatcher's session-affinity pick.

use std::sync::Arc;

use tokio::time::Instant;

use super::booking::Booking;
use super::{Candidates, DispatchMutant, Dispatcher, Pick, PushMode, WorkerLink};
use crate::discovery::Instance;
use crate::push::affinity::{session_key, AffinityOutcome, AffinityTable};
use crate::push::kv::block_hashes;
use crate::push::select::is_busy;
use crate::request::GenerateRequest;

impl<L: WorkerLink> Dispatcher<L> {
    /// The pick for a request of `session`: its remembered worker if that is among
    /// `routable` (admitted, discovered, breaker closed, not already failed by this request),
    /// else the mode's pick, which the entry then moves to. The clock is tokio's, so a paused
    /// runtime (the simulator) controls expiry.
    pub(super) fn pick_for_session(
        &self,
        table: &AffinityTable,
        session: &str,
        request: &GenerateRequest,
        candidates: Candidates<'_>,
    ) -> Result<Pick, crate::push::PushError> {
        let routable = candidates.1;
        let key = session_key(session);
        let now = Instant::now();
        let outcome = match table.remembered(key, now) {
            Some(remembered) => {
                let found = if !self.mutant.is(DispatchMutant::AffinityIgnoresRoutable) {
                    // The routable set is sorted by id: O(log n), not a pass over the pool.
                    routable
                        .binary_search_by_key(&remembered.instance_id, |i| i.instance_id)
                        .ok()
                        .map(|at| Arc::clone(&routable[at]))
                } else {
                    Some(remembered)
                };
                // A remembered worker over the busy threshold is re-picked like one that left.
                if let Some((instance, (overlap, booking))) =
                    found.and_then(|i| Some((Arc::clone(&i), self.kv_attribute(request, &i)?)))
                {
                    table.remember(key, Arc::clone(&instance), now);
                    table.counts().record(AffinityOutcome::Hit);
                    return Ok(Pick {
                        instance,
                        overlap,
                        affinity: Some(AffinityOutcome::Hit),
                        booking,
                    });
                }
                AffinityOutcome::Repick
            }
            None => AffinityOutcome::Miss,
        };
        let mut pick = self.pick(request, candidates)?;
        let instance = Arc::clone(&pick.instance);
        table.remember(key, Arc::clone(&instance), now);
        table.counts().record(outcome);
        tracing::trace!(
            session,
            worker = instance.instance_id,
            ?outcome,
            "session affinity"
        );
        pick.affinity = Some(outcome);
        Ok(pick)
    }

    /// In KV mode, what the selector expects `worker` to hold of the request, with its
    /// uncached tokens booked on it, and attribute the request's blocks to it (as a KV pick
    /// does); `(None, None)` in other modes; `None` when the worker is over the busy threshold.
    fn kv_attribute(
        &self,
        request: &GenerateRequest,
        worker: &Instance,
    ) -> Option<(Option<usize>, Option<Booking>)> {
        let (PushMode::Kv { block_size, .. }, Some(kv)) = (&self.mode, self.kv.as_ref()) else {
            return Some((None, None));
        };
        let id = worker.instance_id;
        let hashes = block_hashes(&request.token_ids, *block_size);
        let mut board = self.loads.board();
        if is_busy(board.combined(id), self.busy_threshold()) {
            return None;
        }
        let mut kv = kv.lock();
        let overlap = kv.overlap(&hashes, id);
        let uncached = kv.cost().uncached(request.token_ids.len() as u64, overlap);
        kv.record(&hashes, id);
        kv.record_credit(&hashes, overlap);
        let booked = kv.cost().booking(uncached);
        drop(kv);
        let booking = self.loads.book(&mut board, id, booked);
        Some((Some(overlap), Some(booking)))
    }
}
