//! Fake factories, bindings and decode hops for the adapter tests.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::advert::ModelCard;
use crate::binding::{
    Binding, BindingFactory, BuildError, PrefillError, PrefillEstimate, PrefillOutcome,
    PrefillPick, WorkerSetTarget, WorkerSetTargetId,
};
use crate::decode::{Decode, DecodeError, DecodeStream};
use crate::discovery::{EndpointId, InstanceId};
use crate::request::{FinishReason, GenerateRequest, GenerateResponse, PrefillInfo};

/// A target of group `ns/prefill`, generation `generation`, admitting `admitted`.
pub(super) fn target_with(
    generation: u64,
    admitted: watch::Receiver<BTreeSet<InstanceId>>,
) -> WorkerSetTarget {
    WorkerSetTarget::new(
        WorkerSetTargetId::new("ns/prefill", generation),
        EndpointId::new("ns", "prefill", "generate"),
        Arc::new(ModelCard::named("m")),
        admitted,
    )
}

/// A target admitting instance 1 (the sender is dropped; the set stays readable).
pub(super) fn target(generation: u64) -> WorkerSetTarget {
    target_with(generation, watch::channel(BTreeSet::from([1])).1)
}

/// Counts live objects of one kind (increment on creation, decrement on drop).
#[derive(Debug, Default)]
pub(super) struct Live(AtomicUsize);

impl Live {
    pub(super) fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Debug)]
pub(super) struct LiveGuard(Arc<Live>);

