//! The replay's request plane: the in-process prefill workers, and the [`WorkerLink`] each
//! binding's real [`Dispatcher`] sends through to them. The dispatcher picks, books, retries
//! elsewhere and releases exactly as in production; the link only carries an attempt to its
//! worker, which queues for a batch slot, looks the prompt up in its KV cache (publishing the
//! cache's changes), computes the rest in tokio's virtual time and answers with the first
//! token and the [`PrefillInfo`] handoff.
//!
//! The stale-credit oracle of `kv-events` runs in [`WorkerLink::open`], in the poll of the
//! pick it judges, on the overlap the [`Dispatch`] says the selector credited; a pick made
//! ahead of its dispatch (conditional disaggregation's probe) is judged when it is made
//! instead, since its credit also steers the skip decision, dispatched or not.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_core::Stream;
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::cost::CostModel;
use super::external::{self, External, ExternalKvEvent, ExternalRouter};
use super::policy::Policy;
use super::trace::TraceRecord;
use crate::mock::BlockCache;
use prefill_router::discovery::InstanceId;
use prefill_router::kv_events::EventBatch;
use prefill_router::load_report::LoadLedger;
use prefill_router::push::AffinityCounts;
use prefill_router::push::{Dispatch, Dispatcher, WorkerLink};
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse, PrefillInfo};
use prefill_router::transport::{RemoteError, TransportError};

/// What one prefill found and cost.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Served {
    pub(crate) blocks: u32,
    pub(crate) hits: u32,
    /// From arrival at the worker to the start of its prefill.
    pub(crate) queue: Duration,
    /// Prefilled on the decode pool (the conditional policy skipped the hop).
    pub(crate) local: bool,
}

/// One prefill worker: its KV cache, its batch slots and its counters.
#[derive(Debug)]
pub(crate) struct Worker {
    pub(super) cache: Mutex<BlockCache>,
    slots: Semaphore,
    running: AtomicUsize,
    /// Blocks of the requests queued or running here (the "active blocks" of Dynamo's cost).
    pub(super) active_blocks: AtomicU64,
    /// Uncached prompt tokens of the requests the oracle picked for this worker and not yet
    /// prefilled (its load term, as the dispatcher's bookings are the KV policies').
    pub(super) booked: AtomicU64,
    /// Uncached prompt tokens of the requests the Dynamo baselines picked for this worker and
    /// not yet prefilled, without any per-request booking (the active prefill work of Dynamo's
    /// cost).
    pub(super) pending_prefill_tokens: AtomicU64,
    /// Uncached prompt tokens computed here: the prefill work.
    pub(crate) prefill_tokens: AtomicU64,
    /// The prefill work of each frontend's requests here, for the load reports.
    ledger: Mutex<LoadLedger>,
}

/// A prefill's share of its worker's occupancy, given back when the prefill ends or is
/// cancelled (a deadline dropped it).
struct Occupancy<'a> {
    worker: &'a Worker,
    blocks: u64,
    running: bool,
}

