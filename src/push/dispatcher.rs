//! The dispatcher.

mod booking;
mod link;
mod routed;
mod sessions;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::affinity::{AffinityCounts, AffinityOutcome, AffinityStats, AffinityTable};
use super::error::{Attempt, PushError, RetryCounts};
use super::kv::{block_hashes, mix, KvSelector};
use super::kv_feed::{KvEventCounts, KvFeed};
use super::select::Choice;
use super::view::{InstanceStatus, RoutableView};
use crate::advert::{KvRouterConfig, PrefillConfig, SelectionMode};
use crate::discovery::{Instance, InstanceId};
use crate::health::{BackoffPolicy, FailureClass};
use crate::hooks::DispatchHooks;
use crate::kv_events::{Applied, EventBatch};
use crate::transport::{ClientConfig, GenerateRequest, TransportError};
use booking::{Booking, Bookings};
pub use booking::{OverloadCounts, OverloadStats};
pub use link::{Dispatch, TcpLink, WorkerLink};
use routed::classify;
pub use routed::{HeldPick, RoutedStream};

/// How the router picks an instance.
#[derive(Clone, Debug, PartialEq)]
pub enum PushMode {
    /// Rotate over the routable instances in id order.
    RoundRobin,
    /// Pick uniformly at random.
    Random,
    /// Always the named instance.
    Direct(InstanceId),
    /// Prefix-aware: prefer the worker that already prefilled the request's leading blocks.
    Kv {
        /// KV block size in tokens.
        block_size: u32,
        /// Weights and temperature.
        config: KvRouterConfig,
    },
}

impl PushMode {
    /// The mode a resolved prefill configuration asks for. `SelectionMode::Direct` needs a
    /// target, given as `direct`; without one it falls back to round robin (callers then name
    /// the worker per request with [`Dispatcher::generate_direct`]).
    pub fn from_prefill_config(config: &PrefillConfig, direct: Option<InstanceId>) -> Self {
        match config.router_mode {
            SelectionMode::RoundRobin => PushMode::RoundRobin,
            SelectionMode::Random => PushMode::Random,
            SelectionMode::Direct => direct.map_or(PushMode::RoundRobin, PushMode::Direct),
            SelectionMode::KV => PushMode::Kv {
                block_size: config.block_size,
                config: config.kv_router_config.clone().unwrap_or_default(),
            },
        }
    }
}

/// Router settings.
#[derive(Clone, Debug)]
pub struct PushConfig {
    /// Deadline of each request, from the call to `generate` to the end of its stream.
    pub request_timeout: Option<Duration>,
    /// Per-connection client settings.
    pub client: ClientConfig,
    /// Block chains the KV selector remembers.
    pub kv_capacity: usize,
    /// Seed of the `Random` mode and of KV sampling (deterministic runs in tests).
    pub seed: u64,
    /// Backoff between probes of an instance whose breaker opened (docs/health.md). The
    /// breakers live in the [`RoutableView`], so this applies where the view is built from this
    /// configuration ([`RoutableView::spawn_with`], as the binding factory does).
    pub health: BackoffPolicy,
    /// How many times [`Dispatcher::generate`] may retry a request on another worker after a
    /// failure that is not the request's own fault ([`FailureClass::retry_elsewhere`]) and came
    /// before the worker produced any output (default 2, so at most 3 attempts; 0 disables
    /// retries). No attempt starts past the request's deadline. See docs/health.md.
    pub retry_budget: u32,
    /// Most sessions a dispatcher's session-affinity table remembers (least recently used
    /// evicted first; 0 disables affinity). Default [`DEFAULT_AFFINITY_CAPACITY`].
    ///
    /// [`DEFAULT_AFFINITY_CAPACITY`]: super::DEFAULT_AFFINITY_CAPACITY
    pub affinity_capacity: usize,
    /// How long a request that finds every routable worker over the busy threshold waits for
    /// room before it fails with [`PushError::Overloaded`] (never past its deadline; default
    /// 2 s; zero fails at once).
    pub overload_wait: Duration,
    /// Most requests waiting for room at once; one more fails with [`PushError::Overloaded`]
    /// at once (default 1,024).
    pub overload_queue: usize,
}

