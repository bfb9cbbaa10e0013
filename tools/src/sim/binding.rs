//! The in-memory side of the request path: a binding factory whose builds a seeded RNG
//! makes succeed, fail, hang or outlive their cancellation; bindings that route with the real
//! [`RoutableView`] and [`Dispatcher`] (its pick, booking, retry elsewhere and release) and
//! send through the in-memory [`SimLink`] to simulated workers that answer, reject, crash
//! mid-stream or hang; and a decode hop that streams tokens or crashes.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{self, BoxFuture};
use futures_util::FutureExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::conditional;
use super::config::{timing, Mutant};
use super::kv_events;
use super::link::{SimLink, Tried};
use super::oracle::Violation;
use super::sessions;
use super::world::{InFlight, LoadSubscriber, Probe, World};
use prefill_router::advert::{self, DecodeDefaults};
use prefill_router::binding::{
    Binding, BindingFactory, BuildError, PrefillError, PrefillEstimate, PrefillOutcome,
    PrefillPick, WorkerSetTarget,
};
use prefill_router::decode::{Decode, DecodeError, DecodeStream};
use prefill_router::discovery::InstanceId;
use prefill_router::health::FailureClass;
use prefill_router::push::{
    failure_class, Dispatcher, PushConfig, PushError, PushMode, RoutableView,
};
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse};

pub(crate) use super::link::request_id;

/// Keys of the decision streams (see `World::keyed`; the workers' is the link's).
const STREAM_BUILD: u64 = 1;
const STREAM_PUSH: u64 = 2;
const STREAM_DECODE: u64 = 4;

/// What a build will do, drawn when the router asks for it.
enum BuildPlan {
    Succeed(Duration),
    Fail(Duration),
    /// Never finishes by itself: the router's build timeout (or a cancellation) ends it.
    Hang,
    /// Finishes after `Duration` whatever the cancellation token says.
    IgnoreCancel(Duration),
}

/// The fake [`BindingFactory`].
pub struct SimFactory {
    world: Arc<World>,
    mutant: Option<Mutant>,
}

impl SimFactory {
    pub(crate) fn new(world: Arc<World>, mutant: Option<Mutant>) -> Self {
        SimFactory { world, mutant }
    }
}

impl BindingFactory for SimFactory {
    type Binding = SimBinding;

    fn build(
        &self,
        target: WorkerSetTarget,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, Result<SimBinding, BuildError>> {
        let build = self.world.with(|s| {
            s.stats.builds += 1;
            s.stats.builds
        });
        let mut rng = self.world.keyed(&[STREAM_BUILD, build]);
        let plan = self.world.with(|s| {
            if !s.faults {
                return BuildPlan::Succeed(Duration::from_millis(rng.below(10)));
            }
            let roll = rng.below(100);
            let mut ms = |hi| Duration::from_millis(rng.below(hi));
            match roll {
                0..=64 => BuildPlan::Succeed(ms(40)),
                65..=79 => {
                    s.stats.builds_failed += 1;
                    BuildPlan::Fail(ms(30))
                }
                80..=87 => {
                    s.stats.builds_hung += 1;
                    BuildPlan::Hang
                }
                _ => BuildPlan::IgnoreCancel(ms(160)),
            }
        });
        let world = Arc::clone(&self.world);
        let mutant = self.mutant;
        world.trace(&[1, target.id.generation]);
        async move {
            match plan {
                BuildPlan::Succeed(d) => tokio::time::sleep(d).await,
                BuildPlan::IgnoreCancel(d) => tokio::time::sleep(d).await,
                BuildPlan::Fail(d) => {
                    tokio::time::sleep(d).await;
                    return Err(BuildError::new("simulated build failure"));
                }
                BuildPlan::Hang => {
                    cancel.cancelled().await;
                    return Err(BuildError::new("simulated hung build cancelled"));
                }
            }
            SimBinding::new(world, target, cancel, mutant)
        }
        .boxed()
    }
}

/// A binding of the simulated world: the real routable view and dispatcher over simulated
/// workers.
pub struct SimBinding {
    probe: Arc<Probe>,
    /// One dispatcher per frontend (one unless the run has several frontends): each books on
    /// its own board, as separate frontend processes do.
    pushes: Vec<Arc<Dispatcher<SimLink>>>,
    view: RoutableView,
    target: WorkerSetTarget,
    world: Arc<World>,
    mutant: Option<Mutant>,
    /// Ends the view's feed when the binding drops (as a real binding ends its tasks).
    view_cancel: CancellationToken,
    /// Prompt tokens of the requests picked on this binding and not finished (the conditional
    /// policy's pool load).
    inflight_tokens: Arc<std::sync::atomic::AtomicU64>,
    /// The workers each request in flight here went to (shared with the link).
    tried: Tried,
}

/// What a simulated pick holds: the serial of the binding that made it and the request's share
/// of the pool load.
struct SimPick {
    origin: u64,
    load: prefill_router::binding::TokenLoad,
}

impl std::fmt::Debug for SimBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBinding")
            .field("serial", &self.probe.serial)
            .field("target", &self.target.id)
            .finish()
    }
}

