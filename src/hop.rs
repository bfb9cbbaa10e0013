//! [`PrefillHop`]: the one handle a frontend embeds (feature `runtime`).
//!
//! It owns what a frontend otherwise wires by hand: the [`TopologyWatcher`] of a namespace,
//! the [`PrefillRouter`] with the [`DefaultBindingFactory`], and a decode hop that follows the
//! topology's decode set (when the decode endpoint changes, the decode dispatcher follows).
//!
//! ```no_run
//! use prefill_router::prelude::*;
//!
//! # async fn example(discovery: Arc<dyn Discovery>) -> Result<(), Box<dyn std::error::Error>> {
//! let hop = PrefillHop::start(discovery, "demo", PrefillHopConfig::default()).await?;
//! let mut stream = hop.generate(GenerateRequest::new(vec![1, 2, 3], 4)).await?;
//! while let Some(response) = stream.next().await {
//!     println!("{:?}", response?.token_ids);
//! }
//! hop.shutdown().await; // watcher, then router, then decode feeds
//! # Ok(()) }
//! ```
//!
//! Readiness ([`PrefillHop::ready`]): a request would be served when a decode set is present
//! (and its dispatcher built) and either the prefill hop is Active or the fallback policy lets
//! a request bypass to decode. See `docs/frontend.md`.
//!
//! The lower-level types stay public for frontends that need another arrangement.

mod follow;
mod status;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::advert::{DecodeDefaults, SelectionMode};
use crate::binding::{BindingStats, DefaultBindingFactory, FactoryConfig};
use crate::decode::{ContinuationPrefill, Decode, DecodeStream, FollowingDecode, MigratingDecode};
use crate::discovery::{Discovery, DiscoveryError, StoreStatus};
use crate::migration::MigrationConfig;
use crate::push::{PushConfig, PushMode};
use crate::request::GenerateRequest;
use crate::router::{GenerateError, PrefillRouter, PrefillRouterConfig};
use crate::snapshot::BypassReason;
use crate::topology::{TopologySnapshot, TopologyWatcher};

pub use status::{HopStatus, NotReady, Readiness};

/// Everything [`PrefillHop::start`] needs besides discovery and the namespace.
///
/// Each value is set in one place: the router's knobs in [`router`](Self::router), one
/// dispatcher configuration for both legs in [`push`](Self::push) (the decode leg may
/// override it), and the decode set in [`decode`](Self::decode), whose mode is both how the
/// decode dispatcher picks and what prefill cards without a `router_config` inherit.
///
/// ```
/// use prefill_router::prelude::*;
///
/// let config = PrefillHopConfig {
///     router: PrefillRouterConfig {
///         name: "my-model".into(),
///         fallback: FallbackPolicy::Reject,
///         ..Default::default()
///     },
///     push: PushConfig {
///         request_timeout: Some(std::time::Duration::from_secs(60)),
///         ..Default::default()
///     },
///     ..Default::default()
/// };
/// assert!(config.decode_push.is_none(), "both legs share one push configuration");
/// ```
#[derive(Clone, Debug)]
pub struct PrefillHopConfig {
    /// The prefill router: its name in logs and metrics, build timeout, retry, drain cap,
    /// conditional disaggregation, and the fallback policy while the hop is not Active.
    pub router: PrefillRouterConfig,
    /// The dispatchers' settings, for the prefill and the decode leg alike: request deadline,
    /// client (and TLS), health backoff, retry budget, session-affinity capacity, overload.
    pub push: PushConfig,
    /// The decode leg's own settings when they must differ from [`push`](Self::push); `None`
    /// (the default) uses `push`.
    pub decode_push: Option<PushConfig>,
    /// The decode set: its selection mode (how the decode dispatcher picks; `Direct` names
    /// no worker here, so it picks round robin), its KV tuning and block size, and the session
    /// affinity TTL. Prefill cards that advertise no `router_config` inherit them (Dynamo's
    /// rule, `advert::resolve`). Default: round robin, 16-token blocks.
    pub decode: DecodeDefaults,
    /// How long a new decode dispatcher may take to discover its first instance before it is
    /// used anyway (its requests then fail fast with `NoRoutableInstances` until it does).
    pub decode_catch_up: Duration,
    /// Timeouts of the links to engines, for sets whose cards name an engine protocol
    /// (docs/engines.md).
    #[cfg(feature = "engine")]
    pub engine: crate::engine::EngineLinkConfig,
    /// Migration of broken decode streams: how many times one request's stream may continue
    /// on another decode worker after its worker died (0: never; docs/health.md, "Migration").
    pub migration: MigrationConfig,
}

