//! The simulated request plane: the [`WorkerLink`] each binding's real [`Dispatcher`] sends
//! through. The dispatcher picks, books, retries elsewhere and releases exactly as in
//! production; this link only carries each attempt to a simulated worker, which answers,
//! rejects, crashes mid-stream (and goes down), hangs until the request's deadline, or refuses
//! the connection because it is down.
//!
//! Every attempt comes through [`WorkerLink::open`] in the same poll as the pick that chose it,
//! so the per-pick oracles run here against the world exactly as the dispatcher saw it: the
//! stale KV credit (`sim/kv_events.rs`), the session-affinity ones (`sim/sessions.rs`) and
//! dispatch outside admission. The mutants that break the dispatcher's pick
//! (`RetryReusesFailedWorker`, `AffinityIgnoresRoutable`, `AffinityKeepsLiveEntry`) redirect the attempt here, as the
//! broken dispatcher would have sent it; `NoPrefillTimeout` makes the link forget the deadline.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_core::Stream;
use futures_util::FutureExt;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;

use super::config::{timing, Mutant};
use super::frontends;
use super::kv_events;
use super::oracle::Violation;
use super::sessions;
use super::world::{AffinityMirror, World};
use prefill_router::binding::WorkerSetTargetId;
use prefill_router::discovery::InstanceId;
use prefill_router::health::FailureClass;
use prefill_router::push::{Dispatch, Dispatcher, RoutableView, WorkerLink};
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse, PrefillInfo};
use prefill_router::transport::{RemoteError, TransportError};

/// Key of the worker decision streams (see `World::keyed`).
const STREAM_WORKER: u64 = 3;

/// The request id the simulator writes into `GenerateRequest::request_id` (the session key
/// is left to session affinity).
pub(crate) fn request_id(request: &GenerateRequest) -> u64 {
    request.request_id.unwrap_or(u64::MAX)
}

/// The workers each request in flight on one binding really went to, in order (a redirecting
/// mutant sends an attempt elsewhere than the dispatcher picked).
pub(crate) type Tried = Arc<Mutex<BTreeMap<u64, Vec<InstanceId>>>>;

/// What a worker does with one prefill.
enum WorkerPlan {
    Answer(Duration),
    Reject,
    /// Fails after `Duration`; the worker is down from then on.
    Crash(Duration),
    Hang,
    /// The worker is down: connection refused.
    Refused,
}

/// The responses of one simulated prefill: a single item (the answer or the failure).
pub(crate) type SimStream =
    Pin<Box<dyn Stream<Item = Result<GenerateResponse, TransportError>> + Send>>;

/// One binding's in-memory link to the simulated workers.
pub(crate) struct SimLink {
    pub(crate) world: Arc<World>,
    /// The binding's serial and target (oracles name bindings by them).
    pub(crate) serial: u64,
    pub(crate) target: WorkerSetTargetId,
    pub(crate) admitted: watch::Receiver<BTreeSet<InstanceId>>,
    pub(crate) view: RoutableView,
    pub(crate) mutant: Option<Mutant>,
    /// The KV block size when the run has KV events.
    pub(crate) kv_block: Option<u32>,
    /// The dispatcher sending through this link (its KV index, for the stale-credit oracle);
    /// weak, since the dispatcher owns the link.
    pub(crate) dispatcher: Weak<Dispatcher<SimLink>>,
    /// The dispatcher's affinity table (runs with sessions).
    pub(crate) affinity: Option<AffinityMirror>,
    pub(crate) tried: Tried,
    /// The dispatcher's connection at every worker's load ledger (runs with several
    /// frontends).
    pub(crate) conn: Option<u64>,
}

impl WorkerLink for SimLink {
    type Stream = SimStream;