impl SimBinding {
    fn new(
        world: Arc<World>,
        target: WorkerSetTarget,
        cancel: CancellationToken,
        mutant: Option<Mutant>,
    ) -> Result<Self, BuildError> {
        // The real card resolution, as the default factory does it.
        let decode = DecodeDefaults {
            block_size: 16,
            ..DecodeDefaults::default()
        };
        let config = advert::resolve(std::slice::from_ref(&*target.card), &decode)
            .map_err(|e| BuildError::new(e.to_string()))?;
        let kv_on = world.with(|s| s.kv.on);
        let frontends = super::frontends::frontends(&world);
        let mut config = config;
        // Load reports feed the load board, which only KV mode keeps.
        if kv_on || frontends > 1 {
            config.router_mode = prefill_router::advert::SelectionMode::KV;
        }
        let mode = PushMode::from_prefill_config(&config, None);
        let kv_block = kv_on.then_some(config.block_size);
        let admission = match mutant {
            Some(Mutant::IgnoreAdmission) => None,
            _ => Some(target.admitted.clone()),
        };
        let view_cancel = cancel.child_token();
        // Fed by the simulated discovery (`World::attach_view`), not by a spawned watch: the
        // deliveries are the simulator's to delay, duplicate and lose.
        // Simulated addresses are never dialled: a probe asks the world whether the worker is
        // up, which is what a connect to a real worker would find.
        // Weak: the world keeps the view (attach_view), so a strong handle would be a cycle.
        let prober = {
            let world = Arc::downgrade(&world);
            let never = mutant == Some(Mutant::BreakerNeverCloses);
            prefill_router::push::Prober::new(move |id, _| {
                let up = world
                    .upgrade()
                    .is_some_and(|w| w.with(|s| World::reachable(s, id)));
                std::future::ready(up && !never)
            })
        };
        let view = RoutableView::spawn_with_prober(
            futures_util::stream::pending(),
            admission,
            view_cancel.clone(),
            timing::HEALTH,
            prober,
        );
        let probe = world.new_probe(target.id.clone(), cancel);
        let seed = world.keyed(&[STREAM_PUSH, probe.serial]).next_u64();
        let affinity = sessions::table_for_binding(&world, mutant);
        let tried = Tried::default();
        let config = PushConfig {
            seed,
            // One deadline per prefill, over all its attempts, as in production.
            request_timeout: Some(timing::PREFILL_TIMEOUT),
            retry_budget: timing::RETRY_BUDGET,
            ..PushConfig::default()
        };
        let mut pushes = Vec::new();
        for frontend in 0..frontends {
            // The first frontend keeps the seed a one-frontend run draws.
            let seed = match frontend {
                0 => seed,
                f => world
                    .keyed(&[STREAM_PUSH, probe.serial, u64::from(f)])
                    .next_u64(),
            };
            let conn = super::frontends::new_conn(&world);
            let push = Arc::new_cyclic(|dispatcher| {
                let link = SimLink {
                    world: Arc::clone(&world),
                    serial: probe.serial,
                    target: probe.target.clone(),
                    admitted: target.admitted.clone(),
                    view: view.clone(),
                    mutant,
                    kv_block,
                    dispatcher: dispatcher.clone(),
                    affinity: affinity.clone(),
                    tried: Arc::clone(&tried),
                    conn,
                };
                let config = PushConfig {
                    seed,
                    ..config.clone()
                };
                Dispatcher::with_link(view.clone(), mode.clone(), config, link)
                    .with_affinity_table(affinity.clone().map(|a| a.table))
            });
            if kv_on {
                kv_events::subscribe(&world, &push);
            }
            if let Some(conn) = conn {
                let subscriber: Arc<dyn LoadSubscriber> = Arc::clone(&push) as _;
                super::frontends::connect(&world, conn, Arc::downgrade(&subscriber));
            }
            pushes.push(push);
        }
        world.attach_view(&probe, &view);
        if mutant == Some(Mutant::LeakBindings) {
            world.with(|s| s.leaked.push(Arc::clone(&probe)));
        }
        world.trace(&[2, probe.serial, target.id.generation]);
        Ok(SimBinding {
            probe,
            pushes,
            view,
            target,
            world,
            mutant,
            view_cancel,
            inflight_tokens: Arc::default(),
            tried,
        })
    }

