//! [`PrefillRouter`]: the handle a frontend embeds.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::config::PrefillRouterConfig;
use super::driver::{deadline_after, Driver};
use super::error::{GenerateError, WaitError};
use super::fallback::{AfterWait, Fallback, FallbackPolicy, Final};
use super::handoffs::Obligation;
use super::metrics::{RouterCollector, StatusSource};
use super::mutant::RouterSeam;
use super::shared::{Announced, Msg, Shared};
use super::status::{bump, RouterStatus, Tally};
use crate::binding::{Binding as _, BindingFactory, PrefillError, WorkerSetTarget};
use crate::control::Control;
use crate::decode::{Decode, DecodeError, DecodeStream};
use crate::handoff::AbandonReason;
use crate::lifecycle::Lifecycle;
use crate::request::{GenerateRequest, GenerateResponse};
use crate::snapshot::{BypassReason, Route, SnapshotGuard};

/// Times [`PrefillRouter::generate`] routes one request again after its binding was retired
/// under it (each time means another retarget raced the request: a bound keeps a storm finite).
pub const MAX_REROUTES: u32 = 3;

/// How one routing attempt ended without a stream.
enum Failed {
    Error(GenerateError),
    /// Route the request again (it is handed back untouched).
    Reroute(GenerateRequest),
}

impl From<GenerateError> for Failed {
    fn from(error: GenerateError) -> Self {
        Failed::Error(error)
    }
}

impl From<DecodeError> for Failed {
    fn from(error: DecodeError) -> Self {
        Failed::Error(GenerateError::from(error))
    }
}

/// The prefill hop of one model: routes each request's prefill while a controller retargets
/// the hop, and falls back by policy while it is not Active.
///
/// The decisions are the proven [`lifecycle`](crate::lifecycle) machine's, applied by the
/// [`Control`] core; this handle adds a driver task that builds bindings with the factory
/// (with a build timeout) and arms retry timers (with jitter), and nothing else. See
/// `docs/router.md`.
///
/// Dropping the router (or calling [`shutdown`](Self::shutdown)) ends every task it spawned.
pub struct PrefillRouter<F: BindingFactory> {
    shared: Arc<Shared<F>>,
}

impl<F: BindingFactory> PrefillRouter<F> {
    /// A router building bindings with `factory`. Spawns the driver on the current tokio
    /// runtime.
    ///
    /// # Panics
    /// If called outside a tokio runtime (like `tokio::spawn`).
    pub fn new(factory: F, config: PrefillRouterConfig) -> Self {
        Self::build(factory, config, RouterSeam::default())
    }

    /// A router running a deliberate mutant of its request path (see
    /// [`RouterMutant`](super::RouterMutant)).
    #[cfg(test)]
    pub(crate) fn with_mutant(
        factory: F,
        config: PrefillRouterConfig,
        mutant: super::RouterMutant,
    ) -> Self {
        Self::build(factory, config, RouterSeam::on(Some(mutant), None))
    }

    /// A router awaiting `hook` between each conditional estimate and its dispatch, running
    /// `mutant` if any.
    #[cfg(test)]
    pub(crate) fn with_pause_before_dispatch(
        factory: F,
        config: PrefillRouterConfig,
        hook: super::PauseBeforeDispatch,
        mutant: Option<super::RouterMutant>,
    ) -> Self {
        Self::build(factory, config, RouterSeam::on(mutant, Some(hook)))
    }

