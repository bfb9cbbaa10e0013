//! The binding seam: what a binding does ([`Binding`]), what it reports ([`PrefillOutcome`],
//! [`PrefillPick`], [`PrefillEstimate`], [`BindingHealth`]), how it fails ([`PrefillError`]) and
//! how bindings are built ([`BindingFactory`]). The router speaks only these words to a
//! binding; a fake binding needs nothing else.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_core::Stream;
use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use super::target::WorkerSetTarget;
use crate::discovery::InstanceId;
use crate::health::FailureClass;
use crate::push::PushError;
use crate::request::{FinishReason, GenerateRequest, GenerateResponse, PrefillInfo};

/// What a prefill returned that decode needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefillOutcome {
    /// The prefill worker that ran the prompt (and now holds its KV blocks).
    pub worker: InstanceId,
    /// Tokens the prefill step generated (usually the first token).
    pub tokens: Vec<u32>,
    /// Set if the prefill stream finished the request by itself (e.g. a stop token as the very
    /// first token): then there is nothing left to decode.
    pub finish: Option<FinishReason>,
    /// Where decode pulls the KV cache from.
    pub handoff: Option<PrefillInfo>,
}

impl PrefillOutcome {
    /// Whether the prefill step already ended the request (a stop token; `Length` after the
    /// one-token prefill is the normal case and still needs decode).
    pub fn is_terminal(&self) -> bool {
        matches!(self.finish, Some(FinishReason::Stop))
    }

    /// Drain a prefill response stream from `worker` into an outcome: tokens concatenated, the
    /// last finish reason and the last handoff kept. An error item fails the prefill; a stream
    /// that yields nothing is [`PrefillError::NoResponse`].
    pub async fn collect<S, E>(worker: InstanceId, stream: S) -> Result<Self, PrefillError>
    where
        S: Stream<Item = Result<GenerateResponse, E>>,
        E: Into<PrefillError>,
    {
        let mut stream = std::pin::pin!(stream);
        let mut outcome = PrefillOutcome {
            worker,
            ..PrefillOutcome::default()
        };
        let mut any = false;
        while let Some(item) = stream.next().await {
            let response = item.map_err(Into::into)?;
            any = true;
            outcome.tokens.extend_from_slice(&response.token_ids);
            if response.prefill.is_some() {
                outcome.handoff = response.prefill;
            }
            if response.finish.is_some() {
                outcome.finish = response.finish;
                break;
            }
        }
        if any {
            Ok(outcome)
        } else {
            Err(PrefillError::NoResponse)
        }
    }
}

/// Why a prefill failed. Any prefill error fails its request (as upstream): decode is not
/// tried behind the caller's back.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrefillError {
    /// No worker of the binding could be picked (e.g. its admission set is empty, or every
    /// admitted worker is unhealthy): nothing was sent. The router routes such a request again
    /// when its binding was retired under it, and its fallback policy may send it to decode
    /// whole. A dispatcher's [`PushError::NoRoutableInstances`] converts to this.
    #[error("prefill routing failed: no routable instances")]
    NoRoutableWorker,
    /// The dispatcher could not route or carry the prefill (any other [`PushError`]; built
    /// with `From`, which maps [`PushError::NoRoutableInstances`] to
    /// [`NoRoutableWorker`](Self::NoRoutableWorker)).
    #[error("prefill routing failed: {0}")]
    Push(PushError),
    /// The prefill stream ended without any response.
    #[error("prefill stream ended without a response")]
    NoResponse,
    /// Any other failure, described.
    #[error("prefill failed: {message}")]
    Failed {
        /// What went wrong.
        message: String,
    },
}

impl From<PushError> for PrefillError {
    fn from(error: PushError) -> Self {
        match error {
            PushError::NoRoutableInstances => PrefillError::NoRoutableWorker,
            other => PrefillError::Push(other),
        }
    }
}

