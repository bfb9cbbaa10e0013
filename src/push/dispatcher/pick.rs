//! The dispatcher's pick: an instance per the mode (round robin, random, direct, KV), with
//! session affinity, without sending anything (the send and its retries are in `send.rs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::picked::{Candidates, Pick};
use super::{Dispatcher, HeldPick, PushMode, WorkerLink};
use crate::discovery::{Instance, InstanceId};
use crate::kv_events::{block_hashes, mix};
use crate::push::error::PushError;
use crate::push::select::Choice;
use crate::push::view::InstanceStatus;
use crate::push::{KvSelector, LoadBoard};
use crate::request::GenerateRequest;

impl<L: WorkerLink> Dispatcher<L> {
    fn random(&self) -> u64 {
        // splitmix64 over an atomic counter: lock-free and reproducible from the seed.
        let gamma = crate::rng::GAMMA;
        mix(self
            .rng
            .fetch_add(gamma, Ordering::Relaxed)
            .wrapping_add(gamma))
    }

    /// Pick an instance for `request` per the mode, without sending anything. In KV mode the
    /// pick is remembered (the request's blocks are attributed to the chosen worker).
    pub fn select(&self, request: &GenerateRequest) -> Result<Arc<Instance>, PushError> {
        self.select_with_overlap(request, &[]).map(|p| p.instance)
    }

    /// As [`select`](Self::select), never picking an instance in `excluded` (the workers a
    /// request already failed on): the next-best pick of the mode. `Direct` ignores it.
    pub fn select_excluding(
        &self,
        request: &GenerateRequest,
        excluded: &[InstanceId],
    ) -> Result<Arc<Instance>, PushError> {
        self.select_with_overlap(request, excluded)
            .map(|p| p.instance)
    }

    pub(super) fn select_with_overlap(
        &self,
        request: &GenerateRequest,
        excluded: &[InstanceId],
    ) -> Result<Pick, PushError> {
        if let PushMode::Direct(id) = self.mode {
            return self.direct_target(id).map(|instance| Pick {
                instance,
                overlap: None,
                affinity: None,
                booking: None,
            });
        }
        let all = self.view.routable();
        // The common case (a first attempt) reads the shared snapshot as is.
        let routable: Arc<[Arc<Instance>]> = if excluded.is_empty() {
            Arc::clone(&all)
        } else {
            all.iter()
                .filter(|i| !excluded.contains(&i.instance_id))
                .cloned()
                .collect()
        };
        if routable.is_empty() {
            return Err(PushError::NoRoutableInstances);
        }
        match (&self.affinity, request.session.as_deref()) {
            (Some(table), Some(session)) => {
                self.pick_for_session(table, session, request, (&all, &routable, excluded))
            }
            _ => self.pick(request, (&all, &routable, excluded)),
        }
    }