    /// The binding's serial number in the run (oracles name bindings by it).
    pub fn serial(&self) -> u64 {
        self.probe.serial
    }

    /// The oracles that must hold the moment the router hands a request to this binding.
    fn check_admission_to_binding(&self, request: u64) {
        let desired = self.world.with(|s| s.desired.clone());
        if desired.as_ref() != Some(&self.probe.target) {
            self.world.violate(Violation::DispatchOnReplacedTarget {
                request,
                binding: self.probe.target.clone(),
                desired,
            });
        }
        if self.probe.build_cancel.is_cancelled() {
            self.world.violate(Violation::DispatchOnAbandonedBuild {
                request,
                binding: self.probe.target.clone(),
            });
        }
    }
}

impl Drop for SimBinding {
    fn drop(&mut self) {
        self.view_cancel.cancel();
    }
}

impl SimBinding {
    /// Oracle: a prefill that failed on connection failures after trying fewer distinct
    /// workers than the budget allows had no admitted, reachable, routable worker left.
    fn check_no_healthy_worker_left(&self, request: u64, tried: &[InstanceId]) {
        let mut distinct = tried.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() > timing::RETRY_BUDGET as usize {
            return;
        }
        let healthy = self
            .view
            .routable()
            .iter()
            .map(|i| i.instance_id)
            .find(|w| !distinct.contains(w) && self.world.with(|s| World::reachable(s, *w)));
        if let Some(healthy) = healthy {
            self.world.violate(Violation::FailedWithHealthyWorker {
                request,
                tried: tried.to_vec(),
                healthy,
            });
        }
    }
}

impl Binding for SimBinding {
    /// The real dispatcher's `generate` (pick, booking, retries elsewhere within the one
    /// deadline, release) through the in-memory link.
    fn prefill(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        let id = request_id(&request);
        // Synchronous part: the router called us in the same poll in which it loaded the
        // route, so the world is exactly as it was at the load. The dispatcher's first pick
        // comes in this poll too: the router polls the prefill at once.
        self.check_admission_to_binding(id);
        self.world.with(|s| s.prefilled.insert(id));
        let in_flight = InFlight::enter(&self.probe);
        let tried = TriedEntry {
            tried: Arc::clone(&self.tried),
            id,
        };
        async move {
            let _in_flight = in_flight;
            let deadline = Instant::now() + timing::PREFILL_TIMEOUT;
            let frontend = super::frontends::frontend_of(&self.world, id, self.pushes.len());
            let error = match self.pushes[frontend].generate(request).await {
                Ok(stream) => return PrefillOutcome::collect(stream.instance_id(), stream).await,
                Err(error) => error,
            };
            let tried = tried.take();
            if tried.is_empty() {
                // Nothing routable for the first pick.
                self.world.trace(&[3, id, u64::MAX]);
            } else if last_class(&error).is_some_and(FailureClass::retry_elsewhere)
                && Instant::now() < deadline
            {
                // The dispatcher stopped retrying a connection failure with time left: for
                // want of budget or of another routable worker.
                self.check_no_healthy_worker_left(id, &tried);
            }
            Err(error.into())
        }
        .boxed()
    }

    fn pick(&self, request: &GenerateRequest) -> Result<PrefillPick, PrefillError> {
        Ok(self.conditional_pick(request))
    }

    /// Checks the pick came from this binding, then prefills as `prefill` does, the pick's
    /// load held until the prefill ends.
    fn prefill_picked(
        &self,
        pick: PrefillPick,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        let held = pick.into_held_as::<SimPick>();
        let origin = held.as_ref().map_or(u64::MAX, |h| h.origin);
        conditional::dispatched(&self.world, request_id(&request), origin, self.serial());
        let prefill = self.prefill(request);
        async move {
            let result = prefill.await;
            drop(held.map(|h| h.load));
            result
        }
        .boxed()
    }
}

