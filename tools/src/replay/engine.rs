//! The replay's request path: a binding factory whose bindings route prefills with the real
//! [`RoutableView`] and [`Dispatcher`] (or pick with the Dynamo and oracle baselines), the
//! dispatcher sending through [`ReplayLink`] to the in-process workers of `link.rs` (a bounded
//! KV block cache and the [`CostModel`]), and a decode hop that streams the output after
//! `decode_per_token` per token.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{self, BoxFuture};
use futures_util::{FutureExt, StreamExt};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use super::cost::CostModel;
use super::external::{ExternalError, ExternalRequest, ExternalRouter, ExternalSetup};
use super::link::{self, request_index, ReplayLink, Served, Shared};
use super::policy::Policy;
use prefill_router::advert::{self, DecodeDefaults};
use prefill_router::binding::TokenLoad;
use prefill_router::binding::{
    Binding, BindingFactory, BuildError, PrefillError, PrefillEstimate, PrefillOutcome,
    PrefillPick, WorkerSetTarget,
};
use prefill_router::decode::{Decode, DecodeError, DecodeStream};
use prefill_router::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use prefill_router::push::select::{Candidate, Choice};
use prefill_router::push::{
    Dispatcher, HeldPick, KvSelector, LoadBoard, PushConfig, PushMode, RoutableView,
};
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse};
use prefill_router::rng::finalize as mix;

/// The prefill endpoint of the replayed pool.
pub(crate) fn prefill_endpoint() -> EndpointId {
    EndpointId::new("replay", "prefill", "generate")
}

/// The discovery record of worker `id` (the address is never dialled: the link delivers
/// in-process).
fn instance(id: InstanceId) -> Instance {
    Instance {
        endpoint: prefill_endpoint(),
        instance_id: id,
        address: link::address(id),
    }
}

/// Builds [`ReplayBinding`]s (at once: the replay studies routing, not build faults).
pub(crate) struct ReplayFactory {
    pub(crate) shared: Arc<Shared>,
    /// Which of the replay's frontends builds with it (its connection as the workers see it).
    pub(crate) frontend: u64,
    /// Whether its bindings start from the workers' KV snapshots (a late-joining frontend's,
    /// policy `kv-events`): every worker's cache in the index before the first pick.
    pub(crate) snapshot: bool,
}

impl BindingFactory for ReplayFactory {
    type Binding = ReplayBinding;