impl PrefillError {
    /// Whether the prefill leg failed for want of any reachable prefill worker
    /// ([`NoRoutableWorker`](Self::NoRoutableWorker), or a dispatcher error for which
    /// [`PushError::no_reachable_worker`] holds): the case a fallback to decode is for, as
    /// opposed to a worker that answered with an error.
    pub fn no_reachable_worker(&self) -> bool {
        match self {
            PrefillError::NoRoutableWorker => true,
            PrefillError::Push(error) => error.no_reachable_worker(),
            PrefillError::NoResponse | PrefillError::Failed { .. } => false,
        }
    }
}

/// Why a build produced no binding. A timeout counts as a failure (the machine retries).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The factory failed.
    #[error("prefill binding build failed: {message}")]
    Failed {
        /// What went wrong.
        message: String,
    },
    /// The build did not finish within the configured build timeout.
    #[error("prefill binding build timed out after {after:?}")]
    TimedOut {
        /// The timeout that expired.
        after: Duration,
    },
}

impl BuildError {
    /// A failure with this message.
    pub fn new(message: impl Into<String>) -> Self {
        BuildError::Failed {
            message: message.into(),
        }
    }
}

/// A binding: what one target's requests prefill through (for the default factory, a
/// dispatcher and its clients over the target's admitted workers).
///
/// Retired bindings stay usable by the requests that hold them; once a retired binding's
/// admission set empties, new prefills on it must fail promptly with
/// [`PrefillError::NoRoutableWorker`] (as a dispatcher over an empty admission set does)
/// rather than hang.
pub trait Binding: Send + Sync + 'static {
    /// Prefill `request` (the router already set `max_tokens` to 1) and report what decode
    /// needs.
    fn prefill(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>>;

    /// The health of this binding's workers (open breakers, retries). The default reports
    /// nothing (a binding without breakers); [`PrefillBinding`](super::PrefillBinding)
    /// reports its routable view's and dispatcher's.
    fn health(&self) -> BindingHealth {
        BindingHealth::default()
    }

    /// Pick the worker `request` would prefill on and hold that pick (its share of the load)
    /// without sending anything, and report its [`PrefillEstimate`]: what conditional
    /// disaggregation decides on. The router then
    /// either dispatches on this very pick ([`prefill_picked`](Self::prefill_picked), on this
    /// very binding) or drops it. The default knows only the prompt and holds nothing.
    ///
    /// # Errors
    /// As [`prefill`](Self::prefill) would fail to route (e.g. an empty admission set).
    fn pick(&self, request: &GenerateRequest) -> Result<PrefillPick, PrefillError> {
        Ok(PrefillPick::new(
            PrefillEstimate::prompt_only(request.token_ids.len()),
            None,
        ))
    }

    /// Prefill `request` on `pick`, made by [`pick`](Self::pick) of this binding. The default
    /// drops the pick and prefills as [`prefill`](Self::prefill) does.
    fn prefill_picked(
        &self,
        pick: PrefillPick,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        drop(pick);
        self.prefill(request)
    }
}

/// What a binding's pick for one request says about its prefill, for the router's
/// [`ConditionalPolicy`](crate::router::ConditionalPolicy).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillEstimate {
    /// Tokens in the prompt.
    pub prompt_tokens: u32,
    /// Leading prompt tokens the picked worker is expected to hold in its KV cache (the KV
    /// selector's overlap times the block size; 0 under the other modes).
    pub cached_tokens: u32,
    /// Queued or in-flight uncached prefill tokens on the binding's pool, per routable worker
    /// (this request not included).
    pub pool_tokens_per_worker: u64,
}

impl PrefillEstimate {
    /// An estimate that knows only the prompt: nothing cached, an idle pool (bindings that do not
    /// implement [`Binding::pick`]).
    pub fn prompt_only(prompt_tokens: usize) -> Self {
        PrefillEstimate {
            prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
            ..PrefillEstimate::default()
        }
    }

    /// The prompt tokens the picked worker would have to compute.
    pub fn uncached_tokens(&self) -> u32 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }
}

/// A binding's held pick for one request ([`Binding::pick`]): the estimate the policy decides
/// on, and whatever the binding holds for the dispatch (the dispatcher's held pick and its load
/// share), released on drop.
pub struct PrefillPick {
    estimate: PrefillEstimate,
    held: Option<Box<dyn std::any::Any + Send>>,
}