    /// The mode's pick among `routable` (not empty): `all` is the view's shared set, `routable`
    /// that set minus `excluded` (the KV mode reads `all` and skips `excluded` itself).
    pub(super) fn pick(
        &self,
        request: &GenerateRequest,
        (all, routable, excluded): Candidates<'_>,
    ) -> Result<Pick, PushError> {
        let plain = |instance: &Arc<Instance>| Pick {
            instance: Arc::clone(instance),
            overlap: None,
            affinity: None,
            booking: None,
        };
        match &self.mode {
            PushMode::RoundRobin => {
                let n = self.next.fetch_add(1, Ordering::Relaxed);
                Ok(plain(&routable[n % routable.len()]))
            }
            PushMode::Random => {
                #[allow(clippy::cast_possible_truncation)] // reduced modulo a usize
                let n = (self.random() % routable.len() as u64) as usize;
                Ok(plain(&routable[n]))
            }
            PushMode::Kv { block_size, .. } => {
                let Some(kv) = &self.kv else {
                    return Err(PushError::NoRoutableInstances);
                };
                let hashes = block_hashes(&request.token_ids, *block_size);
                let random = self.random();
                let mut board = self.loads.board();
                self.sync_board(&mut board, all, kv);
                let mut kv = kv.lock();
                let tokens = request.token_ids.len() as u64;
                let threshold = self.busy_threshold();
                let (candidate, uncached) =
                    match kv.select_on(&hashes, tokens, &board, excluded, threshold, random) {
                        Choice::Picked {
                            candidate,
                            uncached,
                        } => (candidate, uncached),
                        Choice::Overloaded => {
                            return Err(PushError::Overloaded {
                                threshold: threshold.unwrap_or(0),
                                waited: Duration::ZERO,
                            })
                        }
                        Choice::Empty => return Err(PushError::NoRoutableInstances),
                    };
                kv.record(&hashes, candidate.id);
                let booked = kv.cost().booking(uncached);
                kv.record_pick(&hashes, candidate.overlap, candidate.id, booked);
                drop(kv);
                let instance = board
                    .member(candidate.id)
                    .cloned()
                    .ok_or(PushError::NoRoutableInstances)?;
                // Booked under the lock that chose it: no other pick sees the worker without it.
                let booking = self.loads.book(&mut board, candidate.id, booked);
                Ok(Pick {
                    instance,
                    overlap: Some(candidate.overlap),
                    affinity: None,
                    booking: Some(booking),
                })
            }
            PushMode::Direct(_) => Err(PushError::NoRoutableInstances),
        }
    }

    /// Make the locked `board`'s members the view's routable set `all`. The view hands out one
    /// shared set until it changes: re-sync the members, and drop indexed workers that left,
    /// only then (O(pool) per change, O(1) per request).
    pub(super) fn sync_board(
        &self,
        board: &mut LoadBoard,
        all: &Arc<[Arc<Instance>]>,
        kv: &Mutex<KvSelector>,
    ) {
        if !board.has_members(all) {
            board.set_members(Arc::clone(all));
            self.prune_kv_index(&mut kv.lock());
        }
    }

    /// Pick an instance for `request` as [`generate`](Self::generate) would, for callers that
    /// deliver the request themselves (in-process engines, the trace replay): in KV mode the
    /// returned [`HeldPick`] holds the request's uncached tokens booked on the instance (the
    /// load term) until dropped, exactly as a routed stream does. It does not wait for room:
    /// with every worker over the busy threshold it fails with [`PushError::Overloaded`] (use
    /// [`select_held_waiting`](Self::select_held_waiting) to queue).
    pub fn select_held(&self, request: &GenerateRequest) -> Result<HeldPick, PushError> {
        self.select_with_overlap(request, &[]).map(HeldPick::from)
    }

    /// [`select_held`](Self::select_held) never picking an instance in `excluded` (a retry
    /// elsewhere by a caller that delivers the request itself).
    pub fn select_held_excluding(
        &self,
        request: &GenerateRequest,
        excluded: &[InstanceId],
    ) -> Result<HeldPick, PushError> {
        self.select_with_overlap(request, excluded)
            .map(HeldPick::from)
    }

    /// [`select_held`](Self::select_held), waiting for room as [`generate`](Self::generate)
    /// does while every routable worker is over the busy threshold.
    pub async fn select_held_waiting(
        &self,
        request: &GenerateRequest,
    ) -> Result<HeldPick, PushError> {
        let deadline = self.config.request_timeout.map(|t| Instant::now() + t);
        self.select_or_wait(request, &[], deadline)
            .await
            .map(HeldPick::from)
    }

    pub(super) fn direct_target(&self, id: InstanceId) -> Result<Arc<Instance>, PushError> {
        match self.view.status(id) {
            InstanceStatus::Routable(instance) => Ok(instance),
            InstanceStatus::Unknown => Err(PushError::InstanceGone(id)),
            InstanceStatus::NotAdmitted | InstanceStatus::Unhealthy(_) => {
                Err(PushError::DirectTargetNotRoutable(id))
            }
        }
    }
}