    fn build(
        &self,
        target: WorkerSetTarget,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, Result<ReplayBinding, BuildError>> {
        self.shared.builds.fetch_add(1, Ordering::Relaxed);
        future::ready(ReplayBinding::new(
            Arc::clone(&self.shared),
            self.frontend,
            self.snapshot,
            &target,
            &cancel,
        ))
        .boxed()
    }
}

/// A binding: the real routable view and dispatcher over the replay's workers.
pub(crate) struct ReplayBinding {
    shared: Arc<Shared>,
    view: RoutableView,
    /// Sends every prefill, whichever policy picked it, through [`ReplayLink`].
    push: Arc<Dispatcher<ReplayLink>>,
    /// The scoring rule of the oracle policy (the binding's resolved KV tuning).
    /// With the recent work of the oracle's picks (its bookings are the workers' own).
    oracle: Mutex<(KvSelector, LoadBoard)>,
    /// Ends the view's task when the binding drops.
    view_cancel: CancellationToken,
    /// Uncached prompt tokens picked on this binding and not yet prefilled (the conditional
    /// policy's pool load, as [`PrefillBinding`](prefill_router::binding::PrefillBinding) counts it).
    inflight_tokens: Arc<AtomicU64>,
    /// The router of an external policy (`Policy::External` only), fed the workers' events.
    external: Option<Arc<dyn ExternalRouter>>,
}

impl ReplayBinding {
    fn new(
        shared: Arc<Shared>,
        frontend: u64,
        snapshot: bool,
        target: &WorkerSetTarget,
        cancel: &CancellationToken,
    ) -> Result<Self, BuildError> {
        // The real card resolution, as the default factory does it.
        let config = advert::resolve(
            std::slice::from_ref(&*target.card),
            &DecodeDefaults {
                block_size: shared.block_tokens,
                ..DecodeDefaults::default()
            },
        )
        .map_err(|e| BuildError::new(e.to_string()))?;
        let mode = PushMode::from_prefill_config(&config, None);
        let oracle = KvSelector::new(
            shared.block_tokens,
            &config.kv_router_config.clone().unwrap_or_default(),
            1,
        );
        let view_cancel = cancel.child_token();
        // Discovery is static here: every admitted worker is added once, up front.
        let view = RoutableView::spawn(
            futures_util::stream::pending(),
            Some(target.admitted.clone()),
            view_cancel.clone(),
        );
        for &id in target.admitted.borrow().iter() {
            view.apply(InstanceEvent::Added(instance(id)));
        }
        let config = PushConfig {
            seed: shared.seed,
            overload_wait: shared.overload_wait,
            // No deadline: the replay measures queueing, so a prefill is never cancelled, and
            // an overloaded request waits `overload_wait` exactly.
            request_timeout: None,
            ..PushConfig::default()
        };
        let push = Arc::new_cyclic(|dispatcher| {
            let link = ReplayLink {
                shared: Arc::clone(&shared),
                frontend,
                dispatcher: dispatcher.clone(),
                judged: Mutex::default(),
            };
            Dispatcher::with_link(view.clone(), mode, config, link)
                // A fresh table per binding, as the default factory builds it.
                .with_session_affinity(shared.affinity_ttl, Arc::clone(&shared.affinity))
        });
        if shared.load_reports && shared.policy.chained() {
            // Its connection to every worker, as the workers' ledgers count it.
            shared
                .reporters
                .lock()
                .push((frontend, Arc::downgrade(&push)));
        }
        if shared.policy == Policy::KvEvents {
            // A new binding learns the caches from the workers' next events on.
            shared.subscribers.lock().push(Arc::downgrade(&push));
            if snapshot {
                // Each admitted worker's whole cache, as a connection's snapshot brings it:
                // subscribed first and all in one poll, so no batch falls between the two
                // (batches still in flight to the other frontends are covered by the
                // snapshot's `seq`; later ones follow it by the sequence rule).
                for &id in target.admitted.borrow().iter() {
                    let copy = shared
                        .worker(id)
                        .and_then(|w| w.cache.lock().snapshot_copy());
                    if let Some(copy) = copy {
                        let _ = push.apply_kv_snapshot(id, &copy.into_snapshot());
                    }
                }
            }
        }
        let external = match &shared.external {
            Some(policy) => {
                let setup = ExternalSetup {
                    block_tokens: shared.block_tokens,
                    workers: target.admitted.borrow().iter().copied().collect(),
                    frontend,
                };
                let router = policy
                    .0
                    .router(&setup)
                    .map_err(|e| BuildError::new(e.to_string()))?;
                // Like a kv-events dispatcher, it learns the caches from the next events on.
                shared
                    .external_subscribers
                    .lock()
                    .push(Arc::downgrade(&router));
                Some(router)
            }
            None => None,
        };
        Ok(ReplayBinding {
            shared,
            view,
            push,
            oracle: Mutex::new((oracle, LoadBoard::default())),
            view_cancel,
            inflight_tokens: Arc::default(),
            external,
        })
    }

    /// The oracle: the KV selector's scoring rule (overlap weight, load, tie-break) over the
    /// overlap each routable worker's cache really holds, read directly.
    fn oracle_pick(&self, index: usize) -> Option<InstanceId> {
        let keys = self.shared.keys.get(index)?;
        let mut oracle = self.oracle.lock();
        let (selector, recent) = &mut *oracle;
        let routable = self.view.routable();
        if !recent.has_members(&routable) {
            recent.set_members(Arc::clone(&routable));
        }
        let workers = self.shared.workers.lock();
        let candidates: Vec<Candidate> = routable
            .iter()
            .filter_map(|i| {
                let w = workers.get(&i.instance_id)?;
                let overlap = w.cache.lock().leading_hits(keys);
                let booked = w.booked.load(Ordering::Relaxed);
                Some(
                    Candidate::new(i.instance_id, overlap, booked)
                        .with_recent(recent.recent(i.instance_id)),
                )
            })
            .collect();
        let tokens = u64::from(self.shared.trace.get(index).map_or(0, |r| r.input_length));
        match selector.select_scored(
            keys,
            tokens,
            &candidates,
            mix(self.shared.seed ^ index as u64),
        ) {
            Choice::Picked {
                candidate,
                uncached,
            } => {
                selector.record_credit(keys, candidate.overlap);
                recent.note_work(candidate.id, selector.cost().booking(uncached));
                Some(candidate.id)
            }
            Choice::Overloaded | Choice::Empty => None,
        }
    }