impl PrefillPick {
    /// A pick reporting `estimate` and holding `held` until dispatched or dropped.
    pub fn new(estimate: PrefillEstimate, held: Option<Box<dyn std::any::Any + Send>>) -> Self {
        PrefillPick { estimate, held }
    }

    /// What the pick says about the request's prefill.
    pub fn estimate(&self) -> &PrefillEstimate {
        &self.estimate
    }

    /// The held part, to be downcast by the binding that made it (`None` if the pick holds
    /// nothing).
    pub fn into_held(self) -> Option<Box<dyn std::any::Any + Send>> {
        self.held
    }

    /// The held part as the binding's own type `T` (`None` if the pick holds nothing or
    /// something else: a pick another binding made).
    pub fn into_held_as<T: std::any::Any>(self) -> Option<Box<T>> {
        self.held.and_then(|h| h.downcast::<T>().ok())
    }
}

impl std::fmt::Debug for PrefillPick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillPick")
            .field("estimate", &self.estimate)
            .field("held", &self.held.is_some())
            .finish()
    }
}

/// What a binding reports about its workers' health, for the router's status and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BindingHealth {
    /// Discovered instances whose health breaker is open or probing (not routable until a
    /// probe succeeds; docs/health.md).
    pub open_breakers: usize,
    /// Prefills retried on another worker, by the class of the failure that caused the retry.
    pub retries: BTreeMap<FailureClass, u64>,
    /// Session-affinity counters of the binding's dispatcher (the default factory's bindings
    /// share one count, so it does not restart with a rebuild).
    pub affinity: crate::push::AffinityStats,
    /// Booked prefill work and overload counters of the binding's dispatcher (KV mode).
    pub overload: crate::push::OverloadStats,
    /// Instances the binding would route to now (discovered, admitted, breaker closed);
    /// `None` when the binding does not know. `Some(0)` makes the hop not ready unless the
    /// fallback policy bypasses.
    pub routable: Option<usize>,
}

impl BindingHealth {
    /// A report of `open_breakers` open breakers and these retry counts.
    pub fn new(open_breakers: usize, retries: BTreeMap<FailureClass, u64>) -> Self {
        BindingHealth {
            open_breakers,
            retries,
            affinity: crate::push::AffinityStats::default(),
            overload: crate::push::OverloadStats::default(),
            routable: None,
        }
    }

    /// This report with `routable` instances routable now.
    #[must_use]
    pub fn with_routable(mut self, routable: usize) -> Self {
        self.routable = Some(routable);
        self
    }

    /// This report with these booked-work and overload figures.
    #[must_use]
    pub fn with_overload(mut self, overload: crate::push::OverloadStats) -> Self {
        self.overload = overload;
        self
    }

    /// This report with these session-affinity counters.
    #[must_use]
    pub fn with_affinity(mut self, affinity: crate::push::AffinityStats) -> Self {
        self.affinity = affinity;
        self
    }
}

#[cfg(test)]
impl BindingHealth {
    /// This report with a zero count for every failure class (as a dispatcher reports).
    pub(crate) fn with_zero_retries(mut self) -> Self {
        for class in FailureClass::ALL {
            self.retries.entry(class).or_insert(0);
        }
        self
    }
}

/// Builds the binding for a target. Called by the driver, one build at a time per router.
///
/// `cancel` fires when the build is abandoned (superseded, cancelled, failed, timed out) or the
/// router shuts down; the returned future is also dropped then. A successful build's token is
/// *not* cancelled when the build completes: background tasks the binding needs (e.g. a
/// routable view's discovery feed) may hang off a child of it, and the binding should cancel
/// that child in its own `Drop`, so that retiring and dropping a binding ends its tasks.
pub trait BindingFactory: Send + Sync + 'static {
    /// The binding type.
    type Binding: Binding;

    /// Build a binding for `target`.
    fn build(
        &self,
        target: WorkerSetTarget,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, Result<Self::Binding, BuildError>>;
}
