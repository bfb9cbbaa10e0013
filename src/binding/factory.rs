//! [`DefaultBindingFactory`] and the binding it builds.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::Instrument;

use crate::advert::{self, DecodeDefaults, PrefillConfig};
use crate::discovery::{Discovery, EndpointId, InstanceId};
use crate::push::{PushConfig, PushMode, PushRouter, RoutableView};
use crate::router::{
    BindingFactory, BuildError, Prefill, PrefillError, PrefillOutcome, WorkerSetTarget,
    WorkerSetTargetId,
};
use crate::transport::GenerateRequest;

/// Settings of the default factory.
#[derive(Clone, Debug, Default)]
pub struct FactoryConfig {
    /// What the decode set contributes when the prefill card is silent (mode, KV tuning,
    /// block size, session-affinity TTL).
    pub decode: DecodeDefaults,
    /// Settings of every prefill push router built.
    pub push: PushConfig,
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
}

/// Builds [`PrefillBinding`]s over a discovery backend and push routers.
#[derive(Clone)]
pub struct DefaultBindingFactory {
    discovery: Arc<dyn Discovery>,
    config: FactoryConfig,
    stats: Arc<BindingStats>,
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
        }
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
        let view = RoutableView::spawn(events, Some(target.admitted.clone()), feed.clone());
        // 3. Activation must mean servable: wait for one admitted, routable instance. On an
        //    empty admission set this waits until the router's build timeout (a failure, so
        //    the machine retries), never forever.
        view.wait_for(|routable| !routable.is_empty()).await;
        // 4. The push router in the resolved mode and block size.
        let mode = PushMode::from_prefill_config(&resolved, None);
        let router = PushRouter::new(view, mode, self.config.push.clone());
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
            router,
            stats: Arc::clone(&self.stats),
            _feed: feed.drop_guard(),
        })
    }
}

/// One target's prefill push router. Retired bindings keep following their own admission set;
/// once it is empty a new prefill fails at once ([`crate::push::PushError::NoRoutableInstances`]).
pub struct PrefillBinding {
    id: WorkerSetTargetId,
    endpoint: EndpointId,
    admitted: watch::Receiver<BTreeSet<InstanceId>>,
    resolved: PrefillConfig,
    router: PushRouter,
    stats: Arc<BindingStats>,
    /// Stops the view's discovery feed when the binding goes.
    _feed: DropGuard,
}

impl std::fmt::Debug for PrefillBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillBinding")
            .field("id", &self.id)
            .field("endpoint", &self.endpoint)
            .field("mode", self.router.mode())
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

    /// The push router (mode, view).
    pub fn router(&self) -> &PushRouter {
        &self.router
    }
}

impl Prefill for PrefillBinding {
    fn prefill(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        async move {
            let before = self.admitted.borrow().clone();
            let stream = self.router.generate(request).await?;
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
}