    fn open(
        &self,
        dispatch: Dispatch<'_>,
        request: GenerateRequest,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<SimStream, TransportError>> + Send {
        // All of it now, in the pick's poll: the oracles judge the world the pick saw.
        std::future::ready(self.send(&dispatch, &request, deadline))
    }
}

impl SimLink {
    /// Judge the pick, draw what the worker does with the attempt, and carry it out.
    fn send(
        &self,
        dispatch: &Dispatch<'_>,
        request: &GenerateRequest,
        deadline: Option<Instant>,
    ) -> Result<SimStream, TransportError> {
        let id = request_id(request);
        let picked = dispatch.instance.instance_id;
        let hashes = self
            .kv_block
            .map(|b| prefill_router::push::block_hashes(&request.token_ids, b));
        if let (Some(hashes), Some(dispatcher)) = (&hashes, self.dispatcher.upgrade()) {
            let credited = dispatch.expected_overlap_blocks;
            kv_events::picked(&self.world, id, &dispatcher, picked, hashes, credited);
        }
        if let (Some(conn), Some(dispatcher)) = (self.conn, self.dispatcher.upgrade()) {
            frontends::picked(&self.world, &*dispatcher, conn, picked);
        }
        let last_tried = self.tried.lock().get(&id).and_then(|t| t.last().copied());
        let worker = match (self.mutant, last_tried) {
            // The broken dispatcher: a retry goes back to the worker that just failed.
            (Some(Mutant::RetryReusesFailedWorker), Some(last)) if dispatch.attempt > 0 => last,
            _ => self.judge_affinity(id, request, dispatch, picked),
        };
        self.check_admission(id, worker);
        self.world.trace(&[3, id, worker, self.serial]);
        self.tried.lock().entry(id).or_default().push(worker);
        let plan = self.draw(id, worker, dispatch.attempt);
        let addr = dispatch.instance.address;
        // An attempt a mutant sent elsewhere than the pick: its failure is the real worker's
        // (reported here, as the broken dispatcher would), and the dispatcher sees one that
        // blames no worker but is retried elsewhere, so the never-contacted pick keeps its
        // health.
        let redirected = worker != picked;
        let view = self.view.clone();
        let fail = move |class: FailureClass, error: TransportError| {
            if redirected {
                view.report_failure(worker, class);
                TransportError::Remote(RemoteError::Overloaded)
            } else {
                error
            }
        };
        let work = match plan {
            WorkerPlan::Refused => {
                let error = TransportError::Connect {
                    addr,
                    reason: format!("worker {worker}: connection refused"),
                };
                return Err(fail(FailureClass::ConnectionRefused, error));
            }
            WorkerPlan::Reject => {
                let message = format!("worker {worker} rejected the request");
                let error = TransportError::Remote(RemoteError::Engine { message });
                std::future::ready(Err(error)).boxed()
            }
            WorkerPlan::Hang => std::future::pending().boxed(),
            WorkerPlan::Crash(d) => {
                let world = Arc::clone(&self.world);
                async move {
                    tokio::time::sleep(d).await;
                    world.crash(worker);
                    let reason = format!("worker {worker} crashed mid-stream");
                    Err(fail(
                        FailureClass::ConnectionReset,
                        TransportError::Disconnected { reason },
                    ))
                }
                .boxed()
            }
            WorkerPlan::Answer(d) => {
                let world = Arc::clone(&self.world);
                let response = answer(worker, request);
                async move {
                    tokio::time::sleep(d).await;
                    if let Some(hashes) = hashes {
                        kv_events::prefilled(&world, worker, &hashes);
                    }
                    Ok(response)
                }
                .boxed()
            }
        };
        // The worker holds the attempt's work in its load ledger until the attempt ends (the
        // answer, the failure, the deadline, or the stream dropped).
        let held = self.conn.and_then(|conn| {
            let key = id.wrapping_mul(8).wrapping_add(u64::from(dispatch.attempt));
            let tokens = request.token_ids.len() as u64;
            frontends::admit(&self.world, worker, conn, key, tokens)
        });
        let deadline = deadline.filter(|_| self.mutant != Some(Mutant::NoPrefillTimeout));
        let item = async move {
            let mut held = held;
            let out = match deadline {
                Some(d) => tokio::time::timeout_at(d, work)
                    .await
                    .unwrap_or(Err(TransportError::Timeout)),
                None => work.await,
            };
            if let Some(held) = &mut held {
                held.answered = out.is_ok();
            }
            drop(held);
            out
        };
        Ok(Box::pin(futures_util::stream::once(item)))
    }

