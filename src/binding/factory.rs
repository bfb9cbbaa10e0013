//! [`DefaultBindingFactory`] and the binding it builds.

mod mutant;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::Instrument;

use super::TokenLoad;
use crate::advert::{self, DecodeDefaults, EngineCard, PrefillConfig};
use crate::binding::{
    Binding, BindingFactory, BindingHealth, BuildError, PrefillError, PrefillEstimate,
    PrefillOutcome, PrefillPick, WorkerSetTarget, WorkerSetTargetId,
};
use crate::discovery::{Discovery, EndpointId, InstanceId};
use crate::push::HeldPick;
use crate::push::{Dispatcher, PushConfig, PushError, PushMode, RoutableView};
use crate::request::GenerateRequest;
#[cfg(test)]
pub(crate) use mutant::FactoryMutant;
use mutant::FactorySeam;

/// How long a prefill waits for its view to show admitted instances it has not discovered
/// yet before failing with [`crate::push::PushError::NoRoutableInstances`].
pub const DISCOVERY_CATCH_UP: std::time::Duration = std::time::Duration::from_secs(1);

/// Settings of the default factory.
#[derive(Clone, Debug, Default)]
pub struct FactoryConfig {
    /// What the decode set contributes when the prefill card is silent (mode, KV tuning,
    /// block size, session-affinity TTL).
    pub decode: DecodeDefaults,
    /// Settings of every prefill dispatcher built.
    pub push: PushConfig,
    /// Timeouts of the links to engines, when the set's card names an engine protocol.
    #[cfg(feature = "engine")]
    pub engine: crate::engine::EngineLinkConfig,
}

/// Dispatch counters shared by every binding one factory built (for demos and tests).
#[derive(Debug, Default)]
pub struct BindingStats {
    /// Prefills dispatched to a worker.
    pub dispatched: AtomicU64,
    /// Dispatches to a worker that was in the binding's admission set neither just before the
    /// pick nor just after the dispatch: a routing bug, must stay 0.
    pub outside_admission: AtomicU64,
    /// Builds that completed.
    pub built: AtomicU64,
    /// Prefills retried on another worker, by failure class (every binding's dispatcher counts
    /// here).
    pub retries: Arc<crate::push::RetryCounts>,
    /// Session-affinity hits, misses, re-picks and evictions (every binding's dispatcher
    /// counts here; each binding keeps its own table).
    pub affinity: Arc<crate::push::AffinityCounts>,
    /// Requests queued and shed because every worker was over the busy threshold (every
    /// binding's dispatcher counts here).
    pub overload: Arc<crate::push::OverloadCounts>,
    /// KV-mode picks with and without overlap (every binding's dispatcher counts here).
    pub kv_decisions: Arc<crate::push::KvDecisionCounts>,
    /// What every engine binding knows of its engines' KV events (feature `engine`; KV mode
    /// only): per engine, its feed's state, picture, counts and freshness.
    #[cfg(feature = "engine")]
    pub engine_kv: Arc<crate::engine::EngineKvBoard>,
}

/// Builds [`PrefillBinding`]s over a discovery backend and dispatchers.
#[derive(Clone)]
pub struct DefaultBindingFactory {
    discovery: Arc<dyn Discovery>,
    config: FactoryConfig,
    stats: Arc<BindingStats>,
    /// Where the factory's mutants break its builds; zero-sized in normal builds.
    seam: FactorySeam,
}

impl std::fmt::Debug for DefaultBindingFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DefaultBindingFactory")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl DefaultBindingFactory {
    /// A factory over `discovery`.
    pub fn new(discovery: Arc<dyn Discovery>, config: FactoryConfig) -> Self {
        DefaultBindingFactory {
            discovery,
            config,
            stats: Arc::default(),
            seam: FactorySeam::default(),
        }
    }

    /// The factory running a deliberate mutant of its builds (see [`FactoryMutant`]).
    #[cfg(test)]
    pub(crate) fn with_mutant(mut self, mutant: FactoryMutant) -> Self {
        self.seam = FactorySeam::on(mutant);
        self
    }

    /// The counters of every binding this factory built.
    pub fn stats(&self) -> Arc<BindingStats> {
        Arc::clone(&self.stats)
    }
}

impl BindingFactory for DefaultBindingFactory {
    type Binding = PrefillBinding;

