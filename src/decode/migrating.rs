//! The decode hop with migration (issue 42): a decode stream whose worker dies continues on
//! another decode worker, token for token, driven by the pure [`Migration`] machine.
//!
//! [`MigratingDecode`] wraps any [`Decode`]: the first attempt is the inner hop's, with the
//! prefill's handoff; when its stream breaks without a finish, the machine's continuation (the
//! original prompt plus every token the client got, `max_tokens` what is left, no handoff) goes
//! through the same inner hop, so through the same dispatcher and `WorkerLink` (our workers and
//! engines alike: no engine branch here). With a prefill pool installed
//! ([`MigratingDecode::with_prefill`]: `PrefillHop` installs its router) and Active, the
//! continuation is prefilled there first, on the KV-aware pick, and decoded with the new
//! handoff; otherwise the decode worker prefills the longer prompt itself. Either way its
//! decode steers away from the workers the stream broke on ([`Continuation::avoid`],
//! [`Decode::decode_avoiding`]).
//!
//! What breaks a stream ([`break_reason`]): the connection dropped or the stream ended without
//! a finish (`connection_dropped`), the worker's record vanished while it streamed
//! (`worker_vanished`), the worker said it is going away (draining, 503: `worker_gone`). A
//! worker that *answered* with an error (a rejected request, a deadline) is not a dead worker:
//! that error reaches the client as before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};

use super::{Avoiding, Decode, DecodeError, DecodeStream};
use crate::binding::PrefillOutcome;
use crate::discovery::InstanceId;
use crate::health::FailureClass;
use crate::migration::{
    BreakReason, Continuation, Migration, MigrationConfig, MigrationError, Next, Step,
};
use crate::push::{failure_class, PushError};
use crate::request::{EngineUsage, GenerateRequest, GenerateResponse};

/// What migration counted, for metrics (`prefill_router_migrations_total{reason}`,
/// `prefill_router_migrations_exhausted_total`).
#[derive(Debug, Default)]
pub struct MigrationCounts {
    by_reason: [AtomicU64; 3],
    exhausted: AtomicU64,
    prefilled: AtomicU64,
}

impl MigrationCounts {
    /// Continuations started after breaks of `reason`.
    pub fn migrations(&self, reason: BreakReason) -> u64 {
        self.by_reason[reason_index(reason)].load(Ordering::Relaxed)
    }

    /// Streams that failed because their limit was used up or their deadline passed.
    pub fn exhausted(&self) -> u64 {
        self.exhausted.load(Ordering::Relaxed)
    }

    /// Continuations prefilled on the prefill pool (the rest were prefilled by their decode
    /// worker).
    pub fn prefilled(&self) -> u64 {
        self.prefilled.load(Ordering::Relaxed)
    }
}

/// The prefill pool a continuation goes through first, when it is Active: implemented by the
/// prefill router (`PrefillRouter`), which `PrefillHop` installs.
pub trait ContinuationPrefill: Send + Sync {
    /// Prefill `request` on the pool's pick and decode it on `decode` with the new handoff.
    /// `None`: the pool is not Active or the prefill failed, and nothing reached a decode
    /// worker (the caller sends the request to decode, which prefills it itself).
    fn prefill_then_decode<'a>(
        &'a self,
        request: GenerateRequest,
        decode: &'a dyn Decode,
    ) -> BoxFuture<'a, Option<Result<DecodeStream, DecodeError>>>;
}

fn reason_index(reason: BreakReason) -> usize {
    match reason {
        BreakReason::ConnectionDropped => 0,
        BreakReason::WorkerVanished => 1,
        BreakReason::WorkerGone => 2,
    }
}

/// Whether a decode stream's error says its worker died (and which worker, when known), or
/// that the request itself failed (`None`: not migrated).
pub fn break_reason(error: &DecodeError) -> Option<(BreakReason, Option<InstanceId>)> {
    let DecodeError::Push(error) = error else {
        return None;
    };
    match error {
        PushError::InstanceGone(worker) => Some((BreakReason::WorkerVanished, Some(*worker))),
        PushError::Transport { instance, source } => match failure_class(source) {
            FailureClass::ConnectionRefused
            | FailureClass::ConnectionReset
            | FailureClass::StreamDead => Some((BreakReason::ConnectionDropped, Some(*instance))),
            FailureClass::Overloaded => Some((BreakReason::WorkerGone, Some(*instance))),
            FailureClass::Rejected | FailureClass::Deadline => None,
        },
        _ => None,
    }
}

