//! What [`PrefillHop::status`](super::PrefillHop::status) reports and the task publishing it.

use std::fmt;
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::binding::{DefaultBindingFactory, WorkerSetTargetId};
use crate::decode::FollowingDecode;
use crate::discovery::{EndpointId, StoreStatus};
use crate::lifecycle::Lifecycle;
use crate::router::{AfterWait, FallbackPolicy, PrefillRouter};
use crate::topology::TopologySnapshot;

/// The hop's router (`hop::HopRouter`, named here so that this file needs nothing of hop.rs).
type HopRouter = PrefillRouter<DefaultBindingFactory>;

/// Why a request arriving now would not be served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NotReady {
    /// The namespace has no single decode set (none, or several), or its dispatcher is not
    /// built yet.
    NoDecodeSet,
    /// The prefill hop is not Active and the fallback policy does not let requests bypass.
    PrefillNotActive {
        /// The prefill hop's lifecycle.
        lifecycle: Lifecycle,
    },
    /// The prefill hop is Active but its binding has no routable worker (every one's breaker
    /// open after failures, or none admitted), and the fallback policy does not let requests
    /// bypass.
    NoReachablePrefill,
    /// The hop was shut down.
    ShutDown,
}

impl fmt::Display for NotReady {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotReady::NoDecodeSet => f.write_str("no decode set"),
            NotReady::PrefillNotActive { lifecycle } => write!(
                f,
                "prefill not active ({lifecycle}) and the fallback policy forbids bypass"
            ),
            NotReady::NoReachablePrefill => f.write_str(
                "no reachable prefill worker (every breaker open) and the fallback policy forbids bypass",
            ),
            NotReady::ShutDown => f.write_str("shut down"),
        }
    }
}

/// Whether a request arriving now would be served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Readiness {
    /// It would be (through prefill, or bypassing to decode as the policy allows).
    Ready,
    /// It would not, for this reason.
    NotReady(NotReady),
}

impl Readiness {
    /// Whether it is [`Readiness::Ready`].
    pub fn is_ready(self) -> bool {
        self == Readiness::Ready
    }
}

/// A picture of the hop (small: it is what [`subscribe`](super::PrefillHop::subscribe) sends).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HopStatus {
    /// The prefill router's published lifecycle.
    pub lifecycle: Lifecycle,
    /// The prefill target the topology gives, if any.
    pub target: Option<WorkerSetTargetId>,
    /// The decode endpoint the decode hop follows, if any.
    pub decode: Option<EndpointId>,
    /// Whether a request would be served now.
    pub readiness: Readiness,
    /// Whether the hop was shut down.
    pub shut_down: bool,
    /// Whether the discovery store answers, as this hop's watches find it. While it does not,
    /// the hop keeps routing on its last view (readiness is unaffected).
    pub store: StoreStatus,
}

/// Whether the policy serves requests (by bypassing to decode) while the hop is not Active.
pub(crate) fn allows_bypass(policy: FallbackPolicy) -> bool {
    match policy {
        FallbackPolicy::Decode => true,
        FallbackPolicy::Reject => false,
        FallbackPolicy::WaitUpTo { then, .. } => then == AfterWait::Decode,
    }
}

/// The readiness rule.
pub(crate) fn readiness(
    lifecycle: Lifecycle,
    decode: bool,
    policy: FallbackPolicy,
    shut_down: bool,
    routable: Option<usize>,
) -> Readiness {
    if shut_down {
        Readiness::NotReady(NotReady::ShutDown)
    } else if !decode {
        Readiness::NotReady(NotReady::NoDecodeSet)
    } else if allows_bypass(policy) {
        Readiness::Ready
    } else if lifecycle != Lifecycle::Active {
        Readiness::NotReady(NotReady::PrefillNotActive { lifecycle })
    } else if routable == Some(0) {
        Readiness::NotReady(NotReady::NoReachablePrefill)
    } else {
        Readiness::Ready
    }
}

pub(crate) fn compute(
    router: &HopRouter,
    topology: &TopologySnapshot,
    decode: Option<EndpointId>,
    policy: FallbackPolicy,
    shut_down: bool,
    store: &StoreStatus,
) -> HopStatus {
    let status = router.status();
    let shut_down = shut_down || status.shut_down;
    HopStatus {
        lifecycle: status.lifecycle,
        target: topology.target.clone(),
        readiness: readiness(
            status.lifecycle,
            decode.is_some(),
            policy,
            shut_down,
            status.health.routable,
        ),
        decode,
        shut_down,
        store: store.clone(),
    }
}