    /// Dynamo's KV-router cost as its routing-concepts docs give it today, at their default
    /// weights: `prefill_load_scale × adjusted prefill blocks + potential decode blocks +
    /// decode_active_request_weight × active requests`, where the adjusted prefill blocks are
    /// the request's blocks not credited by the overlap plus the worker's queued and running
    /// prefill work, and the potential decode blocks the blocks of the requests resident on the
    /// worker; the default request weight and credit decay are 0, so those terms vanish.
    /// Lowest wins (temperature 0). The overlap comes from the worker's real cache (Dynamo's
    /// router is fed by the workers' KV events); ties go to a hash of request and worker.
    ///
    /// Without `pending` (policy `dynamo-blocks`), the earlier reading: no pending prefill term.
    fn dynamo_pick(&self, index: usize, pending: bool) -> Option<InstanceId> {
        const OVERLAP_SCORE_CREDIT: f64 = 1.0;
        const PREFILL_LOAD_SCALE: f64 = 1.0;
        let keys = self.shared.keys.get(index)?;
        let workers = self.shared.workers.lock();
        let blocks = keys.len();
        self.view
            .routable()
            .iter()
            .filter_map(|i| {
                let w = workers.get(&i.instance_id)?;
                let overlap = w.cache.lock().leading_hits(keys);
                #[allow(clippy::cast_precision_loss)] // block counts far below 2^52
                let cost = {
                    let new = blocks as f64 - OVERLAP_SCORE_CREDIT * overlap as f64;
                    let pending = if pending {
                        w.pending_prefill_tokens.load(Ordering::Relaxed) as f64
                            / f64::from(self.shared.block_tokens)
                    } else {
                        0.0
                    };
                    PREFILL_LOAD_SCALE * (new + pending)
                        + w.active_blocks.load(Ordering::Relaxed) as f64
                };
                Some((i.instance_id, cost))
            })
            .min_by(|a, b| {
                a.1.total_cmp(&b.1)
                    .then_with(|| mix(index as u64 ^ a.0).cmp(&mix(index as u64 ^ b.0)))
            })
            .map(|(id, _)| id)
    }
}

impl Drop for ReplayBinding {
    fn drop(&mut self) {
        self.view_cancel.cancel();
    }
}

fn failed(message: String) -> BoxFuture<'static, Result<PrefillOutcome, PrefillError>> {
    future::ready(Err(PrefillError::Failed { message })).boxed()
}

/// What a replay pick holds until its prefill ends: the worker, the dispatcher's selection
/// (the KV load term, moved into the routed stream at the dispatch) and the request's share
/// of the pool's token load.
struct ReplayHeld {
    id: InstanceId,
    /// The uncached tokens the pick expects to compute (under the oracle and the Dynamo
    /// baselines, what it books on the worker until the end).
    uncached: u64,
    /// The dispatcher's pick (`None`: a baseline picked outside it).
    selection: Option<HeldPick>,
    load: TokenLoad,
}

impl ReplayBinding {
    /// Whether the policy picks outside the dispatcher (the Dynamo baselines and the oracle
    /// score the workers' real caches themselves); the dispatcher then only sends.
    fn picks_outside(&self) -> bool {
        matches!(
            self.shared.policy,
            Policy::Dynamo | Policy::DynamoBlocks | Policy::KvOracle | Policy::External
        )
    }

    /// An external policy's prefill: its router picks among the routable workers (booking the
    /// request itself), the dispatcher sends to the pick through the replay's link, and the
    /// router is told when the prefill ended, however it ended.
    fn prefill_external(
        &self,
        router: Arc<dyn ExternalRouter>,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        let failed_with = |e: ExternalError| PrefillError::Failed {
            message: e.to_string(),
        };
        let index = request_index(&request);
        let record = index.and_then(|i| self.shared.trace.get(i));
        let (Some(index), Some(record)) = (index, record) else {
            return failed("request without a trace record".to_owned());
        };
        let asked = ExternalRequest {
            id: index as u64,
            tokens: super::trace::tokens(record, self.shared.unit_tokens),
            prompt_tokens: record.input_length,
            output_tokens: record.output_length,
        };
        let routable: Vec<InstanceId> =
            self.view.routable().iter().map(|i| i.instance_id).collect();
        async move {
            if routable.is_empty() {
                return Err(PrefillError::NoRoutableWorker);
            }
            let id = router
                .select(asked, routable.clone())
                .await
                .map_err(failed_with)?;
            let outcome = if routable.contains(&id) {
                match self.push.generate_direct(id, request).await {
                    Ok(stream) => PrefillOutcome::collect(id, stream).await,
                    Err(error) => Err(error.into()),
                }
            } else {
                Err(failed_with(ExternalError::NotRoutable(id)))
            };
            // Freed whatever the outcome: the router booked it at the pick.
            router.release(index as u64).await.map_err(failed_with)?;
            outcome
        }
        .boxed()
    }