/// [`Decode`] that migrates broken streams (module docs). With a limit of 0 it is the inner
/// hop unchanged.
pub struct MigratingDecode {
    inner: Arc<dyn Decode>,
    prefill: Option<Arc<dyn ContinuationPrefill>>,
    config: MigrationConfig,
    deadline: Option<Duration>,
    counts: Arc<MigrationCounts>,
}

impl std::fmt::Debug for MigratingDecode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigratingDecode")
            .field("config", &self.config)
            .field("deadline", &self.deadline)
            .field("prefill", &self.prefill.is_some())
            .finish_non_exhaustive()
    }
}

impl MigratingDecode {
    /// Migration over `inner`, bounded by `config` and, if given, a deadline of `deadline`
    /// from the decode's start.
    pub fn new(
        inner: Arc<dyn Decode>,
        config: MigrationConfig,
        deadline: Option<Duration>,
    ) -> Self {
        MigratingDecode {
            inner,
            prefill: None,
            config,
            deadline,
            counts: Arc::default(),
        }
    }

    /// Continuations go through `prefill` first while it is Active.
    #[must_use]
    pub fn with_prefill(mut self, prefill: Arc<dyn ContinuationPrefill>) -> Self {
        self.prefill = Some(prefill);
        self
    }

    /// What it counted.
    pub fn counts(&self) -> &Arc<MigrationCounts> {
        &self.counts
    }

    /// Its bounds.
    pub fn config(&self) -> MigrationConfig {
        self.config
    }
}

impl Decode for MigratingDecode {
    fn decode(
        &self,
        mut request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        async move {
            if self.config.limit == 0 {
                return self.inner.decode(request, prefill).await;
            }
            if let Some(outcome) = &prefill {
                request.handoff = outcome.handoff.clone().or(request.handoff);
            }
            let deadline = self.deadline.map(|d| tokio::time::Instant::now() + d);
            let machine = Migration::new(
                request.clone(),
                self.config,
                deadline.map(tokio::time::Instant::into_std),
            );
            // A failure before the first stream is the inner hop's (its dispatcher already
            // retried before the first token): as before migration.
            let first = self.inner.decode(request, prefill).await?;
            let driver = Driver {
                inner: Arc::clone(&self.inner),
                prefill: self.prefill.clone(),
                counts: Arc::clone(&self.counts),
                machine,
                current: Some(first),
                deadline,
                over: false,
            };
            let stream: DecodeStream = Box::pin(futures_util::stream::unfold(driver, Driver::next));
            Ok(stream)
        }
        .boxed()
    }
}

/// One client stream's state: the machine and the attempt it reads.
struct Driver {
    inner: Arc<dyn Decode>,
    prefill: Option<Arc<dyn ContinuationPrefill>>,
    counts: Arc<MigrationCounts>,
    machine: Migration,
    current: Option<DecodeStream>,
    deadline: Option<tokio::time::Instant>,
    over: bool,
}

/// What the current attempt said.
enum Event {
    Item(Option<Result<GenerateResponse, DecodeError>>),
    Deadline,
}

impl Driver {
    /// The client's next item. Dropping the stream drops the current attempt, which cancels
    /// it at its worker: that is the machine's `Stop` (no continuation can start after it).
    async fn next(mut self) -> Option<(Result<GenerateResponse, DecodeError>, Driver)> {
        loop {
            if self.over {
                return None;
            }
            let current = self.current.as_mut()?;
            let event = match self.deadline {
                Some(deadline) => tokio::select! {
                    item = current.next() => Event::Item(item),
                    () = tokio::time::sleep_until(deadline) => Event::Deadline,
                },
                None => Event::Item(current.next().await),
            };
            let attempt = self.machine.attempt();
            // The deadline's clock (tokio's: paused in tests, where std's would spin until
            // the real deadline).
            let now = tokio::time::Instant::now().into_std();
            let (step, response) = match event {
                Event::Deadline => (self.machine.handle_timeout(now), None),
                Event::Item(Some(Ok(response))) => {
                    let step = match response.finish {
                        Some(reason) => {
                            self.machine
                                .handle_finish(attempt, &response.token_ids, reason)
                        }
                        None => self.machine.handle_tokens(attempt, &response.token_ids),
                    };
                    (step, Some(response))
                }
                Event::Item(Some(Err(error))) => match break_reason(&error) {
                    Some((reason, worker)) => {
                        tracing::info!(%error, reason = reason.as_str(), "decode stream broke");
                        (
                            self.machine.handle_break(attempt, reason, worker, now),
                            None,
                        )
                    }
                    // The worker answered with an error: the request failed, not the worker.
                    None => {
                        self.over = true;
                        return Some((Err(error), self));
                    }
                },
                Event::Item(None) => {
                    let reason = BreakReason::ConnectionDropped;
                    (self.machine.handle_break(attempt, reason, None, now), None)
                }
            };
            if let Some(item) = self.carry_out(step, response).await {
                return Some((item, self));
            }
        }
    }