    fn build(
        &self,
        target: WorkerSetTarget,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, Result<PrefillBinding, BuildError>> {
        let span = tracing::info_span!(
            "prefill_binding",
            target = %target.id,
            endpoint = %target.endpoint,
        );
        let this = self.clone();
        async move {
            tokio::select! {
                biased;
                () = cancel.cancelled() => Err(BuildError::new("build cancelled")),
                built = this.build_inner(target, &cancel) => built,
            }
        }
        .instrument(span)
        .boxed()
    }
}

impl DefaultBindingFactory {
    /// A new binding's dispatcher over `view`: the resolved mode, the factory's shared
    /// counters, and session affinity at the resolved TTL in a table of its own (never one an
    /// earlier binding used: a rebuilt binding starts empty).
    pub(crate) fn dispatcher(&self, view: RoutableView, resolved: &PrefillConfig) -> Dispatcher {
        let mode = PushMode::from_prefill_config(resolved, None);
        self.equip(
            Dispatcher::new(view, mode, self.config.push.clone()),
            resolved,
        )
    }

    /// A new binding's dispatcher to the engines of `view`, which speak `engine` (the set's
    /// card says so); a build without feature `engine` cannot reach them.
    fn engine_dispatcher(
        &self,
        view: RoutableView,
        resolved: &PrefillConfig,
        engine: &EngineCard,
    ) -> Result<Dispatcher, BuildError> {
        #[cfg(feature = "engine")]
        {
            tracing::info!(protocol = %engine.protocol, "the prefill set's workers are engines");
            let mode = PushMode::from_prefill_config(resolved, None);
            let link = crate::engine::EngineLink::new(
                crate::engine::EngineRole::Prefill,
                resolved.block_size,
                self.config.engine.clone(),
            )
            .with_kv_board(Arc::clone(&self.stats.engine_kv));
            let dispatcher = Dispatcher::with_engine(view, mode, self.config.push.clone(), link);
            Ok(self.equip(dispatcher, resolved))
        }
        #[cfg(not(feature = "engine"))]
        {
            let _ = (view, resolved);
            Err(BuildError::new(format!(
                "the prefill set's workers are {} engines: this build lacks feature `engine`",
                engine.protocol
            )))
        }
    }

    /// The factory's shared counters and a fresh affinity table on `dispatcher`.
    fn equip(&self, dispatcher: Dispatcher, resolved: &PrefillConfig) -> Dispatcher {
        let dispatcher = dispatcher
            .with_retry_counts(Arc::clone(&self.stats.retries))
            .with_overload_counts(Arc::clone(&self.stats.overload))
            .with_kv_decision_counts(Arc::clone(&self.stats.kv_decisions))
            .with_session_affinity(
                resolved.session_affinity_ttl,
                Arc::clone(&self.stats.affinity),
            );
        let table = self
            .seam
            .affinity_table(dispatcher.affinity_table().cloned());
        dispatcher.with_affinity_table(table)
    }

