//! The dispatcher: its modes and settings, how one is built, and what it reports. The work
//! is in the submodules: the pick (`pick.rs`, with session affinity in `sessions.rs` and the
//! booked work and the wait for room in `booking.rs`), the send and its retries (`send.rs`)
//! through a [`WorkerLink`] (`link.rs`) into a [`RoutedStream`] (`routed.rs`), and the
//! workers' KV events (`kv_events.rs`, with the eager connects that bring them in `warm.rs`).

mod booking;
#[cfg(feature = "engine")]
mod engine_feeds;
mod kv_events;
mod link;
mod pick;
mod picked;
mod routed;
mod send;
mod sessions;
mod wait;
mod warm;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::affinity::{AffinityCounts, AffinityStats, AffinityTable};
use super::error::RetryCounts;
use super::kv::KvSelector;
use super::kv_feed::{KvEventCounts, KvFeed};
use super::mutant::DispatchMutant;
use super::view::RoutableView;
use crate::advert::{KvRouterConfig, PrefillConfig, SelectionMode};
use crate::discovery::InstanceId;
use crate::health::BackoffPolicy;
use crate::hooks::Seam;
use crate::transport::ClientConfig;
use booking::Bookings;
pub use booking::{OverloadCounts, OverloadStats};
pub use link::{Dispatch, Link, LinkStream, TcpLink, WorkerLink};
pub use routed::{HeldPick, RoutedStream};

/// How the dispatcher picks an instance.
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

/// Dispatcher settings.
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
    ///
    /// [`FailureClass::retry_elsewhere`]: crate::health::FailureClass::retry_elsewhere
    pub retry_budget: u32,
    /// Most sessions a dispatcher's session-affinity table remembers (least recently used
    /// evicted first; 0 disables affinity). Default [`DEFAULT_AFFINITY_CAPACITY`].
    ///
    /// [`DEFAULT_AFFINITY_CAPACITY`]: super::DEFAULT_AFFINITY_CAPACITY
    pub affinity_capacity: usize,
    /// How long a request that finds every routable worker over the busy threshold waits for
    /// room before it fails with [`PushError::Overloaded`] (never past its deadline; default
    /// 2 s; zero fails at once).
    ///
    /// [`PushError::Overloaded`]: super::PushError::Overloaded
    pub overload_wait: Duration,
    /// Most requests waiting for room at once; one more fails with [`PushError::Overloaded`]
    /// at once (default 1,024).
    ///
    /// [`PushError::Overloaded`]: super::PushError::Overloaded
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

/// The board a KV feed sets reported loads on, and how it wakes the requests waiting for room.
fn feed_board(
    loads: &Arc<Bookings>,
) -> (Arc<Mutex<super::LoadBoard>>, Box<dyn Fn() + Send + Sync>) {
    // Weak: the feed must not keep the dispatcher's bookings alive.
    let weak = Arc::downgrade(loads);
    let wake = move || {
        if let Some(loads) = weak.upgrade() {
            loads.wake_all();
        }
    };
    (loads.shared_board(), Box::new(wake))
}

/// No busy threshold, in [`Dispatcher`]'s atomic.
const NO_THRESHOLD: u64 = u64::MAX;

/// Routes requests to instances of a [`RoutableView`], sending them through its link `L`: the
/// request plane ([`TcpLink`]) unless built [`with_link`](Dispatcher::with_link). Share it
/// behind an `Arc`; all methods take `&self`.
pub struct Dispatcher<L = Link> {
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
    /// KV-mode picks with and without overlap.
    kv_decisions: Arc<super::KvDecisionCounts>,
    /// Where the dispatcher's mutants break the pick, the retry and the KV feed; zero-sized in
    /// normal builds.
    mutant: Seam<DispatchMutant>,
    /// Session → worker, while younger than the binding's TTL (`None`: no affinity).
    affinity: Option<Arc<AffinityTable>>,
}

impl<L> std::fmt::Debug for Dispatcher<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("mode", &self.mode)
            .field("view", &self.view)
            .finish()
    }
}

impl Dispatcher<Link> {
    /// A dispatcher over `view` in `mode`, sending over the request plane (in KV mode its
    /// connections also carry the workers' KV events into the selector).
    pub fn new(view: RoutableView, mode: PushMode, config: PushConfig) -> Self {
        let client = config.client.clone();
        Self::build(view, mode, config, |view, feed| {
            Link::Tcp(TcpLink::new(client, view.clone(), feed.cloned()))
        })
    }