impl Default for PushConfig {
    fn default() -> Self {
        PushConfig {
            request_timeout: Some(Duration::from_secs(30)),
            client: ClientConfig::default(),
            kv_capacity: 1 << 20,
            seed: 0x5eed,
            health: BackoffPolicy::default(),
            retry_budget: 2,
            affinity_capacity: super::DEFAULT_AFFINITY_CAPACITY,
            overload_wait: Duration::from_secs(2),
            overload_queue: 1024,
        }
    }
}

/// No busy threshold, in [`Dispatcher`]'s atomic.
const NO_THRESHOLD: u64 = u64::MAX;

/// Routes requests to instances of a [`RoutableView`], sending them through its link `L`: the
/// request plane ([`TcpLink`]) unless built [`with_link`](Dispatcher::with_link). Share it
/// behind an `Arc`; all methods take `&self`.
pub struct Dispatcher<L = TcpLink> {
    view: RoutableView,
    mode: PushMode,
    config: PushConfig,
    /// How an attempt reaches its worker (see [`WorkerLink`]).
    link: L,
    next: AtomicUsize,
    rng: AtomicU64,
    kv: Option<Arc<Mutex<KvSelector>>>,
    /// The workers' KV event streams into `kv` (KV mode only).
    kv_feed: Option<Arc<KvFeed>>,
    /// Prefill work booked per instance, ordered by load over the routable set (kept in KV
    /// mode only, where it is the load term), and the requests waiting for room.
    loads: Arc<Bookings>,
    /// Busy threshold in booked tokens ([`NO_THRESHOLD`]: none).
    busy_threshold: AtomicU64,
    overload: Arc<OverloadCounts>,
    retries: Arc<RetryCounts>,
    /// Where the mutant whose retries reuse the failed worker breaks the pick; zero-sized in
    /// normal builds.
    hooks: DispatchHooks,
    /// Session → worker, while younger than the binding's TTL (`None`: no affinity).
    affinity: Option<Arc<AffinityTable>>,
}

/// What a pick chooses from: the view's shared routable set, that set minus the excluded
/// workers, and the excluded workers.
pub(super) type Candidates<'a> = (
    &'a Arc<[Arc<Instance>]>,
    &'a [Arc<Instance>],
    &'a [InstanceId],
);

/// One pick: the instance, the KV overlap expected there, how affinity decided it.
pub(super) struct Pick {
    pub(super) instance: Arc<Instance>,
    pub(super) overlap: Option<usize>,
    pub(super) affinity: Option<AffinityOutcome>,
    /// The work booked on the instance by this pick (KV mode), released when dropped.
    pub(super) booking: Option<Booking>,
}

impl<L> std::fmt::Debug for Dispatcher<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("mode", &self.mode)
            .field("view", &self.view)
            .finish()
    }
}

impl Dispatcher<TcpLink> {
    /// A router over `view` in `mode`, sending over the request plane (in KV mode its
    /// connections also carry the workers' KV events into the selector).
    pub fn new(view: RoutableView, mode: PushMode, config: PushConfig) -> Self {
        let client = config.client.clone();
        Self::build(view, mode, config, |view, feed| {
            TcpLink::new(client, view.clone(), feed.cloned())
        })
    }

    /// A dispatcher running the mutant that keeps a worker's KV index entries across a
    /// reconnect or a closed connection.
    #[cfg(test)]
    pub(crate) fn with_keep_kv_on_reconnect_mutant(mut self) -> Self {
        self.hooks = DispatchHooks::keep_kv_on_reconnect();
        self.kv_feed = self
            .kv
            .as_ref()
            .map(|kv| Arc::new(KvFeed::new(Arc::clone(kv), self.view.clone(), self.hooks)));
        self.link.set_kv_feed(self.kv_feed.clone());
        self
    }
}