    /// Carries out the machine's `step`; the item for the client, if any.
    async fn carry_out(
        &mut self,
        step: Step,
        response: Option<GenerateResponse>,
    ) -> Option<Result<GenerateResponse, DecodeError>> {
        let migrated = self.machine.migrations() > 0;
        let mut out = response.map(|mut r| {
            if r.token_ids != step.emit {
                // Cut by the machine (past `max_tokens` or a stop): the engine's text no
                // longer matches, so the frontend renders the tokens itself.
                r.text = None;
                r.token_ids.clone_from(&step.emit);
            }
            r.finish = None;
            r
        });
        match step.next {
            None => {}
            Some(Next::Continue(c)) => {
                self.counts.by_reason[reason_index(c.reason)].fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    attempt = c.attempt.0,
                    reason = c.reason.as_str(),
                    emitted = self.machine.emitted().len(),
                    "decode stream migrates to another decode worker"
                );
                self.current = None;
                let (inner, prefill) = (Arc::clone(&self.inner), self.prefill.clone());
                match continue_on_a_decode_worker(inner, prefill, &self.counts, c).await {
                    Ok(stream) => self.current = Some(stream),
                    Err(error) => {
                        self.over = true;
                        return Some(Err(error));
                    }
                }
            }
            Some(Next::Finish(finished)) => {
                self.over = true;
                self.current = None;
                let mut r = out.take().unwrap_or_default();
                r.finish = Some(finished.reason);
                if migrated {
                    // The last worker counted only its own attempt.
                    r.usage = Some(EngineUsage {
                        prompt_tokens: finished.usage.prompt_tokens,
                        completion_tokens: finished.usage.completion_tokens,
                        cached_tokens: None,
                    });
                }
                return Some(Ok(r));
            }
            Some(Next::Fail(error)) => {
                self.over = true;
                self.current = None;
                self.counts.exhausted.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "decode stream not continued");
                return Some(Err(DecodeError::Migration(error)));
            }
            Some(Next::Stop) => {
                self.over = true;
                self.current = None;
                return None;
            }
        }
        // Tokens (or the first response's prefill details) go out as they come.
        out.filter(|r| !r.token_ids.is_empty() || r.prefill.is_some() || r.usage.is_some())
            .map(Ok)
    }
}

/// Starts a continuation: through the prefill pool if one is installed and Active, else
/// straight to decode (whose worker prefills the prompt itself). Owns its handles: the
/// driver's current stream is not `Sync`, so it must not be borrowed across the awaits.
///
/// Either way the decode steers away from the workers the stream broke on
/// ([`Continuation::avoid`]): a worker whose stream broke may still accept connections (a cut
/// stream, a restarted process), and nothing else would keep the pick off it.
async fn continue_on_a_decode_worker(
    inner: Arc<dyn Decode>,
    prefill: Option<Arc<dyn ContinuationPrefill>>,
    counts: &MigrationCounts,
    continuation: Continuation,
) -> Result<DecodeStream, DecodeError> {
    let Continuation { request, avoid, .. } = continuation;
    let steered = Avoiding {
        inner: &*inner,
        avoid: &avoid,
    };
    if let Some(prefill) = prefill {
        if let Some(result) = prefill.prefill_then_decode(request.clone(), &steered).await {
            counts.prefilled.fetch_add(1, Ordering::Relaxed);
            return result;
        }
    }
    steered.decode(request, None).await
}

impl From<MigrationError> for DecodeError {
    fn from(error: MigrationError) -> Self {
        DecodeError::Migration(error)
    }
}

#[cfg(test)]
mod tests;