    /// A dispatcher over `view` in `mode` whose workers are engines reached through `link`
    /// (feature `engine`). In KV mode the link subscribes to every engine's KV events and the
    /// index scores each engine by what it caches (an engine without events, by prediction).
    #[cfg(feature = "engine")]
    pub fn with_engine(
        view: RoutableView,
        mode: PushMode,
        config: PushConfig,
        link: crate::engine::EngineLink,
    ) -> Self {
        Self::build(view, mode, config, |view, feed| {
            let mut link = link;
            if let Some(feed) = feed {
                let feeds = link.kv_feeds();
                link.keep_feeds(engine_feeds::spawn(view.clone(), Arc::clone(feed), feeds));
            }
            Link::Engine(Box::new(link))
        })
    }

    /// A dispatcher running a deliberate mutant (see [`DispatchMutant`]).
    #[cfg(test)]
    pub(crate) fn with_mutant(mut self, mutant: DispatchMutant) -> Self {
        self.mutant = Seam::on(mutant);
        // The KV feed runs it too: a new feed, and a new link carrying it (the old link's
        // connections and eager connects end with it).
        let loads = Arc::clone(&self.loads);
        self.kv_feed = self.kv.as_ref().map(|kv| {
            Arc::new(KvFeed::new(
                Arc::clone(kv),
                self.view.clone(),
                self.mutant,
                feed_board(&loads),
            ))
        });
        self.link = Link::Tcp(TcpLink::new(
            self.config.client.clone(),
            self.view.clone(),
            self.kv_feed.clone(),
        ));
        self
    }
}

impl<L: WorkerLink> Dispatcher<L> {
    /// This dispatcher running a deliberate mutant of its pick and retry (see
    /// [`DispatchMutant`]); its link is left as it is.
    #[cfg(test)]
    pub(crate) fn with_send_mutant(mut self, mutant: DispatchMutant) -> Self {
        self.mutant = Seam::on(mutant);
        self
    }

    /// A dispatcher over `view` in `mode` that sends through `link` (an in-memory transport, as
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
        let mutant = Seam::off();
        let loads: Arc<Bookings> = Arc::default();
        let kv_feed = kv.as_ref().map(|kv| {
            Arc::new(KvFeed::new(
                Arc::clone(kv),
                view.clone(),
                mutant,
                feed_board(&loads),
            ))
        });
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
            loads,
            busy_threshold: AtomicU64::new(threshold.unwrap_or(NO_THRESHOLD)),
            overload: Arc::default(),
            retries: Arc::default(),
            kv_decisions: Arc::default(),
            mutant,
            affinity: None,
        }
    }

    /// Turn on session affinity: a request with a session key goes to the first routable
    /// worker of its session's rendezvous order (in KV mode the first not over the busy
    /// threshold), the same on every dispatcher with the same routable set; the table
    /// remembers for `ttl` where each session went, to count hits, misses and re-picks
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
    /// factory's seam and the simulator decide which).
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

    /// Count KV-mode picks in `counts` (shared, e.g. by every binding of one factory) instead
    /// of the dispatcher's own.
    #[must_use]
    pub fn with_kv_decision_counts(mut self, counts: Arc<super::KvDecisionCounts>) -> Self {
        self.kv_decisions = counts;
        self
    }

    /// KV-mode picks with and without overlap.
    pub fn kv_decision_counts(&self) -> &Arc<super::KvDecisionCounts> {
        &self.kv_decisions
    }

    /// The retries this dispatcher counted, by the class of the failure that caused them.
    pub fn retry_counts(&self) -> &Arc<RetryCounts> {
        &self.retries
    }

    /// What the workers' KV event streams delivered (`None` when not in KV mode).
    pub fn kv_event_counts(&self) -> Option<&Arc<KvEventCounts>> {
        self.kv_feed.as_ref().map(|feed| feed.counts())
    }

    /// The link this dispatcher sends through.
    pub fn link(&self) -> &L {
        &self.link
    }

    /// The view this dispatcher picks from.
    pub fn view(&self) -> &RoutableView {
        &self.view
    }

    /// The dispatcher's mode.
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

    /// The load `worker` is ordered and checked by now (KV mode; 0 otherwise): this
    /// dispatcher's bookings plus the other frontends' work per the worker's newest load
    /// report (see [`crate::load_report`]).
    pub fn combined_work(&self, worker: InstanceId) -> u64 {
        self.loads.board().combined(worker)
    }

    /// What `worker`'s current connection last reported of the other connections' load
    /// (`None`: not in KV mode, or no pooled connection to it; zero before a first report).
    pub fn reported_load(&self, worker: InstanceId) -> Option<crate::load_report::ReportedLoad> {
        self.kv_feed.as_ref()?.reported(worker)
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
    pub(crate) fn with_board(self, board: super::LoadBoard) -> Self {
        // In place: the KV feed shares the board.
        *self.loads.board() = board;
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
}