/// The store's reachability at scrape time: `prefill_router_discovery_reachable` (1 or 0)
/// and `prefill_router_discovery_outages_total`.
#[derive(Debug)]
pub(crate) struct StoreCollector {
    pub(crate) store: watch::Receiver<StoreStatus>,
}

impl prometheus_client::collector::Collector for StoreCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), fmt::Error> {
        let store = self.store.borrow().clone();
        crate::router::metrics::gauge(
            &mut encoder,
            "discovery_reachable",
            "Whether the discovery store answers, as the hop's watches find it (1) or not (0)",
            i64::from(store.reachable),
        )?;
        crate::router::metrics::counter(
            &mut encoder,
            "discovery_outages",
            "Times the discovery store stopped answering",
            store.outages,
        )
    }
}

/// What migration counted, at scrape time: `prefill_router_migrations_total{reason}` (streams
/// continued on another decode worker, by how the last one broke) and
/// `prefill_router_migrations_exhausted_total` (broken streams not continued: limit or deadline),
/// `prefill_router_migrations_prefilled_total` (continuations prefilled on the prefill pool).
#[derive(Debug)]
pub(crate) struct MigrationCollector {
    pub(crate) counts: std::sync::Arc<crate::decode::MigrationCounts>,
}

impl prometheus_client::collector::Collector for MigrationCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        let kind = ConstCounter::new(0u64).metric_type();
        let mut family = encoder.encode_descriptor(
            "migrations",
            "Decode streams continued on another decode worker after theirs broke, by reason",
            None,
            kind,
        )?;
        for reason in crate::migration::BreakReason::ALL {
            let labels = [("reason", reason.as_str())];
            let e = family.encode_family(&labels)?;
            ConstCounter::new(self.counts.migrations(reason)).encode(e)?;
        }
        crate::router::metrics::counter(
            &mut encoder,
            "migrations_exhausted",
            "Broken decode streams not continued (migration limit used up or deadline passed)",
            self.counts.exhausted(),
        )?;
        crate::router::metrics::counter(
            &mut encoder,
            "migrations_prefilled",
            "Continuations prefilled on the prefill pool (the rest were prefilled by their decode worker)",
            self.counts.prefilled(),
        )
    }
}

/// What the hop's bindings counted, at scrape time: KV-mode picks with and without overlap
/// (`prefill_router_kv_overlap_decisions_total`, `prefill_router_kv_zero_overlap_decisions_total`)
/// and, with feature `engine`, every engine's KV event feed (`engine::kv_events::metrics`).
#[derive(Debug)]
pub(crate) struct BindingCollector {
    pub(crate) stats: std::sync::Arc<crate::binding::BindingStats>,
}

impl prometheus_client::collector::Collector for BindingCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), fmt::Error> {
        let decisions = &self.stats.kv_decisions;
        crate::router::metrics::counter(
            &mut encoder,
            "kv_overlap_decisions",
            "KV-mode picks whose worker the index credited with some of the prompt's blocks",
            decisions.with_overlap(),
        )?;
        crate::router::metrics::counter(
            &mut encoder,
            "kv_zero_overlap_decisions",
            "KV-mode picks whose worker the index credited with none of the prompt's blocks",
            decisions.zero_overlap(),
        )?;
        #[cfg(feature = "engine")]
        crate::engine::kv_events::metrics::encode(&self.stats.engine_kv, &mut encoder)?;
        Ok(())
    }
}

/// Republish the status on every lifecycle, topology, decode or store change, until `cancel`.
// One argument per source the status is computed from; a struct would only rename them.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn publish(
    router: Arc<HopRouter>,
    mut topology: watch::Receiver<TopologySnapshot>,
    mut decode_changed: watch::Receiver<()>,
    decode: Arc<FollowingDecode>,
    policy: FallbackPolicy,
    mut store: watch::Receiver<StoreStatus>,
    status: watch::Sender<HopStatus>,
    cancel: CancellationToken,
) {
    let mut lifecycle = router.subscribe();
    // A store that never reports (in memory) has a closed channel: stop listening to it.
    let mut store_open = true;
    loop {
        lifecycle.borrow_and_update();
        topology.borrow_and_update();
        decode_changed.borrow_and_update();
        let reach = store.borrow_and_update().clone();
        let next = compute(
            &router,
            &topology.borrow(),
            decode.endpoint(),
            policy,
            false,
            &reach,
        );
        status.send_if_modified(|s| {
            let changed = *s != next;
            *s = next;
            changed
        });
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            r = lifecycle.changed() => if r.is_err() { break },
            r = topology.changed() => if r.is_err() { break },
            r = decode_changed.changed() => if r.is_err() { break },
            r = store.changed(), if store_open => if r.is_err() { store_open = false },
        }
    }
}