impl<L: WorkerLink> Dispatcher<L> {
    /// A router over `view` in `mode` that sends through `link` (an in-memory transport, as
    /// the simulator's). The link carries no KV events: feed them with
    /// [`apply_kv_events`](Self::apply_kv_events).
    pub fn with_link(view: RoutableView, mode: PushMode, config: PushConfig, link: L) -> Self {
        Self::build(view, mode, config, |_, _| link)
    }

    fn build(
        view: RoutableView,
        mode: PushMode,
        config: PushConfig,
        link: impl FnOnce(&RoutableView, Option<&Arc<KvFeed>>) -> L,
    ) -> Self {
        let threshold = match &mode {
            PushMode::Kv { config: kv, .. } => kv.busy_threshold_tokens,
            _ => None,
        };
        let kv = match &mode {
            PushMode::Kv {
                block_size,
                config: kv,
            } => Some(Arc::new(Mutex::new(KvSelector::new(
                *block_size,
                kv,
                config.kv_capacity,
            )))),
            _ => None,
        };
        let hooks = DispatchHooks::default();
        let kv_feed = kv
            .as_ref()
            .map(|kv| Arc::new(KvFeed::new(Arc::clone(kv), view.clone(), hooks)));
        let link = link(&view, kv_feed.as_ref());
        Dispatcher {
            rng: AtomicU64::new(config.seed),
            view,
            mode,
            config,
            link,
            next: AtomicUsize::new(0),
            kv,
            kv_feed,
            loads: Arc::default(),
            busy_threshold: AtomicU64::new(threshold.unwrap_or(NO_THRESHOLD)),
            overload: Arc::default(),
            retries: Arc::default(),
            hooks,
            affinity: None,
        }
    }

    /// Turn on session affinity: a request with a session key goes to the worker its session
    /// last went to while that was less than `ttl` ago and the worker is still routable
    /// (`None`: no affinity, as when [`PushConfig::affinity_capacity`] is 0). Counted in
    /// `counts` (shared, e.g. by every binding of one factory). `Direct` mode ignores it.
    #[must_use]
    pub fn with_session_affinity(self, ttl: Option<Duration>, counts: Arc<AffinityCounts>) -> Self {
        let capacity = self.config.affinity_capacity;
        let table = ttl
            .filter(|_| capacity > 0)
            .map(|ttl| Arc::new(AffinityTable::new(ttl, capacity, counts)));
        self.with_affinity_table(table)
    }

    /// Use `table` as this dispatcher's session-affinity table (`None`: no affinity), in place
    /// of the fresh one [`with_session_affinity`](Self::with_session_affinity) makes (the
    /// factory's hook and the simulator decide which).
    #[must_use]
    pub fn with_affinity_table(mut self, table: Option<Arc<AffinityTable>>) -> Self {
        self.affinity = table;
        self
    }

    /// This dispatcher's affinity table, if affinity is on.
    pub(crate) fn affinity_table(&self) -> Option<&Arc<AffinityTable>> {
        self.affinity.as_ref()
    }

    /// The session-affinity TTL (`None`: no affinity).
    pub fn session_affinity_ttl(&self) -> Option<Duration> {
        self.affinity.as_ref().map(|t| t.ttl())
    }

    /// Sessions remembered now (expired entries not yet collected included; never above
    /// [`PushConfig::affinity_capacity`]).
    pub fn affinity_len(&self) -> usize {
        self.affinity.as_ref().map_or(0, |t| t.len())
    }

    /// The affinity counters (shared ones, if the dispatcher was given shared counts).
    pub fn affinity_stats(&self) -> AffinityStats {
        self.affinity
            .as_ref()
            .map(|t| t.counts().snapshot())
            .unwrap_or_default()
    }