    async fn build_inner(
        &self,
        target: WorkerSetTarget,
        cancel: &CancellationToken,
    ) -> Result<PrefillBinding, BuildError> {
        // 1. Resolve from exactly the committed card.
        let resolved = advert::resolve(std::slice::from_ref(&*target.card), &self.config.decode)
            .map_err(|e| BuildError::new(e.to_string()))?;
        // 2. The routable view: endpoint instances ∩ admission. Its feed task hangs off a
        //    child of the build token (router shutdown ends it) and the binding's drop guard
        //    (retiring and dropping the binding ends it).
        let events = self
            .discovery
            .watch(&target.endpoint)
            .await
            .map_err(|e| BuildError::new(format!("watching {}: {e}", target.endpoint)))?;
        let feed = cancel.child_token();
        let admission = if self.seam.ignores_admission() {
            None
        } else {
            Some(target.admitted.clone())
        };
        let view =
            RoutableView::spawn_with(events, admission, feed.clone(), self.config.push.health);
        // 3. Activation must mean servable: wait for one admitted, routable instance. On an
        //    empty admission set this waits until the router's build timeout (a failure, so
        //    the machine retries), never forever.
        view.wait_for(|routable| !routable.is_empty()).await;
        // 4. The dispatcher in the resolved mode and block size, with a fresh affinity table.
        let router = match &target.card.engine {
            None => self.dispatcher(view, &resolved),
            Some(engine) => self.engine_dispatcher(view, &resolved, engine)?,
        };
        // 5. The resolved configuration, once per activation (upstream's log line).
        tracing::info!(
            prefill_router_mode = %resolved.router_mode,
            decode_router_mode = %self.config.decode.router_mode,
            advertised = resolved.advertised,
            enable_eagle = resolved.enable_eagle,
            block_size = resolved.block_size,
            session_affinity_ttl = ?resolved.session_affinity_ttl,
            kv_router_config = ?resolved.kv_router_config,
            admitted = ?*target.admitted.borrow(),
            "prefill binding built with the resolved configuration"
        );
        self.stats.built.fetch_add(1, Ordering::Relaxed);
        Ok(PrefillBinding {
            id: target.id,
            endpoint: target.endpoint,
            admitted: target.admitted,
            resolved,
            dispatcher: router,
            stats: Arc::clone(&self.stats),
            inflight_tokens: Arc::default(),
            _feed: feed.drop_guard(),
        })
    }
}

/// One target's prefill dispatcher. Retired bindings keep following their own admission set;
/// once it is empty a new prefill fails at once ([`crate::push::PushError::NoRoutableInstances`]).
pub struct PrefillBinding {
    id: WorkerSetTargetId,
    endpoint: EndpointId,
    admitted: watch::Receiver<BTreeSet<InstanceId>>,
    resolved: PrefillConfig,
    dispatcher: Dispatcher,
    stats: Arc<BindingStats>,
    /// Uncached prompt tokens of the prefills picked on this binding and not finished (the
    /// conditional policy's pool load).
    inflight_tokens: Arc<AtomicU64>,
    /// Stops the view's discovery feed when the binding goes.
    _feed: DropGuard,
}

/// What a [`PrefillBinding`]'s pick holds until its dispatch: the dispatcher's selection (the
/// worker and its share of the KV load) and the request's share of the pool's token load.
struct BindingPick {
    selection: HeldPick,
    load: TokenLoad,
}

impl std::fmt::Debug for PrefillBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillBinding")
            .field("id", &self.id)
            .field("endpoint", &self.endpoint)
            .field("mode", self.dispatcher.mode())
            .finish_non_exhaustive()
    }
}

impl PrefillBinding {
    /// The target this binding was built for.
    pub fn id(&self) -> &WorkerSetTargetId {
        &self.id
    }

    /// The resolved configuration of the hop.
    pub fn resolved(&self) -> &PrefillConfig {
        &self.resolved
    }

    /// The dispatcher (mode, view).
    pub fn dispatcher(&self) -> &Dispatcher {
        &self.dispatcher
    }
}

impl Binding for PrefillBinding {
    fn prefill(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        async move {
            let before = self.admitted.borrow().clone();
            let view = self.dispatcher.view();
            if view.routable().is_empty() && before.iter().any(|id| !view.is_discovered(*id)) {
                // Admitted instances this view's own discovery watch has not shown yet: the
                // watcher (namespace watch) and the view (endpoint watch) read two streams with
                // no common order, e.g. a returning pool re-activates the reused binding first.
                // Wait briefly for the view to catch up; an empty admission set never waits,
                // and neither does a pool whose admitted instances are all discovered but
                // unroutable (every breaker open: the pool died): that fails at once, and the
                // router applies the fallback policy.
                let _ = tokio::time::timeout(
                    DISCOVERY_CATCH_UP,
                    view.wait_for(|routable| !routable.is_empty()),
                )
                .await;
            }
            let stream = match self.dispatcher.generate(request).await {
                Err(PushError::NoRoutableInstances) => {
                    // Admitted instances this view no longer discovers: its endpoint watch saw
                    // them leave before the topology watcher retargeted (two streams, no common
                    // order). The retarget shrinks the admission set right after it moves the
                    // route on, so wait for that (briefly): the router then sees the binding
                    // no longer served and routes the request again.
                    let mut admitted = self.admitted.clone();
                    let view = self.dispatcher.view();
                    let leaving = admitted
                        .borrow_and_update()
                        .iter()
                        .any(|id| !view.is_discovered(*id));
                    if leaving {
                        let _ = tokio::time::timeout(DISCOVERY_CATCH_UP, admitted.changed()).await;
                    }
                    return Err(PushError::NoRoutableInstances.into());
                }
                other => other?,
            };
            let worker = stream.instance_id();
            self.stats.dispatched.fetch_add(1, Ordering::Relaxed);
            if !before.contains(&worker) && !self.admitted.borrow().contains(&worker) {
                self.stats.outside_admission.fetch_add(1, Ordering::Relaxed);
                tracing::error!(target = %self.id, worker, "prefill routed outside the admission set");
            }
            PrefillOutcome::collect(worker, stream).await
        }
        .boxed()
    }