impl Default for PrefillHopConfig {
    fn default() -> Self {
        PrefillHopConfig {
            router: PrefillRouterConfig::default(),
            push: PushConfig::default(),
            decode_push: None,
            decode: DecodeDefaults {
                router_mode: SelectionMode::RoundRobin,
                block_size: 16,
                ..DecodeDefaults::default()
            },
            decode_catch_up: Duration::from_secs(1),
            #[cfg(feature = "engine")]
            engine: crate::engine::EngineLinkConfig::default(),
            migration: MigrationConfig::default(),
        }
    }
}

impl PrefillHopConfig {
    /// The binding factory's configuration: the decode defaults and the prefill leg's push.
    fn factory(&self) -> FactoryConfig {
        FactoryConfig {
            decode: self.decode.clone(),
            push: self.push.clone(),
            #[cfg(feature = "engine")]
            engine: self.engine.clone(),
        }
    }

    /// How the decode dispatcher picks: the decode set's own mode.
    fn decode_mode(&self) -> PushMode {
        match self.decode.router_mode {
            SelectionMode::RoundRobin | SelectionMode::Direct => PushMode::RoundRobin,
            SelectionMode::Random => PushMode::Random,
            SelectionMode::KV => PushMode::Kv {
                block_size: self.decode.block_size,
                config: self.decode.kv_router_config.clone().unwrap_or_default(),
            },
        }
    }
}

/// Why [`PrefillHop::start`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HopStartError {
    /// The namespace watch could not be opened.
    #[error("watching the namespace: {0}")]
    Discovery(#[from] DiscoveryError),
}

/// The router type a [`PrefillHop`] owns.
pub type HopRouter = PrefillRouter<DefaultBindingFactory>;

/// The prefill hop of one namespace: topology watcher, prefill router and decode hop in one
/// handle. Share it behind an `Arc`; every method takes `&self`.
///
/// Dropping it stops everything without waiting; [`shutdown`](Self::shutdown) stops in order
/// and waits.
pub struct PrefillHop {
    router: Arc<HopRouter>,
    stats: Arc<BindingStats>,
    decode: Arc<FollowingDecode>,
    /// The decode hop requests take: `decode`, migrating broken streams.
    migrating: MigratingDecode,
    watcher: parking_lot::Mutex<Option<TopologyWatcher>>,
    topology: watch::Receiver<TopologySnapshot>,
    store: watch::Receiver<StoreStatus>,
    status: watch::Sender<HopStatus>,
    shut_down: Arc<AtomicBool>,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl std::fmt::Debug for PrefillHop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillHop")
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

impl PrefillHop {
    /// Watch `namespace` in `discovery` and serve its prefill hop: the watcher points the
    /// router at the namespace's prefill set, and the decode hop follows its decode set.
    /// Must be called within a tokio runtime.
    pub async fn start(
        discovery: Arc<dyn Discovery>,
        namespace: &str,
        config: PrefillHopConfig,
    ) -> Result<Self, HopStartError> {
        let factory = DefaultBindingFactory::new(Arc::clone(&discovery), config.factory());
        let stats = factory.stats();
        let router = Arc::new(PrefillRouter::new(factory, config.router.clone()));
        let store = discovery.store_status();
        let watcher =
            TopologyWatcher::start(Arc::clone(&discovery), namespace, Arc::clone(&router)).await?;
        let topology = watcher.view();
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let decode = FollowingDecode::new(
            config.decode_mode(),
            config
                .decode_push
                .clone()
                .unwrap_or_else(|| config.push.clone()),
        );
        #[cfg(feature = "engine")]
        let decode = decode.with_engine(config.engine.clone());
        let decode = Arc::new(decode);
        let deadline = config
            .decode_push
            .as_ref()
            .unwrap_or(&config.push)
            .request_timeout;
        let migrating = MigratingDecode::new(
            Arc::clone(&decode) as Arc<dyn Decode>,
            config.migration,
            deadline,
        )
        .with_prefill(Arc::clone(&router) as Arc<dyn ContinuationPrefill>);
        let (decode_changed_tx, decode_changed) = watch::channel(());
        tracker.spawn(follow::follow(
            Arc::clone(&decode),
            discovery,
            topology.clone(),
            config.decode_catch_up,
            cancel.clone(),
            decode_changed_tx,
        ));
        let shut_down = Arc::new(AtomicBool::new(false));
        let fallback = config.router.fallback;
        let initial = status::compute(
            &router,
            &topology.borrow(),
            decode.endpoint(),
            fallback,
            false,
            &store.borrow(),
        );
        let status = watch::Sender::new(initial);
        tracker.spawn(status::publish(
            Arc::clone(&router),
            topology.clone(),
            decode_changed,
            Arc::clone(&decode),
            fallback,
            store.clone(),
            status.clone(),
            cancel.clone(),
        ));
        tracker.close();
        tracing::info!(namespace, "prefill hop started");
        Ok(PrefillHop {
            router,
            stats,
            decode,
            migrating,
            watcher: parking_lot::Mutex::new(Some(watcher)),
            topology,
            store,
            status,
            shut_down,
            cancel,
            tracker,
        })
    }