    /// The worker the policy picks for request `index`, the held selection (push-router
    /// policies) and the leading blocks the pick is expected to hold: the selector's overlap
    /// under the KV policies, the worker's real cache under the Dynamo baseline and the
    /// oracle, none under round robin and random.
    fn choose(
        &self,
        index: usize,
        request: &GenerateRequest,
    ) -> Result<(InstanceId, Option<HeldPick>, usize), PrefillError> {
        // Dynamo's baseline scores the workers itself; every other policy is the real push
        // router, whose selection counts as load until the prefill ends.
        let pick = match self.shared.policy {
            Policy::Dynamo => Some(self.dynamo_pick(index, true)),
            Policy::DynamoBlocks => Some(self.dynamo_pick(index, false)),
            Policy::KvOracle => Some(self.oracle_pick(index)),
            // Refused before the run (`ReplayConfig::check_external`): it picks asynchronously.
            Policy::External => {
                return Err(PrefillError::Failed {
                    message: ExternalError::Conditional.to_string(),
                })
            }
            _ => None,
        };
        if let Some(pick) = pick {
            let id = pick.ok_or(PrefillError::NoRoutableWorker)?;
            let held = match (self.shared.worker(id), self.shared.keys.get(index)) {
                (Some(w), Some(keys)) => w.cache.lock().leading_hits(keys),
                _ => 0,
            };
            return Ok((id, None, held));
        }
        let selection = self.push.select_held(request)?;
        let id = selection.instance().instance_id;
        let credited = selection.expected_overlap_blocks();
        self.push.link().judge_pick(index, id, credited);
        let overlap = selection.expected_overlap_blocks().unwrap_or(0);
        Ok((id, Some(selection), overlap))
    }

    /// Send a baseline's pick through the dispatcher's link to its worker, booking the
    /// baseline's load terms there (the oracle's work, Dynamo's pending prefill tokens) until
    /// the prefill ends, as the dispatcher's booking does for its own picks.
    fn prefill_direct(
        &self,
        held: ReplayHeld,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        let ReplayHeld {
            id, uncached, load, ..
        } = held;
        let Some(worker) = self.shared.worker(id) else {
            return failed(format!("worker {id} is not running"));
        };
        let booked = self.oracle.lock().0.cost().booking(uncached);
        worker.booked.fetch_add(booked, Ordering::Relaxed);
        worker
            .pending_prefill_tokens
            .fetch_add(uncached, Ordering::Relaxed);
        async move {
            let outcome = match self.push.generate_direct(id, request).await {
                Ok(stream) => PrefillOutcome::collect(id, stream).await,
                Err(error) => Err(error.into()),
            };
            worker.booked.fetch_sub(booked, Ordering::Relaxed);
            worker
                .pending_prefill_tokens
                .fetch_sub(uncached, Ordering::Relaxed);
            drop(load);
            outcome
        }
        .boxed()
    }
}

impl Binding for ReplayBinding {
    /// The dispatcher's own `generate` (pick, booking, wait for room when every worker is
    /// over the busy threshold, retries elsewhere, release when the stream ends) through
    /// [`ReplayLink`]; a baseline's pick is sent with `generate_direct` through the same link.
    fn prefill(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        if let Some(router) = &self.external {
            return self.prefill_external(Arc::clone(router), request);
        }
        if self.picks_outside() {
            return match self.pick(&request) {
                Ok(pick) => self.prefill_picked(pick, request),
                Err(error) => future::ready(Err(error)).boxed(),
            };
        }
        async move {
            let stream = self.push.generate(request).await?;
            PrefillOutcome::collect(stream.instance_id(), stream).await
        }
        .boxed()
    }