impl LiveGuard {
    pub(super) fn new(live: &Arc<Live>) -> Self {
        live.0.fetch_add(1, Ordering::SeqCst);
        LiveGuard(Arc::clone(live))
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A binding that prefills on the lowest admitted instance, and fails at once (as a push
/// router over an empty admission set does) when nothing is admitted.
#[derive(Debug)]
pub(super) struct FakeBinding {
    pub(super) target: WorkerSetTargetId,
    admitted: watch::Receiver<BTreeSet<InstanceId>>,
    /// Every request this binding's prefill worker received (the factory log's `prefills`).
    prefills: Arc<Mutex<Vec<GenerateRequest>>>,
    /// The factory log (picks and the probe's pool load).
    log: Arc<FactoryLog>,
    _live: LiveGuard,
}

/// What a [`FakeBinding`]'s pick holds: the target of the binding that made it.
struct PickedOn(WorkerSetTargetId);

impl Binding for FakeBinding {
    fn prefill(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        let picked = self.admitted.borrow().iter().next().copied();
        self.prefills.lock().push(request.clone());
        Box::pin(async move {
            assert_eq!(request.max_tokens, 1, "the hop prefills one token");
            // A binding's own error: the router reroutes on it without knowing any dispatcher.
            let worker = picked.ok_or(PrefillError::NoRoutableWorker)?;
            Ok(PrefillOutcome {
                worker,
                tokens: vec![7],
                finish: Some(FinishReason::Length),
                handoff: Some(PrefillInfo {
                    engine_params: None,
                    worker,
                    prompt_tokens: request.token_ids.len() as u32,
                    cached_blocks: 0,
                    block_size: 16,
                }),
            })
        })
    }

    /// Probes the prompt length and the log's `pool_load`; holds this binding's target.
    fn pick(&self, request: &GenerateRequest) -> Result<PrefillPick, PrefillError> {
        let probe = PrefillEstimate {
            pool_tokens_per_worker: self.log.pool_load.load(Ordering::SeqCst),
            ..PrefillEstimate::prompt_only(request.token_ids.len())
        };
        Ok(PrefillPick::new(
            probe,
            Some(Box::new(PickedOn(self.target.clone()))),
        ))
    }

    /// Logs (the picking binding's target, this binding's target), then prefills.
    fn prefill_picked(
        &self,
        pick: PrefillPick,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        let origin = pick.into_held_as::<PickedOn>().map(|p| p.0.clone());
        self.log.picks.lock().push((origin, self.target.clone()));
        self.prefill(request)
    }

    /// One open breaker per admitted instance past the first, one overload retry and two
    /// affinity hits per prefill served: distinct values for the metrics test to find.
    fn health(&self) -> crate::binding::BindingHealth {
        let open = self.admitted.borrow().len().saturating_sub(1);
        let served = self.prefills.lock().len() as u64;
        crate::binding::BindingHealth::new(
            open,
            [(crate::health::FailureClass::Overloaded, served)].into(),
        )
        .with_affinity(crate::push::AffinityStats {
            hits: 2 * served,
            misses: 3,
            repicks: 4,
            evictions: 5,
            expired: 6,
        })
    }
}

/// What one build does.
#[derive(Clone, Debug)]
pub(super) enum Step {
    Succeed,
    Fail(&'static str),
    /// Never completes (until dropped).
    Hang,
    /// Succeeds after this long.
    After(Duration),
    /// `build` itself panics.
    PanicInBuild,
    /// The build future panics when polled.
    PanicInFuture,
}

/// Everything the factory records, shared with the test.
#[derive(Debug, Default)]
pub(super) struct FactoryLog {
    script: Mutex<VecDeque<Step>>,
    /// Build calls: target and (tokio) time.
    pub(super) calls: Mutex<Vec<(WorkerSetTargetId, Instant)>>,
    /// Tokens handed to builds, in call order.
    pub(super) tokens: Mutex<Vec<CancellationToken>>,
    /// Build futures not yet dropped.
    pub(super) builds_live: Arc<Live>,
    /// Bindings not yet dropped.
    pub(super) bindings_live: Arc<Live>,
    /// Requests the prefill workers received, over every binding, in arrival order.
    pub(super) prefills: Arc<Mutex<Vec<GenerateRequest>>>,
    /// Dispatches of picked requests: (target of the binding that picked, target of the
    /// binding that dispatched).
    pub(super) picks: Mutex<Vec<(Option<WorkerSetTargetId>, WorkerSetTargetId)>>,
    /// The pool load every fake pick reports.
    pub(super) pool_load: AtomicU64,
}

impl FactoryLog {
    pub(super) fn call_times(&self) -> Vec<Instant> {
        self.calls.lock().iter().map(|(_, t)| *t).collect()
    }

    pub(super) fn calls(&self) -> usize {
        self.calls.lock().len()
    }
}

/// A factory that follows a script of steps, then succeeds.
pub(super) struct ScriptFactory {
    pub(super) log: Arc<FactoryLog>,
}

impl ScriptFactory {
    pub(super) fn new(steps: impl IntoIterator<Item = Step>) -> (Self, Arc<FactoryLog>) {
        let log = Arc::new(FactoryLog::default());
        log.script.lock().extend(steps);
        (ScriptFactory { log: log.clone() }, log)
    }

    pub(super) fn instant() -> (Self, Arc<FactoryLog>) {
        Self::new([])
    }
}

impl BindingFactory for ScriptFactory {
    type Binding = FakeBinding;

    fn build(
        &self,
        target: WorkerSetTarget,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, Result<FakeBinding, BuildError>> {
        let step = self.log.script.lock().pop_front().unwrap_or(Step::Succeed);
        self.log
            .calls
            .lock()
            .push((target.id.clone(), Instant::now()));
        self.log.tokens.lock().push(cancel);
        assert!(
            !matches!(step, Step::PanicInBuild),
            "scripted panic in build"
        );
        let guard = LiveGuard::new(&self.log.builds_live);
        let bindings = Arc::clone(&self.log.bindings_live);
        let prefills = Arc::clone(&self.log.prefills);
        let log = Arc::clone(&self.log);
        Box::pin(async move {
            let _guard = guard;
            let binding = move || FakeBinding {
                target: target.id.clone(),
                admitted: target.admitted.clone(),
                prefills: Arc::clone(&prefills),
                log: Arc::clone(&log),
                _live: LiveGuard::new(&bindings),
            };
            match step {
                Step::Succeed => Ok(binding()),
                Step::Fail(message) => Err(BuildError::new(message)),
                Step::Hang => std::future::pending().await,
                Step::After(delay) => {
                    tokio::time::sleep(delay).await;
                    Ok(binding())
                }
                Step::PanicInBuild | Step::PanicInFuture => panic!("scripted panic in a build"),
            }
        })
    }
}

/// A decode hop that records what it was given and answers one finishing response.
#[derive(Debug, Default)]
pub(super) struct FakeDecode {
    pub(super) calls: Mutex<Vec<(GenerateRequest, Option<PrefillOutcome>)>>,
}

impl Decode for FakeDecode {
    fn decode(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        self.calls.lock().push((request.clone(), prefill));
        Box::pin(async move {
            let response = GenerateResponse {
                text: None,
                usage: None,
                token_ids: vec![1; request.max_tokens as usize],
                finish: Some(FinishReason::Length),
                prefill: None,
            };
            let stream: DecodeStream = Box::pin(futures_util::stream::iter([Ok(response)]));
            Ok(stream)
        })
    }
}