    /// The affinity oracles at a pick in runs with sessions; returns where the attempt goes
    /// (the pick, or under `AffinityIgnoresRoutable` or `AffinityKeepsLiveEntry` the session's
    /// live entry).
    fn judge_affinity(
        &self,
        id: u64,
        request: &GenerateRequest,
        dispatch: &Dispatch<'_>,
        picked: InstanceId,
    ) -> InstanceId {
        let Some(table) = &self.affinity else {
            return picked;
        };
        // Read in the pick's poll: what the dispatcher picked from.
        let routable: Vec<InstanceId> =
            self.view.routable().iter().map(|i| i.instance_id).collect();
        let mut outcomes = table.counted_since_last_pick();
        let mut worker = picked;
        let session = request.session.as_deref();
        let live = session.and_then(|s| sessions::live_entry(&self.world, self.serial, s));
        let redirect = live.filter(|r| match self.mutant {
            // The broken dispatcher: a live entry wins, routable or not.
            Some(Mutant::AffinityIgnoresRoutable) => true,
            // The old, per-frontend rule: a live entry wins while its worker is usable.
            Some(Mutant::AffinityKeepsLiveEntry) => {
                routable.contains(r) && !dispatch.failed.contains(r)
            }
            _ => false,
        });
        if let Some(remembered) = redirect {
            worker = remembered;
            outcomes = vec![prefill_router::push::AffinityOutcome::Hit];
        }
        sessions::picked(
            &self.world,
            &sessions::Pick {
                request: id,
                serial: self.serial,
                session,
                routable: &routable,
                tried: dispatch.failed,
                worker,
                outcomes,
            },
        );
        worker
    }

    /// Oracle: no attempt goes to a worker outside the binding's admission set.
    fn check_admission(&self, request: u64, worker: InstanceId) {
        let admitted = self.admitted.borrow().clone();
        if !admitted.contains(&worker) {
            self.world.violate(Violation::DispatchOutsideAdmission {
                request,
                worker,
                target: self.target.clone(),
                admitted,
            });
        }
    }

    /// What `worker` does with attempt `attempt` of request `id`.
    fn draw(&self, id: u64, worker: InstanceId, attempt: u32) -> WorkerPlan {
        // The first attempt keeps the draws it always had; retries draw from their own keys.
        let mut rng = match attempt {
            0 => self.world.keyed(&[STREAM_WORKER, id]),
            n => self.world.keyed(&[STREAM_WORKER, id, u64::from(n)]),
        };
        self.world.with(|s| {
            s.stats.dispatches += 1;
            s.stats.retries += u64::from(attempt > 0);
            if !World::reachable(s, worker) {
                return WorkerPlan::Refused;
            }
            if !s.faults {
                return WorkerPlan::Answer(Duration::from_millis(rng.between(1, 10)));
            }
            match rng.below(100) {
                0..=84 => WorkerPlan::Answer(Duration::from_millis(
                    rng.between(1, timing::PREFILL_MAX_MS),
                )),
                85..=89 => WorkerPlan::Reject,
                90..=93 => {
                    s.stats.crashes += 1;
                    WorkerPlan::Crash(Duration::from_millis(rng.between(1, 20)))
                }
                _ => WorkerPlan::Hang,
            }
        })
    }
}

/// A simulated worker's whole answer to a prefill: the first token, and the handoff.
fn answer(worker: InstanceId, request: &GenerateRequest) -> GenerateResponse {
    let first = request
        .token_ids
        .last()
        .copied()
        .unwrap_or(0)
        .wrapping_add(1);
    GenerateResponse {
        text: None,
        usage: None,
        token_ids: vec![first],
        finish: Some(FinishReason::Length),
        prefill: Some(PrefillInfo {
            engine_params: None,
            worker,
            prompt_tokens: u32::try_from(request.token_ids.len()).unwrap_or(u32::MAX),
            cached_blocks: 0,
            block_size: 16,
        }),
    }
}
