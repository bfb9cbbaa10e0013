//! The in-memory side of the request path: a binding factory whose builds a seeded RNG
//! makes succeed, fail, hang or outlive their cancellation; bindings that pick workers with
//! the real [`RoutableView`] and [`Dispatcher`] and "send" to simulated workers that answer,
//! reject, crash mid-stream or hang; and a decode hop that streams tokens or crashes.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{self, BoxFuture};
use futures_util::FutureExt;
use tokio_util::sync::CancellationToken;

use super::conditional;
use super::config::{timing, Mutant};
use super::kv_events;
use super::oracle::Violation;
use super::sessions;
use super::world::{InFlight, Probe, World};
use crate::advert::{self, DecodeDefaults};
use crate::discovery::InstanceId;
use crate::push::{Dispatcher, PushConfig, PushError, PushMode, RoutableView};
use crate::router::{
    BindingFactory, BuildError, Decode, DecodeError, DecodeStream, Prefill, PrefillError,
    PrefillOutcome, PrefillPick, PrefillProbe, WorkerSetTarget,
};
use crate::transport::{FinishReason, GenerateRequest, GenerateResponse, PrefillInfo};

/// The request id the simulator writes into `GenerateRequest::request_id` (the session key
/// is left to session affinity).
pub(crate) fn request_id(request: &GenerateRequest) -> u64 {
    request.request_id.unwrap_or(u64::MAX)
}

/// Keys of the decision streams (see `World::keyed`).
const STREAM_BUILD: u64 = 1;
const STREAM_PUSH: u64 = 2;
const STREAM_WORKER: u64 = 3;
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
    push: Arc<Dispatcher>,
    /// The KV block size when the run has KV events (the bindings then route in KV mode).
    kv_block: Option<u32>,
    view: RoutableView,
    target: WorkerSetTarget,
    world: Arc<World>,
    mutant: Option<Mutant>,
    /// Ends the view's feed when the binding drops (as a real binding ends its tasks).
    view_cancel: CancellationToken,
    /// Prompt tokens of the requests picked on this binding and not finished (the conditional
    /// policy's pool load).
    inflight_tokens: Arc<std::sync::atomic::AtomicU64>,
    /// The dispatcher's session-affinity table (runs with sessions).
    affinity: Option<Arc<crate::push::AffinityTable>>,
}