    /// The dispatcher's held pick; the estimate's cached tokens are its expected overlap
    /// (KV mode; 0 otherwise) times the block size, its load the binding's in-flight
    /// uncached tokens over the routable workers. A pick that finds nothing routable, or every
    /// worker over the busy threshold, holds nothing: its dispatch then takes
    /// [`prefill`](Binding::prefill)'s path (which waits for the view to catch up or for room
    /// in the overload queue, or fails typed).
    fn pick(&self, request: &GenerateRequest) -> Result<PrefillPick, PrefillError> {
        let mut estimate = PrefillEstimate::prompt_only(request.token_ids.len());
        let selection = match self.dispatcher.select_held(request) {
            Ok(selection) => selection,
            // Nothing routable, or every worker over the busy threshold: hold nothing; the
            // dispatch takes `prefill`'s path, which waits (for the view, or for room in the
            // overload queue) or fails typed.
            Err(PushError::NoRoutableInstances | PushError::Overloaded { .. }) => {
                return Ok(PrefillPick::new(estimate, None))
            }
            Err(error) => return Err(error.into()),
        };
        let overlap = selection.expected_overlap_blocks().unwrap_or(0);
        let cached = u64::try_from(overlap)
            .unwrap_or(u64::MAX)
            .saturating_mul(u64::from(self.resolved.block_size));
        estimate.cached_tokens = u32::try_from(cached)
            .unwrap_or(u32::MAX)
            .min(estimate.prompt_tokens);
        let workers = u64::try_from(self.dispatcher.view().routable().len().max(1)).unwrap_or(1);
        estimate.pool_tokens_per_worker = self.inflight_tokens.load(Ordering::Relaxed) / workers;
        let load = TokenLoad::new(&self.inflight_tokens, u64::from(estimate.uncached_tokens()));
        Ok(PrefillPick::new(
            estimate,
            Some(Box::new(BindingPick { selection, load })),
        ))
    }

    /// Dispatches the held selection ([`Dispatcher::dispatch_held`]): its booking moves into
    /// the routed stream, so the pick's KV load counts until the prefill ends, as on
    /// [`prefill`](Binding::prefill)'s path. If that send fails (the worker left the view, or
    /// the connection failed: nothing reached a worker), the request takes `prefill`'s path
    /// on this same binding: a fresh pick with retries.
    fn prefill_picked(
        &self,
        pick: PrefillPick,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        let Some(held) = pick.into_held_as::<BindingPick>() else {
            return self.prefill(request);
        };
        async move {
            let BindingPick { selection, load } = *held;
            let worker = selection.instance().instance_id;
            // The failed send released the booking with the selection.
            let stream = match self.dispatcher.dispatch_held(selection, request.clone()).await {
                Ok(stream) => stream,
                Err(error) => {
                    tracing::debug!(target = %self.id, worker, %error, "picked worker unreachable: picking again");
                    drop(load);
                    return self.prefill(request).await;
                }
            };
            // Routable (so admitted) at the send: the direct dispatch checks.
            self.stats.dispatched.fetch_add(1, Ordering::Relaxed);
            let outcome = PrefillOutcome::collect(worker, stream).await;
            drop(load);
            outcome
        }
        .boxed()
    }

    fn health(&self) -> BindingHealth {
        BindingHealth::new(
            self.dispatcher.view().open_breakers(),
            self.dispatcher.retry_counts().snapshot(),
        )
        .with_affinity(self.stats.affinity.snapshot())
        .with_overload(self.dispatcher.overload_stats())
        .with_routable(self.dispatcher.view().routable().len())
    }
}

#[cfg(test)]
mod tests;