    /// Count this dispatcher's retries in `counts` (shared, e.g. by every binding of one
    /// factory) instead of its own.
    #[must_use]
    pub fn with_retry_counts(mut self, counts: Arc<RetryCounts>) -> Self {
        self.retries = counts;
        self
    }

    /// The retries this dispatcher counted, by the class of the failure that caused them.
    pub fn retry_counts(&self) -> &Arc<RetryCounts> {
        &self.retries
    }

    /// A dispatcher running the mutant whose retries may pick the worker that just failed.
    #[cfg(test)]
    pub(crate) fn with_reuse_failed_mutant(mut self) -> Self {
        self.hooks = DispatchHooks::reuse_failed();
        self
    }

    /// A dispatcher running the mutant whose session affinity sends a session to its
    /// remembered worker even when that is no longer routable.
    #[cfg(test)]
    pub(crate) fn with_affinity_ignores_routable_mutant(mut self) -> Self {
        self.hooks = DispatchHooks::affinity_ignores_routable();
        self
    }

    /// What the workers' KV event streams delivered (`None` when not in KV mode).
    pub fn kv_event_counts(&self) -> Option<&Arc<KvEventCounts>> {
        self.kv_feed.as_ref().map(|feed| feed.counts())
    }

    /// The view this router picks from.
    pub fn view(&self) -> &RoutableView {
        &self.view
    }

    /// The router's mode.
    pub fn mode(&self) -> &PushMode {
        &self.mode
    }

    /// The busy threshold in booked prefill tokens (KV mode; `None`: none).
    pub fn busy_threshold(&self) -> Option<u64> {
        match self.busy_threshold.load(Ordering::Relaxed) {
            NO_THRESHOLD => None,
            t => Some(t),
        }
    }

    /// Change the busy threshold at runtime (`None`: none); waiting requests re-check at once.
    pub fn set_busy_threshold(&self, threshold: Option<u64>) {
        self.busy_threshold
            .store(threshold.unwrap_or(NO_THRESHOLD), Ordering::Relaxed);
        self.loads.wake_all();
    }

    /// The prefill work (uncached prompt tokens) booked on `worker` now (KV mode; 0 otherwise).
    pub fn booked_work(&self, worker: InstanceId) -> u64 {
        self.loads.board().load(worker)
    }

    /// The prefill work booked over every worker now (0 once every booking was released).
    pub fn total_booked_work(&self) -> u64 {
        self.loads.board().total()
    }

    /// Requests waiting for room now (every routable worker over the busy threshold).
    pub fn overload_waiting(&self) -> usize {
        self.loads.waiting()
    }

    /// The overload counters.
    pub fn overload_counts(&self) -> &Arc<OverloadCounts> {
        &self.overload
    }

    /// Count this dispatcher's overloads in `counts` (shared, e.g. by every binding of one
    /// factory) instead of its own.
    #[must_use]
    pub fn with_overload_counts(mut self, counts: Arc<OverloadCounts>) -> Self {
        self.overload = counts;
        self
    }

    /// Booked work, waiters and the overload counters, now.
    pub fn overload_stats(&self) -> OverloadStats {
        OverloadStats {
            booked_tokens: self.total_booked_work(),
            waiting: self.overload_waiting() as u64,
            queued: self.overload.queued.load(Ordering::Relaxed),
            shed: self.overload.shed.load(Ordering::Relaxed),
        }
    }

    /// A dispatcher whose board runs `board` (the tests' mutant boards).
    #[cfg(test)]
    pub(crate) fn with_board(mut self, board: super::LoadBoard) -> Self {
        self.loads = Arc::new(Bookings::with_board(board));
        self
    }