/// What a simulated pick holds: the serial of the binding that made it and the request's share
/// of the pool load.
struct SimPick {
    origin: u64,
    load: crate::binding::TokenLoad,
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
        let mut config = config;
        if kv_on {
            config.router_mode = crate::advert::SelectionMode::KV;
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
            crate::push::Prober::new(move |id, _| {
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
        let push = Arc::new(
            Dispatcher::new(
                view.clone(),
                mode,
                PushConfig {
                    seed,
                    ..PushConfig::default()
                },
            )
            .with_affinity_table(affinity.clone()),
        );
        if kv_on {
            kv_events::subscribe(&world, &push);
        }
        world.attach_view(&probe, &view);
        if mutant == Some(Mutant::LeakBindings) {
            world.with(|s| s.leaked.push(Arc::clone(&probe)));
        }
        world.trace(&[2, probe.serial, target.id.generation]);
        Ok(SimBinding {
            probe,
            push,
            kv_block,
            view,
            target,
            world,
            mutant,
            view_cancel,
            inflight_tokens: Arc::default(),
            affinity,
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

/// What a worker does with one prefill.
enum WorkerPlan {
    Answer(Duration),
    Reject,
    /// Fails after `Duration`; the worker is down from then on.
    Crash(Duration),
    Hang,
    /// The worker is down: connection refused.
    Refused,
}

impl SimBinding {
    /// Pick a worker for one attempt of request `id` (never one in `tried`, unless the
    /// mutant reuses the failed worker), check the admission oracle, and draw what the worker
    /// does with it.
    fn attempt(
        &self,
        id: u64,
        request: &GenerateRequest,
        tried: &[InstanceId],
    ) -> Result<(InstanceId, WorkerPlan), PushError> {
        let reuse = self.mutant == Some(Mutant::RetryReusesFailedWorker);
        let worker = match (tried.last(), reuse) {
            (Some(&last), true) => last,
            _ => self.pick_with_affinity(id, request, tried)?,
        };
        let admitted = self.target.admitted.borrow().clone();
        if !admitted.contains(&worker) {
            self.world.violate(Violation::DispatchOutsideAdmission {
                request: id,
                worker,
                target: self.probe.target.clone(),
                admitted,
            });
        }
        self.world.trace(&[3, id, worker, self.probe.serial]);
        // The first attempt keeps the draws it always had; retries draw from their own keys.
        let mut rng = match tried.len() {
            0 => self.world.keyed(&[STREAM_WORKER, id]),
            n => self.world.keyed(&[STREAM_WORKER, id, n as u64]),
        };
        let plan = self.world.with(|s| {
            s.stats.dispatches += 1;
            if !World::reachable(s, worker) {
                return WorkerPlan::Refused;
            }
            if !s.faults {
                return WorkerPlan::Answer(Duration::from_millis(rng.between(1, 10)));
            }
            match rng.below(100) {
                0..=84 => WorkerPlan::Answer(Duration::from_millis(
                    rng.between(1, timing::PREFILL_MAX_MS),
                )),
                85..=89 => WorkerPlan::Reject,
                90..=93 => {
                    s.stats.crashes += 1;
                    WorkerPlan::Crash(Duration::from_millis(rng.between(1, 20)))
                }
                _ => WorkerPlan::Hang,
            }
        });
        Ok((worker, plan))
    }

    /// The block hashes of `request` in KV runs (what the workers' caches are keyed by).
    fn kv_hashes(&self, request: &GenerateRequest) -> Option<Vec<u64>> {
        self.kv_block
            .map(|b| crate::push::block_hashes(&request.token_ids, b))
    }

    /// The dispatcher's pick, under the stale-credit oracle in KV runs.
    fn select(
        &self,
        id: u64,
        request: &GenerateRequest,
        tried: &[InstanceId],
    ) -> Result<InstanceId, PushError> {
        let (instance, credited) = self.push.select_excluding_with_overlap(request, tried)?;
        if let Some(hashes) = self.kv_hashes(request) {
            kv_events::picked(
                &self.world,
                id,
                &self.push,
                instance.instance_id,
                &hashes,
                credited,
            );
        }
        Ok(instance.instance_id)
    }

    /// The dispatcher's pick, judged by the affinity oracles when the run has sessions.
    fn pick_with_affinity(
        &self,
        id: u64,
        request: &GenerateRequest,
        tried: &[InstanceId],
    ) -> Result<InstanceId, PushError> {
        let Some(table) = &self.affinity else {
            return self.select(id, request, tried);
        };
        // Read in the same poll as the pick: what the dispatcher picks from.
        let routable: Vec<InstanceId> =
            self.view.routable().iter().map(|i| i.instance_id).collect();
        let before = table.counts().snapshot();
        let mut worker = self.select(id, request, tried)?;
        let mut outcomes = sessions::outcome_between(before, table.counts().snapshot());
        let session = request.session.as_deref();
        if self.mutant == Some(Mutant::AffinityIgnoresRoutable) {
            // The broken dispatcher: a live entry wins, routable or not.
            if let Some(remembered) =
                session.and_then(|s| sessions::live_entry(&self.world, self.serial(), s))
            {
                worker = remembered;
                outcomes = vec![crate::push::AffinityOutcome::Hit];
            }
        }
        sessions::picked(
            &self.world,
            &sessions::Pick {
                request: id,
                serial: self.serial(),
                session,
                routable: &routable,
                tried,
                worker,
                outcomes,
            },
        );
        Ok(worker)
    }

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

impl Prefill for SimBinding {
    fn prefill(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        let id = request_id(&request);
        // Synchronous part: the router called us in the same poll in which it loaded the
        // route, so the world is exactly as it was at the load.
        self.check_admission_to_binding(id);
        self.world.with(|s| s.prefilled.insert(id));
        let in_flight = InFlight::enter(&self.probe);
        let first = match self.attempt(id, &request, &[]) {
            Ok(first) => first,
            Err(e) => {
                self.world.trace(&[3, id, u64::MAX]);
                return future::ready(Err(PrefillError::Push(e))).boxed();
            }
        };
        let enforce_deadline = self.mutant != Some(Mutant::NoPrefillTimeout);
        let first_worker = first.0;
        async move {
            let _in_flight = in_flight;
            // Retries as the dispatcher's: a connection failure before any output (refused,
            // or a crash before the response) moves to another worker, at most RETRY_BUDGET
            // times, all within the one prefill deadline.
            let work = async {
                let mut tried: Vec<InstanceId> = Vec::new();
                let (mut worker, mut plan) = first;
                loop {
                    tried.push(worker);
                    let failure = match plan {
                        WorkerPlan::Answer(d) => {
                            tokio::time::sleep(d).await;
                            if let Some(hashes) = self.kv_hashes(&request) {
                                kv_events::prefilled(&self.world, worker, &hashes);
                            }
                            return Ok(outcome(worker, &request));
                        }
                        WorkerPlan::Reject => {
                            return Err(PrefillError::Failed {
                                message: format!("worker {worker} rejected the request"),
                            })
                        }
                        WorkerPlan::Hang => return future::pending().await,
                        WorkerPlan::Refused => {
                            // What the real dispatcher does after a connection failure.
                            self.view.report_failure(
                                worker,
                                crate::health::FailureClass::ConnectionRefused,
                            );
                            format!("worker {worker}: connection refused")
                        }
                        WorkerPlan::Crash(d) => {
                            tokio::time::sleep(d).await;
                            self.world.crash(worker);
                            self.view
                                .report_failure(worker, crate::health::FailureClass::StreamDead);
                            format!("worker {worker} crashed mid-stream")
                        }
                    };
                    let next = if tried.len() > timing::RETRY_BUDGET as usize {
                        None
                    } else {
                        self.attempt(id, &request, &tried).ok()
                    };
                    match next {
                        Some(next) => {
                            self.world.with(|s| s.stats.retries += 1);
                            (worker, plan) = next;
                        }
                        None => {
                            self.check_no_healthy_worker_left(id, &tried);
                            return Err(PrefillError::Failed { message: failure });
                        }
                    }
                }
            };
            if enforce_deadline {
                match tokio::time::timeout(timing::PREFILL_TIMEOUT, work).await {
                    Ok(result) => result,
                    Err(_) => Err(PrefillError::Push(PushError::Timeout {
                        instance: first_worker,
                    })),
                }
            } else {
                work.await
            }
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
        let held = pick.into_held().and_then(|h| h.downcast::<SimPick>().ok());
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
        let truth = PrefillProbe {
            pool_tokens_per_worker: self.inflight_tokens.load(Ordering::Relaxed) / workers,
            ..PrefillProbe::prompt_only(request.token_ids.len())
        };
        conditional::probed(&self.world, id, self.serial(), truth);
        let reported = match self.mutant {
            Some(Mutant::ConditionalProbeLies) => PrefillProbe {
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
        let load = crate::binding::TokenLoad::new(
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

fn outcome(worker: InstanceId, request: &GenerateRequest) -> PrefillOutcome {
    let first = request
        .token_ids
        .last()
        .copied()
        .unwrap_or(0)
        .wrapping_add(1);
    PrefillOutcome {
        worker,
        tokens: vec![first],
        finish: Some(FinishReason::Length),
        handoff: Some(PrefillInfo {
            worker,
            prompt_tokens: u32::try_from(request.token_ids.len()).unwrap_or(u32::MAX),
            cached_blocks: 0,
            block_size: 16,
        }),
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