    fn build(factory: F, config: PrefillRouterConfig, seam: RouterSeam<F::Binding>) -> Self {
        let (to_driver, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            control: Control::new(config.retry),
            factory,
            config,
            tally: Tally::default(),
            to_driver,
            announced: watch::Sender::new(Announced {
                epoch: 0,
                lifecycle: Lifecycle::Pending,
            }),
            lifecycle: watch::Sender::new(Lifecycle::Pending),
            retirements: watch::Sender::new(0),
            cancel: CancellationToken::new(),
            tracker: TaskTracker::new(),
            shut_down: Default::default(),
            seam,
        });
        let driver = Driver::new(Arc::clone(&shared), rx);
        shared.tracker.spawn(driver.run());
        PrefillRouter { shared }
    }

    /// The controller's decision: prefill on `target`, or on nothing (`None`).
    ///
    /// Synchronous and never awaits (callable from any thread, under the caller's own locks).
    /// When it returns, every later [`route`](Self::route) sees the new decision: a clear or a
    /// retarget is never observed late by a request that loads the route afterwards.
    pub fn set_target(&self, target: Option<WorkerSetTarget>) {
        let effects = self.shared.control.set_target(target);
        self.shared.dispatch(Msg::Effects(effects));
    }

    /// The route for one request: prefill on this binding (holding the `Arc` keeps it usable
    /// even if it is retired meanwhile), or bypass and why. One lock-free load.
    #[inline]
    pub fn route(&self) -> Route<F::Binding> {
        self.shared.seam.route(|| self.shared.control.route())
    }

    /// The current snapshot, pinned (for decisions that need the target or epoch too). Do not
    /// hold it across an `.await`.
    #[inline]
    pub fn load(&self) -> SnapshotGuard<WorkerSetTarget, F::Binding> {
        self.shared.control.load()
    }

    /// Serve one request: when Active, prefill on the loaded binding with `max_tokens` 1 and
    /// hand off to `decode` with the original request; otherwise apply the fallback policy.
    /// With a [`ConditionalPolicy`](super::ConditionalPolicy) configured, an Active hop first
    /// asks the binding for its pick ([`Binding::pick`](crate::binding::Binding::pick)) and sends the
    /// request to decode whole when the policy says skip; otherwise it prefills on that pick,
    /// on the same binding.
    ///
    /// A prefill error fails the request ([`GenerateError::Prefill`]); decode is not tried,
    /// except when the prefill found no reachable worker
    /// ([`PrefillError::no_reachable_worker`]) and the fallback policy bypasses (`Decode`, or
    /// `WaitUpTo { then: Decode }`, without waiting): then decode runs the whole request, as
    /// it would had the hop not been Active (counted in `unreachable_bypassed`).
    ///
    /// A request whose binding is retired between its route load and its pick of a worker,
    /// and whose admission set empties meanwhile (a retarget storm does it), would fail with
    /// [`PrefillError::NoRoutableWorker`] although nothing was sent anywhere: it is routed
    /// again on the current snapshot instead, at most [`MAX_REROUTES`] times (counted in
    /// `rerouted`).
    pub async fn generate(
        &self,
        mut request: GenerateRequest,
        decode: &dyn Decode,
    ) -> Result<DecodeStream, GenerateError> {
        let mut reroutes = 0;
        loop {
            match self.attempt(request, decode, reroutes < MAX_REROUTES).await {
                Ok(stream) => return Ok(stream),
                Err(Failed::Error(error)) => return Err(error),
                Err(Failed::Reroute(back)) => {
                    bump(&self.shared.tally.rerouted);
                    reroutes += 1;
                    request = back;
                }
            }
        }
    }

    /// One routing of `request`; `may_reroute` lets it come back as [`Failed::Reroute`].
    async fn attempt(
        &self,
        request: GenerateRequest,
        decode: &dyn Decode,
        may_reroute: bool,
    ) -> Result<DecodeStream, Failed> {
        let binding = match self.route() {
            Route::Prefill(binding) => binding,
            Route::Bypass(reason) => {
                let decision = match self.shared.config.fallback.decide(reason) {
                    Fallback::Wait(timeout, then) => {
                        bump(&self.shared.tally.waited);
                        match self.route_within(timeout).await {
                            Route::Prefill(binding) => {
                                return self
                                    .prefill_then_decode(binding, request, decode, may_reroute)
                                    .await
                            }
                            Route::Bypass(reason) => then.apply(reason),
                        }
                    }
                    Fallback::Now(decided) => decided,
                };
                return match decision {
                    Final::Reject(reason) => {
                        self.shared.tally.reject(reason);
                        Err(GenerateError::NotActivated { reason }.into())
                    }
                    Final::Bypass(reason) => {
                        self.shared.tally.bypass(reason);
                        Ok(decode.decode(request, None).await?)
                    }
                };
            }
        };
        self.prefill_then_decode(binding, request, decode, may_reroute)
            .await
    }

    /// A migrated stream's continuation (docs/health.md, "Migration"): prefilled on the active
    /// binding's pick (the KV-aware pick finds the prefix the first prefill left) and decoded
    /// on `decode` with the new handoff. `None` when nothing reached a decode worker: the hop
    /// is not Active (no waiting: the client's stream is paused), or the prefill failed; the
    /// caller then sends the continuation to decode, which prefills it itself. Counted as any
    /// request in the router's tallies.
    pub(crate) async fn prefill_continuation(
        &self,
        request: GenerateRequest,
        decode: &dyn Decode,
    ) -> Option<Result<DecodeStream, DecodeError>> {
        let Route::Prefill(binding) = self.route() else {
            return None;
        };
        match self
            .prefill_then_decode(binding, request, decode, false)
            .await
        {
            Ok(stream) => Some(Ok(stream)),
            Err(Failed::Error(GenerateError::Decode(error))) => Some(Err(error)),
            Err(Failed::Error(error)) => {
                tracing::info!(%error, "a continuation's prefill failed: its decode worker prefills it");
                None
            }
            // Not asked for (`may_reroute` false); decode takes it as when the hop is idle.
            Err(Failed::Reroute(_)) => None,
        }
    }

    async fn prefill_then_decode(
        &self,
        binding: Arc<F::Binding>,
        request: GenerateRequest,
        decode: &dyn Decode,
        may_reroute: bool,
    ) -> Result<DecodeStream, Failed> {
        let prefill_request = GenerateRequest {
            max_tokens: 1,
            handoff: None,
            ..request.clone()
        };
        // Conditional disaggregation: pick on this binding, decide, then dispatch on this
        // very pick of this very binding (or drop it). Never a second route load (W10).
        let pick = match &self.shared.config.conditional {
            None => None,
            Some(policy) => {
                let pick = match binding.pick(&prefill_request) {
                    Ok(pick) => pick,
                    Err(error) => {
                        return self
                            .prefill_failed(error, &binding, request, decode, may_reroute)
                            .await
                    }
                };
                if let Some(skip) = policy.decide(pick.estimate()) {
                    drop(pick);
                    drop(binding);
                    self.shared.tally.skip(skip);
                    tracing::trace!(router = %self.shared.config.name, %skip, "prefill skipped: decode runs the whole request");
                    return Ok(decode.decode(request, None).await?);
                }
                self.shared.seam.before_dispatch().await;
                Some(pick)
            }
        };
        let binding = match pick {
            Some(_) => self.shared.seam.dispatch_binding(binding, || self.route()),
            None => binding,
        };
        bump(&self.shared.tally.prefilled);
        let prefill = match pick {
            Some(pick) => binding.prefill_picked(pick, prefill_request),
            None => binding.prefill(prefill_request),
        };
        let result = match self.shared.config.drain_cap {
            None => prefill.await,
            Some(cap) => {
                tokio::select! {
                    result = prefill => result,
                    () = self.drained(&binding, cap) => {
                        bump(&self.shared.tally.drained);
                        return Err(GenerateError::Drained { after: cap }.into());
                    }
                }
            }
        };
        let outcome = match result {
            Ok(outcome) => outcome,
            Err(error) => {
                return self
                    .prefill_failed(error, &binding, request, decode, may_reroute)
                    .await
            }
        };
        // The binding is not needed for decode: release it so a retired one can go.
        drop(binding);
        // From here the handoff (if single-use) ends exactly once, counted, whatever happens
        // to this future (docs/engines.md, "The handoff rules").
        let mut obligation = Obligation::of(outcome.handoff.as_ref(), &self.shared.tally.handoffs);
        if outcome.is_terminal() {
            obligation.abandon(AbandonReason::PrefillFinished);
            let response = GenerateResponse {
                token_ids: outcome.tokens,
                finish: outcome.finish,
                prefill: outcome.handoff,
                ..GenerateResponse::default()
            };
            return Ok(Box::pin(futures_util::stream::iter([Ok(response)])));
        }
        let decode_request = GenerateRequest {
            handoff: outcome.handoff.clone(),
            ..request
        };
        let decoded = decode.decode(decode_request, Some(outcome)).await;
        obligation.decoded(&decoded);
        Ok(decoded?)
    }

    /// How a request whose prefill (or pick) on `binding` failed with `error` ends.
    async fn prefill_failed(
        &self,
        error: PrefillError,
        binding: &Arc<F::Binding>,
        request: GenerateRequest,
        decode: &dyn Decode,
        may_reroute: bool,
    ) -> Result<DecodeStream, Failed> {
        match error {
            // Nothing was sent: the binding lost its last admitted worker because it was
            // retired under this request. Route again on what is published now.
            PrefillError::NoRoutableWorker if may_reroute && !self.serves(binding) => {
                Err(Failed::Reroute(request))
            }
            // No prefill worker could be reached: the hop is as good as not Active for this
            // request, so the fallback policy decides.
            error if error.no_reachable_worker() && self.bypasses_unreachable() => {
                bump(&self.shared.tally.unreachable_bypassed);
                tracing::debug!(router = %self.shared.config.name, %error, "no reachable prefill worker: decode runs the whole request");
                Ok(decode.decode(request, None).await?)
            }
            error => {
                bump(&self.shared.tally.prefill_errors);
                Err(GenerateError::Prefill(error).into())
            }
        }
    }

    /// Whether the fallback policy sends a request whose prefill found no reachable worker to
    /// decode (it does not wait: the pool was there and is gone).
    fn bypasses_unreachable(&self) -> bool {
        match self.shared.config.fallback {
            FallbackPolicy::Decode => true,
            FallbackPolicy::Reject => false,
            FallbackPolicy::WaitUpTo { then, .. } => then == AfterWait::Decode,
        }
    }

    /// Whether the published route still prefills on `binding` (a cleared hop keeps its
    /// binding held for reuse, but no longer serves it).
    fn serves(&self, binding: &Arc<F::Binding>) -> bool {
        match self.route() {
            Route::Prefill(current) => Arc::ptr_eq(&current, binding),
            Route::Bypass(_) => false,
        }
    }

    /// Completes `cap` after `binding` stops being the held one (it was retired); never while
    /// it is held.
    async fn drained(&self, binding: &Arc<F::Binding>, cap: Duration) {
        let mut retirements = self.shared.retirements.subscribe();
        loop {
            // Seen before the check: a retirement after it is announced after it.
            retirements.borrow_and_update();
            if !self.shared.control.holds(binding) {
                break;
            }
            if retirements.changed().await.is_err() {
                // The sender lives in `shared`, which we hold: cannot close.
                std::future::pending::<()>().await;
            }
        }
        tracing::debug!(router = %self.shared.config.name, ?cap, "prefill on a retired binding: drain cap armed");
        tokio::time::sleep(cap).await;
    }

    /// The route once the hop is Active, or the last bypass when `timeout` passes (or at once
    /// after shutdown).
    async fn route_within(&self, timeout: Duration) -> Route<F::Binding> {
        let deadline = deadline_after(timeout);
        let mut announced = self.shared.announced.subscribe();
        loop {
            // Mark the current announcement seen *before* loading the route: any change after
            // the load is announced after it, so `changed` below cannot miss it.
            announced.borrow_and_update();
            let route = self.route();
            match route.bypass() {
                None => return route,
                Some(reason) if Shared::<F>::is_final(reason) => return route,
                Some(_) => {}
            }
            match tokio::time::timeout_at(deadline, announced.changed()).await {
                Ok(Ok(())) => continue,
                // The sender lives in `shared`, which we hold: cannot close; stop waiting.
                Ok(Err(_)) | Err(_) => return self.route(),
            }
        }
    }

    /// Wait until the hop is Active, at most `timeout`.
    pub async fn wait_active(&self, timeout: Duration) -> Result<(), WaitError> {
        match self.route_within(timeout).await.bypass() {
            None => Ok(()),
            Some(BypassReason::ShutDown) => Err(WaitError::ShutDown),
            Some(_) => Err(WaitError::TimedOut {
                after: timeout,
                lifecycle: self.load().lifecycle(),
            }),
        }
    }

    /// A consistent picture of the router (takes the control lock briefly).
    pub fn status(&self) -> RouterStatus {
        self.shared.status()
    }

    /// The published lifecycle, as a watch channel (the current value, then every change).
    pub fn subscribe(&self) -> watch::Receiver<Lifecycle> {
        self.shared.lifecycle.subscribe()
    }

    /// The configuration.
    pub fn config(&self) -> &PrefillRouterConfig {
        &self.shared.config
    }

    /// Stop for good: cancel the build and the retry, retire the binding (requests holding it
    /// finish on it), publish ShutDown, and end every task. Idempotent; Drop calls it.
    pub fn shutdown(&self) {
        if self.shared.shut_down.swap(true, Ordering::AcqRel) {
            return;
        }
        let effects = self.shared.control.shutdown();
        // The effects are cancellations only; the root token below covers them all, so they
        // need no driver.
        drop(effects);
        self.shared.announce();
        self.shared.cancel.cancel();
        self.shared.tracker.close();
        tracing::debug!(router = %self.shared.config.name, "prefill router shut down");
    }

    /// A future that completes once every task the router spawned has ended (after
    /// [`shutdown`](Self::shutdown) or Drop). Does not keep the router alive.
    pub fn terminated(&self) -> impl Future<Output = ()> + Send + 'static {
        let tracker = self.shared.tracker.clone();
        async move { tracker.wait().await }
    }

    /// Register this router's metrics (see [`metrics`](super::metrics)) in `registry`, under
    /// the prefix `prefill_router` and the label `router` = the configured name.
    pub fn register_metrics(&self, registry: &mut Registry) {
        let source: Arc<dyn StatusSource> = self.shared.clone();
        let collector = RouterCollector {
            source: Arc::downgrade(&source),
        };
        registry
            .sub_registry_with_prefix("prefill_router")
            .sub_registry_with_label(("router".into(), self.shared.config.name.clone().into()))
            .register_collector(Box::new(collector));
    }

    /// Hand the driver a batch directly, bypassing `Control` (tests of the driver's handling
    /// of reordered batches).
    #[cfg(test)]
    pub(crate) fn inject(&self, effects: crate::control::Effects<WorkerSetTarget>) {
        let _ = self.shared.to_driver.send(Msg::Effects(effects));
    }

    /// How many tasks the router has alive (driver and builds); 0 once terminated.
    pub fn tasks_alive(&self) -> usize {
        self.shared.tracker.len()
    }
}

impl<F: BindingFactory> Drop for PrefillRouter<F> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl<F: BindingFactory> std::fmt::Debug for PrefillRouter<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillRouter")
            .field("status", &self.status())
            .finish()
    }
}
