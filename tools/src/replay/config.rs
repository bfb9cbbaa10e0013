//! What one replay run is given: the policy, the pool, the cost model, the pool event to
//! study, and the knobs of KV events, affinity, overload and arrivals.

use std::time::Duration;

use super::cost::CostModel;
use super::external::{External, ExternalError};
use super::policy::Policy;
use super::sessions::ClosedLoop;
use super::trace::TraceRecord;
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

/// A frontend that comes up late (issue #29's warm start): the last of
/// [`ReplayConfig::frontends`] starts with an empty KV index at trace time `at` and from then
/// on gets its share of the requests (before it, the balancer spreads them over the others).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Join {
    /// Trace time at which the frontend comes up.
    pub at: Duration,
    /// Whether it asks the workers for a KV snapshot as it joins (as the TCP request plane's
    /// connections do): every worker's whole cache lands in its index before its first request,
    /// then live events by the sequence rule. Without, it learns only from the live events
    /// published from then on (`--join-cold`).
    pub snapshot: bool,
}

/// Why a [`ReplayConfig`] with a [`Join`] cannot run.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum JoinError {
    /// A late frontend needs a long-running one beside it.
    #[error(
        "a late-joining frontend needs at least 2 frontends (the last one joins), not {frontends}"
    )]
    NeedsTwoFrontends {
        /// The configured frontend count.
        frontends: usize,
    },
    /// The join comes at or after the last arrival: the frontend would get no request.
    #[error(
        "the join at {at_s} s is not before the trace's last arrival ({last_s} s): the joined \
         frontend would get no request"
    )]
    AfterTrace {
        /// The join time, in seconds.
        at_s: f64,
        /// The last request's arrival (of the replayed part of the trace), in seconds.
        last_s: f64,
    },
    /// Only the `kv-events` policy has workers that publish their caches, hence a snapshot.
    #[error(
        "a join with a KV snapshot needs policy kv-events (under `{policy}` the workers publish \
         no KV events); join cold instead"
    )]
    SnapshotNeedsKvEvents {
        /// The configured policy's name.
        policy: &'static str,
    },
    /// Closed-loop arrivals have no trace time to join at.
    #[error("a late join needs the trace's arrival times, not closed-loop arrivals")]
    ClosedLoop,
    /// A pool event rebuilds every frontend's binding, which would blur the join.
    #[error("a late join does not combine with a pool event")]
    PoolEvent,
}

/// Why [`run`](super::run) returned no report.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The configuration cannot replay the trace ([`ReplayConfig::check`]).
    #[error(transparent)]
    Join(#[from] JoinError),
    /// [`Policy::External`] without its policy, or with what it cannot do.
    #[error(transparent)]
    External(#[from] ExternalError),
    /// The runtime could not be built (an OS resource failure).
    #[error("cannot build the replay runtime: {0}")]
    Runtime(#[from] std::io::Error),
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
    /// KV blocks of [`BLOCK_TOKENS`](super::BLOCK_TOKENS) (512) tokens each worker's LRU
    /// cache holds, whatever [`block_tokens`](Self::block_tokens) is (the same memory at
    /// every block size); `None` (default) is unbounded.
    pub cache_blocks: Option<usize>,
    /// Tokens per KV block of the router and the workers (default 512; `--block-tokens`). The
    /// trace's prompts are the same tokens at every block size (issue #40).
    pub block_tokens: u32,
    /// Tokens per `hash_ids` entry of the trace (512 for Mooncake files and the 512-token
    /// generated workloads; [`Workload::unit_tokens`](super::Workload::unit_tokens)).
    pub unit_tokens: u32,
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
    /// The last frontend joins late (`None`, the default: every frontend runs from the start).
    pub join: Option<Join>,
    /// The router of [`Policy::External`] (`None`, the default; ignored by every other policy).
    pub external: Option<External>,
}

impl ReplayConfig {
    /// The defaults for `policy`: 6 workers, unbounded caches, the whole trace.
    pub fn new(policy: Policy) -> Self {
        ReplayConfig {
            policy,
            workers: 6,
            cache_blocks: None,
            block_tokens: super::BLOCK_TOKENS,
            unit_tokens: super::BLOCK_TOKENS,
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
            join: None,
            external: None,
        }
    }

    /// The name of the run's policy in reports: the external policy's own name under
    /// [`Policy::External`].
    pub fn policy_name(&self) -> String {
        match (&self.external, self.policy) {
            (Some(external), Policy::External) => external.0.name().to_owned(),
            (_, policy) => policy.name().to_owned(),
        }
    }

    /// Whether [`Policy::External`] can run as configured: it needs its policy, and picks
    /// asynchronously, so it cannot answer conditional disaggregation's probe.
    ///
    /// # Errors
    /// [`ExternalError::Missing`] or [`ExternalError::Conditional`].
    pub fn check_external(&self) -> Result<(), ExternalError> {
        if self.policy != Policy::External {
            return Ok(());
        }
        if self.external.is_none() {
            return Err(ExternalError::Missing);
        }
        if self.conditional.is_some() {
            return Err(ExternalError::Conditional);
        }
        Ok(())
    }

    /// Whether this configuration can replay `trace` (its first [`limit`](Self::limit)
    /// requests): only a [`Join`] can make it fail.
    ///
    /// # Errors
    /// The [`JoinError`] of a join that cannot be replayed as asked.
    pub fn check(&self, trace: &[TraceRecord]) -> Result<(), JoinError> {
        let Some(join) = self.join else {
            return Ok(());
        };
        if self.frontends < 2 {
            return Err(JoinError::NeedsTwoFrontends {
                frontends: self.frontends,
            });
        }
        if self.closed_loop.is_some() {
            return Err(JoinError::ClosedLoop);
        }
        if self.event.is_some() {
            return Err(JoinError::PoolEvent);
        }
        if join.snapshot && self.policy != Policy::KvEvents {
            return Err(JoinError::SnapshotNeedsKvEvents {
                policy: self.policy.name(),
            });
        }
        let replayed = &trace[..self.limit.unwrap_or(usize::MAX).min(trace.len())];
        let last = replayed.iter().map(|r| r.timestamp).max().unwrap_or(0);
        if join.at >= Duration::from_millis(last) {
            return Err(JoinError::AfterTrace {
                at_s: join.at.as_secs_f64(),
                last_s: Duration::from_millis(last).as_secs_f64(),
            });
        }
        Ok(())
    }
}