    /// The selector in KV mode, for the tests' mutants.
    #[cfg(test)]
    pub(crate) fn map_kv(self, f: impl FnOnce(KvSelector) -> KvSelector) -> Self {
        if let Some(kv) = &self.kv {
            let mut guard = kv.lock();
            let taken = std::mem::replace(
                &mut *guard,
                KvSelector::new(1, &KvRouterConfig::default(), 1),
            );
            *guard = f(taken);
        }
        self
    }

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
                // The view hands out one shared set until it changes: re-sync the board's
                // members, and drop indexed workers that left, only then (O(pool) per change,
                // O(1) per request).
                if !board.has_members(all) {
                    board.set_members(Arc::clone(all));
                    self.prune_kv_index(&mut kv.lock());
                }
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
                kv.record_credit(&hashes, candidate.overlap);
                let booked = kv.cost().booking(uncached);
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

    fn direct_target(&self, id: InstanceId) -> Result<Arc<Instance>, PushError> {
        match self.view.status(id) {
            InstanceStatus::Routable(instance) => Ok(instance),
            InstanceStatus::Unknown => Err(PushError::InstanceGone(id)),
            InstanceStatus::NotAdmitted | InstanceStatus::Unhealthy(_) => {
                Err(PushError::DirectTargetNotRoutable(id))
            }
        }
    }

    /// Route `request` per the mode and stream its responses.
    ///
    /// A failure before the worker produced any output (sending, or the first stream item an
    /// error) whose class may be retried elsewhere ([`FailureClass::retry_elsewhere`]) is
    /// retried on a different routable worker (the mode's next-best pick, never one the
    /// request already failed on), at most [`PushConfig::retry_budget`] times and never past
    /// the deadline. With a budget above 0 the call waits for the first response before
    /// returning the stream (a first-item error is returned by this call); once a response
    /// arrived, nothing is retried. A request tried
    /// once fails with its own error; after retries, with [`PushError::Exhausted`] listing
    /// every attempt. `Direct` mode never retries.
    pub async fn generate(
        &self,
        request: GenerateRequest,
    ) -> Result<RoutedStream<L::Stream>, PushError> {
        let deadline = self.config.request_timeout.map(|t| Instant::now() + t);
        let budget = if matches!(self.mode, PushMode::Direct(_)) {
            0
        } else {
            self.config.retry_budget
        };
        if budget == 0 {
            let pick = self.select_or_wait(&request, &[], deadline).await?;
            return self.dispatch(pick, request, deadline).await;
        }
        // `excluded` stays the workers failed so far, in order (bar the test mutant that
        // reuses them), which is what the link is told.
        let mut attempts: Vec<Attempt> = Vec::new();
        let mut excluded: Vec<InstanceId> = Vec::new();
        let mut request = Some(request);
        loop {
            // Taken only by the last attempt, which never loops back.
            let Some(current) = request.as_ref() else {
                return Err(exhausted(attempts, PushError::NoRoutableInstances));
            };
            let pick = match self.select_or_wait(current, &excluded, deadline).await {
                Ok(pick) => pick,
                Err(e) => return Err(exhausted(attempts, e)),
            };
            let id = pick.instance.instance_id;
            let last = attempts.len() >= budget as usize;
            // Keep a copy only while another attempt may follow.
            let this = if last {
                request.take()
            } else {
                request.clone()
            }
            .unwrap_or_default();
            let attempt = u32::try_from(attempts.len()).unwrap_or(u32::MAX);
            let sent = self
                .dispatch_classified(pick, this, deadline, (attempt, &excluded))
                .await;
            let failure = match sent {
                // Every attempt reads its first item ahead, the last one too: a request that was
                // retried ends with one error listing its attempts, never a stream error.
                Ok(mut stream) => match stream.peek().await {
                    None => return Ok(stream),
                    Some((error, class)) => (error, class),
                },
                Err(failure) => failure,
            };
            let (error, class) = failure;
            attempts.push(Attempt {
                instance: id,
                class,
                error,
            });
            let expired = deadline.is_some_and(|d| Instant::now() >= d);
            if last || !class.retry_elsewhere() || expired {
                return Err(exhausted(attempts, PushError::NoRoutableInstances));
            }
            self.retries.record(class);
            tracing::debug!(instance = id, %class, attempt = attempts.len(), "retrying the request on another worker");
            if self.hooks.excludes_failed() {
                excluded.push(id);
            }
        }
    }