    /// Serve one request through both hops (prefill on the active binding, then decode; or the
    /// fallback policy while the hop is not Active). Dropping the returned stream cancels the
    /// request at the worker serving it.
    ///
    /// After [`shutdown`](Self::shutdown) every request fails with
    /// [`GenerateError::NotActivated`] (reason `shut_down`).
    pub async fn generate(&self, request: GenerateRequest) -> Result<DecodeStream, GenerateError> {
        if self.shut_down.load(Ordering::Acquire) {
            return Err(GenerateError::NotActivated {
                reason: BypassReason::ShutDown,
            });
        }
        self.router.generate(request, &self.migrating).await
    }

    /// The hop's status now (lifecycle, targets, decode endpoint, readiness).
    pub fn status(&self) -> HopStatus {
        status::compute(
            &self.router,
            &self.topology.borrow(),
            self.decode.endpoint(),
            self.router.config().fallback,
            self.shut_down.load(Ordering::Acquire),
            &self.store.borrow(),
        )
    }

    /// Whether a request arriving now would be served, and if not why.
    pub fn ready(&self) -> Readiness {
        self.status().readiness
    }

    /// The status as a watch channel: the current value, then every change (lifecycle,
    /// prefill target, decode endpoint, readiness, shutdown).
    pub fn subscribe(&self) -> watch::Receiver<HopStatus> {
        self.status.subscribe()
    }

    /// The prefill router (for its detailed [`status`](PrefillRouter::status), its
    /// [`route`](PrefillRouter::route), or its metrics).
    pub fn router(&self) -> &Arc<HopRouter> {
        &self.router
    }

    /// The counters of every prefill binding the hop built.
    pub fn binding_stats(&self) -> &Arc<BindingStats> {
        &self.stats
    }

    /// The decode hop (follows the topology's decode set).
    pub fn decode(&self) -> &Arc<FollowingDecode> {
        &self.decode
    }

    /// The decode hop requests take, migrating broken streams (its counts and bounds).
    pub fn migrating(&self) -> &MigratingDecode {
        &self.migrating
    }

    /// The topology as last published by the watcher.
    pub fn topology(&self) -> watch::Receiver<TopologySnapshot> {
        self.topology.clone()
    }

    /// Register the router's Prometheus metrics in `registry`
    /// ([`PrefillRouter::register_metrics`]).
    /// Also registers the store's reachability (`prefill_router_discovery_reachable`,
    /// `prefill_router_discovery_outages_total`).
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.router.register_metrics(registry);
        registry
            .sub_registry_with_prefix("prefill_router")
            .register_collector(Box::new(status::StoreCollector {
                store: self.store.clone(),
            }));
        registry
            .sub_registry_with_prefix("prefill_router")
            .register_collector(Box::new(status::BindingCollector {
                stats: Arc::clone(&self.stats),
            }));
        registry
            .sub_registry_with_prefix("prefill_router")
            .register_collector(Box::new(status::MigrationCollector {
                counts: Arc::clone(self.migrating.counts()),
            }));
    }

    /// What an operator should hear about the prefill pool that does not make the hop
    /// unready: engines whose KV events never started, were lost, are partial, or come at
    /// another block size than the card's (feature `engine`; `serve` shows them on `/ready`).
    pub fn warnings(&self) -> Vec<String> {
        #[cfg(feature = "engine")]
        {
            self.stats
                .engine_kv
                .statuses()
                .into_iter()
                .filter_map(|(engine, status)| {
                    status
                        .warning()
                        .map(|w| format!("prefill engine {engine}: {w}"))
                })
                .collect()
        }
        #[cfg(not(feature = "engine"))]
        Vec::new()
    }

    /// Stop in order and wait: (1) the topology watcher (no retarget after this), (2) the
    /// prefill router (build and retry cancelled, binding retired; requests holding it finish
    /// on it) and its tasks, (3) the decode follower and its discovery feed. Idempotent.
    /// Requests arriving meanwhile fail with `NotActivated` (`shut_down`).
    pub async fn shutdown(&self) {
        if self.shut_down.swap(true, Ordering::AcqRel) {
            self.tracker.wait().await;
            return;
        }
        let watcher = self.watcher.lock().take();
        if let Some(watcher) = watcher {
            watcher.stopped().await;
        }
        self.router.shutdown();
        self.router.terminated().await;
        self.cancel.cancel();
        self.tracker.wait().await;
        self.decode.clear();
        self.status.send_replace(self.status());
        tracing::info!("prefill hop shut down");
    }
}

impl Drop for PrefillHop {
    fn drop(&mut self) {
        self.shut_down.store(true, Ordering::Release);
        if let Some(watcher) = self.watcher.get_mut().take() {
            watcher.shutdown();
        }
        self.router.shutdown();
        self.cancel.cancel();
    }
}
