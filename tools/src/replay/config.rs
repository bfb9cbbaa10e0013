//! What one replay run is given: the policy, the pool, the cost model, the pool event to
//! study, and the knobs of KV events, affinity, overload and arrivals.

use std::time::Duration;

use super::cost::CostModel;
use super::policy::Policy;
use super::sessions::ClosedLoop;
use prefill_router::advert::KvRouterConfig;
use prefill_router::router::ConditionalPolicy;

/// A change of the prefill pool at a trace time, to see routing around the router's
/// lifecycle moments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolEvent {
    /// The pool rolls to a new generation of as many cold workers (new ids, empty caches); the
    /// old generation's admission empties.
    Retarget {
        /// Trace time of the roll.
        at: Duration,
    },
    /// The pool disappears for [`FLAP_DOWN`] and comes back: with `rebuild` false as the same
    /// target (the router reuses its held binding, KV index included), with `rebuild` true as
    /// a new generation of the same workers (a new binding: warm workers, cold router index).
    Flap {
        /// Trace time the pool disappears.
        at: Duration,
        /// Whether it comes back as a new generation.
        rebuild: bool,
    },
}

impl PoolEvent {
    pub(crate) fn at(self) -> Duration {
        match self {
            PoolEvent::Retarget { at } | PoolEvent::Flap { at, .. } => at,
        }
    }
}

/// How a multi-frontend replay spreads requests over its frontends (the load balancer in
/// front of them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Spread {
    /// Request *i* goes to frontend *i* mod N (a round-robin balancer).
    #[default]
    RoundRobin,
    /// A request goes to the frontend its session hashes to (a sticky balancer: every turn of
    /// a conversation reaches the same frontend).
    Session,
}

impl Spread {
    /// The spread named `name` (`round-robin` or `session`).
    pub fn parse(name: &str) -> Option<Spread> {
        match name {
            "round-robin" => Some(Spread::RoundRobin),
            "session" => Some(Spread::Session),
            _ => None,
        }
    }

    /// The name [`parse`](Self::parse) reads.
    pub fn name(self) -> &'static str {
        match self {
            Spread::RoundRobin => "round-robin",
            Spread::Session => "session",
        }
    }
}

/// How long a [`PoolEvent::Flap`] keeps the pool away. Requests arriving meanwhile wait for
/// the hop (up to [`WAIT_FOR_HOP`]).
pub const FLAP_DOWN: Duration = Duration::from_secs(1);

/// How long a request waits for the hop to be Active before it is rejected (lost).
pub const WAIT_FOR_HOP: Duration = Duration::from_secs(5);

/// Around a [`PoolEvent`]: the window the report compares before and after it.
pub const EVENT_WINDOW: Duration = Duration::from_secs(60);

/// What to replay and how.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayConfig {
    /// The routing policy.
    pub policy: Policy,
    /// Prefill workers (default 6).
    pub workers: usize,
    /// KV blocks each worker's LRU cache holds; `None` (default) is unbounded.
    pub cache_blocks: Option<usize>,
    /// Replay only the first `limit` requests.
    pub limit: Option<usize>,
    /// The workers' timing.
    pub cost: CostModel,
    /// Seed of the random policy.
    pub seed: u64,
    /// Print a progress line to stderr every 10% of the requests.
    pub progress: bool,
    /// A pool change during the replay, if any.
    pub event: Option<PoolEvent>,
    /// Policy `kv-events`: every how many KV event batches one is lost (0: none).
    pub event_loss_every: u64,
    /// Policy `kv-events`: how long a KV event batch takes to reach the router.
    pub event_delay: Duration,
    /// The router's conditional disaggregation policy (`None`, the default: off). A skipped
    /// request is prefilled whole on the decode pool (see `docs/replay.md`).
    pub conditional: Option<ConditionalPolicy>,
    /// Session affinity on the prefill hop with this TTL (`None`, the default: off). Each
    /// request's session is its conversation (see `session_key`); only the policies the
    /// dispatcher routes (`kv`, `kv-events`, `round-robin`, `random`) honour it.
    pub session_affinity: Option<Duration>,
    /// The KV cost terms the pool's card advertises (the KV policies and the oracle).
    pub kv: KvRouterConfig,
    /// How long a request waits for room when every worker is over the busy threshold
    /// (`kv.busy_threshold_tokens`) before it is shed (default 2 s, as `PushConfig`).
    pub overload_wait: Duration,
    /// Closed-loop arrivals instead of the trace's timestamps (`None`, the default: open loop).
    pub closed_loop: Option<ClosedLoop>,
    /// Independent frontends over the one pool (default 1): each its own router, binding,
    /// dispatcher, KV index, bookings and affinity table, as separate processes would be.
    pub frontends: usize,
    /// How requests are spread over the frontends.
    pub spread: Spread,
    /// Whether the workers send load reports (their work minus the receiving frontend's own,
    /// `prefill_router::load_report`) to every frontend (default on, as `prefill-router
    /// worker`); off, each frontend counts only its own bookings.
    pub load_reports: bool,
    /// How long a load report takes to reach the frontends.
    pub report_delay: Duration,
}

impl ReplayConfig {
    /// The defaults for `policy`: 6 workers, unbounded caches, the whole trace.
    pub fn new(policy: Policy) -> Self {
        ReplayConfig {
            policy,
            workers: 6,
            cache_blocks: None,
            limit: None,
            cost: CostModel::default(),
            seed: 0x5eed,
            progress: false,
            event: None,
            event_loss_every: 0,
            event_delay: Duration::ZERO,
            conditional: None,
            session_affinity: None,
            kv: KvRouterConfig::default(),
            overload_wait: prefill_router::push::PushConfig::default().overload_wait,
            closed_loop: None,
            frontends: 1,
            spread: Spread::RoundRobin,
            load_reports: true,
            report_delay: Duration::ZERO,
        }
    }
}