    /// Send `request` to the named instance, whatever the mode.
    pub async fn generate_direct(
        &self,
        instance: InstanceId,
        request: GenerateRequest,
    ) -> Result<RoutedStream<L::Stream>, PushError> {
        let deadline = self.config.request_timeout.map(|t| Instant::now() + t);
        let target = self.direct_target(instance)?;
        let pick = Pick {
            instance: target,
            overlap: None,
            affinity: None,
            booking: None,
        };
        self.dispatch(pick, request, deadline).await
    }

    /// A request's only attempt (no retries).
    async fn dispatch(
        &self,
        pick: Pick,
        request: GenerateRequest,
        deadline: Option<Instant>,
    ) -> Result<RoutedStream<L::Stream>, PushError> {
        self.dispatch_classified(pick, request, deadline, (0, &[]))
            .await
            .map_err(|(e, _)| e)
    }

    /// Send one attempt (number `attempt`, after failing on `failed`) of `request` through
    /// the link to the picked instance; the pick's booking then lives in the stream.
    async fn dispatch_classified(
        &self,
        pick: Pick,
        request: GenerateRequest,
        deadline: Option<Instant>,
        (attempt, failed): (u32, &[InstanceId]),
    ) -> Result<RoutedStream<L::Stream>, (PushError, FailureClass)> {
        let Pick {
            instance,
            overlap,
            affinity,
            booking,
        } = pick;
        let id = instance.instance_id;
        let dispatch = Dispatch {
            instance: &instance,
            attempt,
            failed,
            expected_overlap_blocks: overlap,
            affinity,
        };
        let send = self.link.open(dispatch, request, deadline);
        let sent = match deadline {
            Some(d) => tokio::time::timeout_at(d, send)
                .await
                .unwrap_or(Err(TransportError::Timeout)),
            None => send.await,
        };
        match sent {
            Ok(inner) => Ok(RoutedStream {
                instance: id,
                overlap,
                affinity,
                inner,
                view: self.view.clone(),
                peeked: None,
                _booking: booking,
            }),
            Err(e) => Err(classify(&self.view, id, e)),
        }
    }

    /// Apply one batch of `worker`'s KV cache events to the KV index (see
    /// [`KvSelector::apply_events`]). `None` when not in KV mode, or when the worker is not
    /// discovered and admitted: then whatever the index held for it is dropped and the batch
    /// ignored (a worker outside admission earns no credit; its next batch once admitted
    /// starts it afresh).
    pub fn apply_kv_events(&self, worker: InstanceId, batch: &EventBatch) -> Option<Applied> {
        self.kv_feed.as_ref()?.apply(worker, batch)
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

    /// Drop indexed workers that are no longer discovered and admitted.
    fn prune_kv_index(&self, kv: &mut KvSelector) {
        kv.retain_indexed(|w| {
            matches!(
                self.view.status(w),
                InstanceStatus::Routable(_) | InstanceStatus::Unhealthy(_)
            )
        });
    }

    /// Forget a departed worker in the KV index (callers may call it on `Removed` events; the
    /// router also works without, since only routable workers are scored).
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

/// The error a request ends with: its only attempt's own error, or [`PushError::Exhausted`]
/// after retries; `none_left` (why no attempt could start) when there was no attempt.
fn exhausted(mut attempts: Vec<Attempt>, none_left: PushError) -> PushError {
    match attempts.len() {
        0 => none_left,
        1 => attempts.pop().map_or(none_left, |a| a.error),
        _ => PushError::Exhausted { attempts },
    }
}