impl SimBinding {
    /// The conditional probe: the prompt, nothing cached (the simulated workers keep no KV
    /// cache), this binding's in-flight prompt tokens per routable worker. Recorded truthfully
    /// in the world; the `ConditionalProbeLies` mutant reports an empty prompt instead.
    fn conditional_pick(&self, request: &GenerateRequest) -> PrefillPick {
        use std::sync::atomic::Ordering;
        let id = request_id(request);
        let workers = self.view.routable().len().max(1) as u64;
        let truth = PrefillEstimate {
            pool_tokens_per_worker: self.inflight_tokens.load(Ordering::Relaxed) / workers,
            ..PrefillEstimate::prompt_only(request.token_ids.len())
        };
        conditional::probed(&self.world, id, self.serial(), truth);
        let reported = match self.mutant {
            Some(Mutant::ConditionalProbeLies) => PrefillEstimate {
                prompt_tokens: 0,
                ..truth
            },
            Some(Mutant::ConditionalPrefillOnProbe) => {
                // The probe sends the prefill already.
                self.world.with(|s| s.prefilled.insert(id));
                truth
            }
            _ => truth,
        };
        let load = prefill_router::binding::TokenLoad::new(
            &self.inflight_tokens,
            u64::from(truth.uncached_tokens()),
        );
        let held = SimPick {
            origin: self.serial(),
            load,
        };
        PrefillPick::new(reported, Some(Box::new(held)))
    }
}

/// The class of the last attempt's failure (`None`: no attempt was made).
fn last_class(error: &PushError) -> Option<FailureClass> {
    match error {
        PushError::Exhausted { attempts } => attempts.last().map(|a| a.class),
        PushError::Transport { source, .. } => Some(failure_class(source)),
        PushError::Timeout { .. } => Some(FailureClass::Deadline),
        // A connection failure on a worker that has left discovery meanwhile.
        PushError::InstanceGone(_) => Some(FailureClass::ConnectionReset),
        _ => None,
    }
}

/// A request's entry in the binding's record of tried workers, removed when the prefill ends
/// or is dropped.
struct TriedEntry {
    tried: Tried,
    id: u64,
}

impl TriedEntry {
    /// The workers the request went to so far.
    fn take(&self) -> Vec<InstanceId> {
        self.tried.lock().remove(&self.id).unwrap_or_default()
    }
}

impl Drop for TriedEntry {
    fn drop(&mut self) {
        self.tried.lock().remove(&self.id);
    }
}

/// The simulated decode pool: streams the requested tokens, or crashes mid-stream.
pub struct SimDecode {
    world: Arc<World>,
}

impl SimDecode {
    pub(crate) fn new(world: Arc<World>) -> Self {
        SimDecode { world }
    }
}

impl Decode for SimDecode {
    fn decode(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        conditional::decoded(&self.world, request_id(&request), prefill.is_none());
        let tokens = request.max_tokens.min(timing::MAX_TOKENS);
        // Drawn now, in call order, so the RNG sequence does not depend on stream polling.
        let mut rng = self
            .world
            .keyed(&[STREAM_DECODE, super::binding::request_id(&request)]);
        let (gaps, crash_at): (Vec<u64>, Option<u32>) = self.world.with(|s| {
            let gaps = (0..tokens)
                .map(|_| rng.between(0, timing::TOKEN_MAX_MS))
                .collect();
            let crash = (s.faults && rng.percent(3))
                .then(|| u32::try_from(rng.below(u64::from(tokens.max(1)))).unwrap_or(0));
            (gaps, crash)
        });
        let stream = futures_util::stream::unfold(0u32, move |i| {
            let gap = gaps.get(i as usize).copied();
            async move {
                let gap = gap?;
                tokio::time::sleep(Duration::from_millis(gap)).await;
                if crash_at == Some(i) {
                    // Ends the stream after the error (index past the gaps).
                    let err = DecodeError::Failed {
                        message: "decode worker crashed mid-stream".to_owned(),
                    };
                    return Some((Err(err), tokens));
                }
                let last = i + 1 == tokens;
                let response = GenerateResponse {
                    text: None,
                    usage: None,
                    token_ids: vec![i],
                    finish: last.then_some(FinishReason::Length),
                    prefill: None,
                };
                Some((Ok(response), i + 1))
            }
        });
        future::ready(Ok(Box::pin(stream) as DecodeStream)).boxed()
    }
}
