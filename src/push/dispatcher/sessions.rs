//! The dispatcher's session-affinity pick.

use std::sync::Arc;

use tokio::time::Instant;

use super::{Candidates, Dispatcher, Pick, PushMode};
use crate::discovery::InstanceId;
use crate::push::affinity::{session_key, AffinityOutcome, AffinityTable};
use crate::push::kv::block_hashes;
use crate::transport::GenerateRequest;

impl Dispatcher {
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
                let found = if self.hooks.affinity_checks_routable() {
                    // The routable set is sorted by id: O(log n), not a pass over the pool.
                    routable
                        .binary_search_by_key(&remembered.instance_id, |i| i.instance_id)
                        .ok()
                        .map(|at| Arc::clone(&routable[at]))
                } else {
                    Some(remembered)
                };
                if let Some(instance) = found {
                    let overlap = self.kv_attribute(request, instance.instance_id);
                    table.remember(key, Arc::clone(&instance), now);
                    table.counts().record(AffinityOutcome::Hit);
                    return Ok(Pick {
                        instance,
                        overlap,
                        affinity: Some(AffinityOutcome::Hit),
                    });
                }
                AffinityOutcome::Repick
            }
            None => AffinityOutcome::Miss,
        };
        let (instance, overlap) = self.pick(request, candidates)?;
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
        })
    }

    /// In KV mode, what the selector expects `worker` to hold of the request, and attribute
    /// the request's blocks to it (as a KV pick does); `None` in other modes.
    fn kv_attribute(&self, request: &GenerateRequest, worker: InstanceId) -> Option<usize> {
        let PushMode::Kv { block_size, .. } = &self.mode else {
            return None;
        };
        let kv = self.kv.as_ref()?;
        let hashes = block_hashes(&request.token_ids, *block_size);
        let mut kv = kv.lock();
        let overlap = kv.overlap(&hashes, worker);
        kv.record(&hashes, worker);
        Some(overlap)
    }
}