    /// The policy's pick, probed from the trace record (the replay's prompts carry no tokens
    /// under the non-KV policies): its prompt length, the pick's expected cached tokens, and
    /// this binding's in-flight uncached tokens per routable worker.
    fn pick(&self, request: &GenerateRequest) -> Result<PrefillPick, PrefillError> {
        let missing = |what: String| PrefillError::Failed { message: what };
        let index = request_index(request)
            .ok_or_else(|| missing("request without a trace index".to_owned()))?;
        let record = self
            .shared
            .trace
            .get(index)
            .ok_or_else(|| missing(format!("no trace record {index}")))?;
        let (id, selection, cached_blocks) = self.choose(index, request)?;
        let cached = u32::try_from(cached_blocks)
            .unwrap_or(u32::MAX)
            .saturating_mul(self.shared.block_tokens)
            .min(record.input_length);
        let workers = u64::try_from(self.view.routable().len().max(1)).unwrap_or(1);
        let probe = PrefillEstimate {
            prompt_tokens: record.input_length,
            cached_tokens: cached,
            pool_tokens_per_worker: self.inflight_tokens.load(Ordering::Relaxed) / workers,
        };
        let load = TokenLoad::new(&self.inflight_tokens, u64::from(probe.uncached_tokens()));
        let held = ReplayHeld {
            id,
            uncached: u64::from(probe.uncached_tokens()),
            selection,
            load,
        };
        Ok(PrefillPick::new(probe, Some(Box::new(held))))
    }

    /// Dispatches this very pick: the dispatcher's selection through
    /// [`Dispatcher::dispatch_held`] (its booking then lives in the routed stream until the
    /// prefill ends), a baseline's with `generate_direct`.
    fn prefill_picked(
        &self,
        pick: PrefillPick,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        let Some(held) = pick.into_held_as::<ReplayHeld>() else {
            return failed("a pick this binding did not make".to_owned());
        };
        let mut held = *held;
        let Some(selection) = held.selection.take() else {
            return self.prefill_direct(held, request);
        };
        async move {
            let stream = self.push.dispatch_held(selection, request).await?;
            let outcome = PrefillOutcome::collect(held.id, stream).await;
            drop(held.load);
            outcome
        }
        .boxed()
    }
}

/// The decode hop: the first token (prefill's) at once, the rest after `decode_per_token`
/// each, in one response (one timer per request keeps the replay fast). A request that comes
/// without a prefill (the conditional policy skipped it) is prefilled here first, whole: its
/// first token comes after [`CostModel::prefill_time`] of its entire prompt (decode's cache is
/// not modelled, so nothing is cached), slowed by the other local prefills running on the
/// decode pool (spread over as many decode workers as there are prefill workers).
pub(crate) struct ReplayDecode {
    pub(crate) cost: CostModel,
    pub(crate) shared: Arc<Shared>,
    /// Decode workers the local prefills share.
    pub(crate) workers: usize,
    /// Local prefills running on the decode pool.
    pub(crate) local: Arc<AtomicUsize>,
}

impl ReplayDecode {
    /// Prefill request `index` on the decode pool, whole; record what it found (nothing).
    async fn prefill_locally(&self, index: usize) {
        let Some(record) = self.shared.trace.get(index) else {
            return;
        };
        let running = self.local.fetch_add(1, Ordering::Relaxed) / self.workers.max(1);
        tokio::time::sleep(self.cost.prefill_time(record.input_length, running)).await;
        self.local.fetch_sub(1, Ordering::Relaxed);
        if let Some(slot) = self.shared.served.lock().get_mut(index) {
            *slot = Some(Served {
                blocks: u32::try_from(self.shared.keys.get(index).map_or(0, Vec::len))
                    .unwrap_or(u32::MAX),
                hits: 0,
                queue: Duration::ZERO,
                local: true,
            });
        }
    }
}
impl Decode for ReplayDecode {
    fn decode(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        let skipped = prefill.is_none();
        let first = GenerateResponse {
            text: None,
            usage: None,
            token_ids: prefill.map_or_else(|| vec![1], |p| p.tokens),
            finish: (request.max_tokens <= 1).then_some(FinishReason::Length),
            prefill: request.handoff.clone(),
        };
        let rest = request.max_tokens.saturating_sub(1);
        let delay = self.cost.decode_time(request.max_tokens);
        let tail =
            futures_util::stream::iter((rest > 0).then_some(())).then(move |()| async move {
                tokio::time::sleep(delay).await;
                Ok(GenerateResponse {
                    text: None,
                    usage: None,
                    token_ids: vec![0; rest as usize],
                    finish: Some(FinishReason::Length),
                    prefill: None,
                })
            });
        let stream = futures_util::stream::iter([Ok(first)]).chain(tail);
        let index = request_index(&request).filter(|_| skipped);
        async move {
            if let Some(index) = index {
                self.prefill_locally(index).await;
            }
            Ok(Box::pin(stream) as DecodeStream)
        }
        .boxed()
    }
}