impl Drop for Occupancy<'_> {
    fn drop(&mut self) {
        if self.running {
            self.worker.running.fetch_sub(1, Ordering::Relaxed);
        }
        self.worker
            .active_blocks
            .fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

impl Worker {
    /// A worker whose cache publishes KV events of incarnation `epoch` when `epoch` is set.
    pub(crate) fn new(cache_blocks: usize, max_batch: usize, epoch: Option<u64>) -> Self {
        let cache = match epoch {
            Some(epoch) => BlockCache::with_events(cache_blocks, epoch),
            None => BlockCache::new(cache_blocks),
        };
        Worker {
            cache: Mutex::new(cache),
            slots: Semaphore::new(max_batch.max(1)),
            running: AtomicUsize::new(0),
            active_blocks: AtomicU64::new(0),
            booked: AtomicU64::new(0),
            pending_prefill_tokens: AtomicU64::new(0),
            prefill_tokens: AtomicU64::new(0),
            ledger: Mutex::new(LoadLedger::new()),
        }
    }

    /// Queue for a batch slot, look the prompt's block `keys` up in the cache (holding them
    /// from then on, and publishing the cache's changes to `shared`'s subscribers as worker
    /// `id`), and compute the rest.
    async fn serve(
        &self,
        id: InstanceId,
        record: &TraceRecord,
        keys: &[u64],
        shared: &Shared,
    ) -> Served {
        let cost = &shared.cost;
        let blocks = keys.len() as u64;
        self.active_blocks.fetch_add(blocks, Ordering::Relaxed);
        let mut occupancy = Occupancy {
            worker: self,
            blocks,
            running: false,
        };
        let queued = Instant::now();
        // The semaphore lives as long as the worker and is never closed.
        let permit = self.slots.acquire().await.ok();
        let queue = queued.elapsed();
        let (hits, batches) = {
            let mut cache = self.cache.lock();
            let hits = cache.prefill(keys);
            (hits, cache.take_event_batches())
        };
        shared.publish(id, batches, keys, record);
        let hits = u32::try_from(hits).unwrap_or(u32::MAX);
        let uncached = record
            .input_length
            .saturating_sub(hits.saturating_mul(shared.block_tokens));
        let running = self.running.fetch_add(1, Ordering::Relaxed);
        occupancy.running = true;
        tokio::time::sleep(cost.prefill_time(uncached, running)).await;
        drop(occupancy);
        self.prefill_tokens
            .fetch_add(u64::from(uncached), Ordering::Relaxed);
        drop(permit);
        Served {
            blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
            hits,
            queue,
            local: false,
        }
    }
}

/// The responses of one replayed prefill: one item, the first token with its handoff.
pub(crate) type ReplayStream =
    Pin<Box<dyn Stream<Item = Result<GenerateResponse, TransportError>> + Send>>;

/// One binding's in-memory link to the replay's workers.
pub(crate) struct ReplayLink {
    pub(crate) shared: Arc<Shared>,
    /// The frontend whose binding sends through this link (its connection in the workers'
    /// load ledgers).
    pub(crate) frontend: u64,
    /// The dispatcher sending through this link (its KV index, for the stale-credit oracle);
    /// weak, since the dispatcher owns the link.
    pub(crate) dispatcher: Weak<Dispatcher<ReplayLink>>,
    /// Requests whose pick was judged when it was made ([`judge_pick`](Self::judge_pick)),
    /// so their dispatch is not judged again. A skipped pick's entry stays: at most one per
    /// request of the run.
    pub(crate) judged: Mutex<HashSet<usize>>,
}

impl WorkerLink for ReplayLink {
    type Stream = ReplayStream;

    fn open(
        &self,
        dispatch: Dispatch<'_>,
        request: GenerateRequest,
        deadline: Option<Instant>,
    ) -> impl std::future::Future<Output = Result<ReplayStream, TransportError>> + Send {
        // All of it now, in the pick's poll: the oracle judges the cache the pick saw, and the
        // worker's queue sees the request arrive at once (there is no wire).
        std::future::ready(self.send(&dispatch, &request, deadline))
    }
}

impl ReplayLink {
    /// Judge the pick's credit, then start the prefill on the picked worker.
    fn send(
        &self,
        dispatch: &Dispatch<'_>,
        request: &GenerateRequest,
        deadline: Option<Instant>,
    ) -> Result<ReplayStream, TransportError> {
        let id = dispatch.instance.instance_id;
        let rejected = |message: String| TransportError::Remote(RemoteError::Engine { message });
        let index = request_index(request)
            .ok_or_else(|| rejected("request without a trace index".to_owned()))?;
        let shared = Arc::clone(&self.shared);
        if shared.trace.get(index).is_none() || shared.keys.get(index).is_none() {
            return Err(rejected(format!("no trace record {index}")));
        }
        // A worker the replay never started refuses the connection, as a real one would.
        let worker = shared.worker(id).ok_or_else(|| TransportError::Connect {
            addr: dispatch.instance.address,
            reason: format!("worker {id} is not running"),
        })?;
        if shared.policy == Policy::KvEvents && !self.judged.lock().remove(&index) {
            self.check_credit(index, id, dispatch.expected_overlap_blocks);
        }
        let held = shared.load_reports.then(|| {
            // The worker's own measure of the work: the prompt past its cached prefix.
            let hits = worker.cache.lock().leading_hits(&shared.keys[index]) as u64;
            let tokens = u64::from(shared.trace[index].input_length)
                .saturating_sub(hits * u64::from(shared.block_tokens));
            // A retry of the same request on the same worker is refused and counts once.
            let _ = worker
                .ledger
                .lock()
                .start(self.frontend, index as u64, tokens);
            shared.report_load(id, &worker);
            HeldWork {
                shared: Arc::clone(&shared),
                worker: Arc::clone(&worker),
                id,
                frontend: self.frontend,
                request: index as u64,
            }
        });
        let prefill = async move {
            let record = &shared.trace[index];
            let served = worker.serve(id, record, &shared.keys[index], &shared).await;
            // The prefill is done: its work leaves the worker's reports.
            drop(held);
            if let Some(slot) = shared.served.lock().get_mut(index) {
                *slot = Some(served);
            }
            Ok(GenerateResponse {
                text: None,
                usage: None,
                token_ids: vec![1],
                finish: Some(FinishReason::Length),
                prefill: Some(PrefillInfo {
                    engine_params: None,
                    worker: id,
                    prompt_tokens: record.input_length,
                    cached_blocks: served.hits,
                    block_size: shared.block_tokens,
                }),
            })
        };
        let item = async move {
            match deadline {
                Some(d) => tokio::time::timeout_at(d, prefill)
                    .await
                    .unwrap_or(Err(TransportError::Timeout)),
                None => prefill.await,
            }
        };
        Ok(Box::pin(futures_util::stream::once(item)))
    }

    /// The stale-credit oracle on a pick of request `index` made ahead of its dispatch, now:
    /// the dispatch will not be judged again.
    pub(crate) fn judge_pick(&self, index: usize, id: InstanceId, credited: Option<usize>) {
        if self.shared.policy == Policy::KvEvents {
            self.check_credit(index, id, credited);
            self.judged.lock().insert(index);
        }
    }

    /// The stale-credit oracle of `kv-events`: the index credited worker `id` with `credited`
    /// leading blocks of request `index`; the worker's cache must hold at least that many now
    /// (a prediction's credit, for a worker that has not published yet, is not checked).
    fn check_credit(&self, index: usize, id: InstanceId, credited: Option<usize>) {
        let (Some(credited), Some(keys)) = (credited, self.shared.keys.get(index)) else {
            return;
        };
        let Some(dispatcher) = self.dispatcher.upgrade() else {
            return;
        };
        if credited == 0 || !dispatcher.kv_indexed(id) {
            return;
        }
        let held = self
            .shared
            .worker(id)
            .map_or(0, |w| w.cache.lock().leading_hits(keys));
        if credited > held {
            self.shared.stale_credit.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A request's prefill work in its worker's load ledger, finished (and reported) when dropped:
/// when the prefill completes or its stream is dropped.
struct HeldWork {
    shared: Arc<Shared>,
    worker: Arc<Worker>,
    id: InstanceId,
    frontend: u64,
    request: u64,
}

impl Drop for HeldWork {
    fn drop(&mut self) {
        self.worker
            .ledger
            .lock()
            .finish(self.frontend, self.request);
        self.shared.report_load(self.id, &self.worker);
    }
}

/// The discovery address of worker `id` (never dialled: the link delivers in-process).
pub(crate) fn address(id: InstanceId) -> SocketAddr {
    SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, 40_000 + (id % 20_000) as u16))
}

/// The request index the replay writes into `GenerateRequest::request_id` (the session key
/// is left to session affinity).
pub(crate) fn request_index(request: &GenerateRequest) -> Option<usize> {
    request.request_id.and_then(|i| usize::try_from(i).ok())
}

/// What every binding of one replay shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) trace: Arc<[TraceRecord]>,
    /// Per request, the block keys the workers' caches use: the router's chained block hashes
    /// under the KV policies, the trace's hash ids otherwise.
    pub(crate) keys: Vec<Vec<u64>>,
    /// The dispatchers fed the workers' KV events (policy `kv-events`).
    pub(crate) subscribers: Mutex<Vec<Weak<Dispatcher<ReplayLink>>>>,
    /// Every how many event batches one is lost (0: none).
    pub(crate) event_loss_every: u64,
    /// How long an event batch takes to reach the dispatchers.
    pub(crate) event_delay: Duration,
    /// Event batches published so far (numbers the losses).
    pub(crate) batches: AtomicU64,
    /// Selections that credited the pick with blocks its cache did not hold.
    pub(crate) stale_credit: AtomicU64,
    pub(crate) cost: CostModel,
    pub(crate) policy: Policy,
    pub(crate) seed: u64,
    pub(crate) cache_blocks: usize,
    /// Tokens per KV block of the router and the workers.
    pub(crate) block_tokens: u32,
    /// Tokens per `hash_ids` entry of the trace.
    pub(crate) unit_tokens: u32,
    /// The policy of `Policy::External` (`None` under every other policy).
    pub(crate) external: Option<External>,
    /// The external routers fed the workers' KV events (one per binding).
    pub(crate) external_subscribers: Mutex<Vec<Weak<dyn ExternalRouter>>>,
    pub(crate) workers: Mutex<BTreeMap<InstanceId, Arc<Worker>>>,
    /// Per request index, what its prefill found.
    pub(crate) served: Mutex<Vec<Option<Served>>>,
    /// Bindings the factory built (a flap that reuses the binding builds none).
    pub(crate) builds: AtomicU64,
    /// The session-affinity TTL each binding's dispatcher gets (`None`: off).
    pub(crate) affinity_ttl: Option<Duration>,
    /// How long a request waits for room when every worker is over the busy threshold.
    pub(crate) overload_wait: Duration,
    /// Affinity outcomes over every binding.
    pub(crate) affinity: Arc<AffinityCounts>,
    /// Whether workers send load reports to the frontends' dispatchers.
    pub(crate) load_reports: bool,
    /// How long a load report takes to reach a dispatcher.
    pub(crate) report_delay: Duration,
    /// The dispatchers that receive load reports, each with its frontend (its connection id in
    /// the workers' ledgers).
    pub(crate) reporters: Mutex<Vec<(u64, Weak<Dispatcher<ReplayLink>>)>>,
}

impl Shared {
    pub(crate) fn add_workers(&self, ids: impl IntoIterator<Item = InstanceId>) {
        let epoch = self.policy.publishes().then_some(1);
        let mut workers = self.workers.lock();
        for id in ids {
            workers.insert(
                id,
                Arc::new(Worker::new(self.cache_blocks, self.cost.max_batch, epoch)),
            );
        }
    }

    /// Deliver worker `id`'s event batches (of the prefill of `record`, whose block keys are
    /// `keys`) to every live subscribed dispatcher and external router, after the configured
    /// delay and minus the configured losses.
    pub(super) fn publish(
        &self,
        id: InstanceId,
        batches: Vec<EventBatch>,
        keys: &[u64],
        record: &TraceRecord,
    ) {
        let mut kept = Vec::with_capacity(batches.len());
        for batch in batches {
            let n = self.batches.fetch_add(1, Ordering::Relaxed) + 1;
            if self.event_loss_every == 0 || n % self.event_loss_every != 0 {
                kept.push(batch);
            }
        }
        if kept.is_empty() {
            return;
        }
        let dispatchers: Vec<Arc<Dispatcher<ReplayLink>>> = {
            let mut subscribers = self.subscribers.lock();
            subscribers.retain(|d| d.strong_count() > 0);
            subscribers.iter().filter_map(Weak::upgrade).collect()
        };
        let routers: Vec<Arc<dyn ExternalRouter>> = {
            let mut subscribers = self.external_subscribers.lock();
            subscribers.retain(|r| r.strong_count() > 0);
            subscribers.iter().filter_map(Weak::upgrade).collect()
        };
        // The external routers' copy, with each stored block's tokens (converted only when
        // someone listens: the tokens cost a copy per block).
        let external: Vec<ExternalKvEvent> = if routers.is_empty() {
            Vec::new()
        } else {
            let tokens = super::trace::tokens(record, self.unit_tokens);
            let events: Vec<_> = kept.iter().flat_map(|b| b.events.clone()).collect();
            external::convert(&events, keys, &tokens, self.block_tokens as usize)
        };
        let deliver = move || {
            for dispatcher in &dispatchers {
                for batch in &kept {
                    dispatcher.apply_kv_events(id, batch);
                }
            }
            for router in &routers {
                router.apply_events(id, &external);
            }
        };
        if self.event_delay.is_zero() {
            deliver();
        } else {
            let delay = self.event_delay;
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                deliver();
            });
        }
    }

    /// Send worker `id`'s load report to every reporting dispatcher whose view of it changed
    /// (each is told the work of the other frontends only), after the configured delay.
    fn report_load(&self, id: InstanceId, worker: &Worker) {
        let reporters: Vec<(u64, Arc<Dispatcher<ReplayLink>>)> = {
            let mut reporters = self.reporters.lock();
            reporters.retain(|(_, d)| d.strong_count() > 0);
            reporters
                .iter()
                .filter_map(|(f, d)| Some((*f, d.upgrade()?)))
                .collect()
        };
        let reports: Vec<_> = {
            let mut ledger = worker.ledger.lock();
            reporters
                .into_iter()
                .filter_map(|(frontend, dispatcher)| {
                    ledger.open(frontend);
                    Some((dispatcher, ledger.report_for(frontend)?))
                })
                .collect()
        };
        if reports.is_empty() {
            return;
        }
        let deliver = move || {
            for (dispatcher, report) in &reports {
                dispatcher.apply_load_report(id, *report);
            }
        };
        if self.report_delay.is_zero() {
            deliver();
        } else {
            let delay = self.report_delay;
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                deliver();
            });
        }
    }

    pub(super) fn worker(&self, id: InstanceId) -> Option<Arc<Worker>> {
        self.workers.lock().get(&id).cloned()
    }
}
