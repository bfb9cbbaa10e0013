//! The dispatcher's send: one attempt through its link to the picked instance, and the retry
//! loop that takes the mode's next-best pick after a failure that may be retried elsewhere.

use tokio::time::Instant;

use super::picked::Pick;
use super::routed::classify;
use super::{Dispatch, DispatchMutant, Dispatcher, PushMode, RoutedStream, WorkerLink};
use crate::discovery::InstanceId;
use crate::handoff::{Handoff, SendOutcome};
use crate::health::FailureClass;
use crate::push::error::{Attempt, PushError};
use crate::request::GenerateRequest;
use crate::transport::TransportError;

impl<L: WorkerLink> Dispatcher<L> {
    /// Route `request` per the mode and stream its responses.
    ///
    /// A failure before the worker produced any output (sending, or the first stream item an
    /// error) whose class may be retried elsewhere ([`FailureClass::retry_elsewhere`]) is
    /// retried on a different routable worker (the mode's next-best pick, never one the
    /// request already failed on), at most [`PushConfig::retry_budget`] times and never past
    /// the deadline. With a budget above 0 the call waits for the first response before
    /// returning the stream (a first-item error is returned by this call); once a response
    /// arrived, nothing is retried. A request tried
    /// once fails with its own error; after retries, with [`PushError::Exhausted`] listing
    /// every attempt. `Direct` mode never retries.
    ///
    /// A request carrying a single-use handoff ([`PrefillInfo::is_single_use`]) follows the
    /// handoff rules ([`crate::handoff`]): it is retried only after attempts that provably
    /// never reached their worker (a refused connection); once one may have, the handle is
    /// used and the request fails with that attempt's error rather than send it twice.
    ///
    /// [`PrefillInfo::is_single_use`]: crate::request::PrefillInfo::is_single_use
    ///
    /// [`PushConfig::retry_budget`]: super::PushConfig::retry_budget
    pub async fn generate(
        &self,
        request: GenerateRequest,
    ) -> Result<RoutedStream<L::Stream>, PushError> {
        self.generate_avoiding(request, &[]).await
    }

    /// [`generate`](Self::generate), every pick steering away from the workers in `avoid`
    /// while another is routable: a migrated stream's continuation avoids the workers its
    /// stream broke on, which may still accept connections (a cut stream, a restarted
    /// process), so neither the retry's exclusions nor the breakers would keep the pick off
    /// them. When only avoided workers are routable they may take it (one may have come back);
    /// unlike the workers a request failed on, they are never reported to the link as failed.
    /// `Direct` mode ignores `avoid`.
    pub async fn generate_avoiding(
        &self,
        request: GenerateRequest,
        avoid: &[InstanceId],
    ) -> Result<RoutedStream<L::Stream>, PushError> {
        let deadline = self.config.request_timeout.map(|t| Instant::now() + t);
        let budget = if matches!(self.mode, PushMode::Direct(_)) {
            0
        } else {
            self.config.retry_budget
        };
        if budget == 0 {
            let pick = self.select_avoiding(&request, &[], avoid, deadline).await?;
            return self.dispatch(pick, request, deadline).await;
        }
        // `excluded` stays the workers failed so far, in order (bar the test mutant that
        // reuses them), which is what the link is told.
        let mut attempts: Vec<Attempt> = Vec::new();
        let mut excluded: Vec<InstanceId> = Vec::new();
        // The single-use handle's rules, fed by every attempt (`None`: nothing single-use).
        let mut handoff = request
            .handoff
            .as_ref()
            .filter(|h| h.is_single_use())
            .map(|_| Handoff::new());
        let mut request = Some(request);
        loop {
            // Taken only by the last attempt, which never loops back.
            let Some(current) = request.as_ref() else {
                return Err(exhausted(attempts, PushError::NoRoutableInstances));
            };
            let pick = match self
                .select_avoiding(current, &excluded, avoid, deadline)
                .await
            {
                Ok(pick) => pick,
                Err(e) => return Err(exhausted(attempts, e)),
            };
            let id = pick.instance.instance_id;
            let last = attempts.len() >= budget as usize;
            // Keep a copy only while another attempt may follow.
            let this = if last {
                request.take()
            } else {
                request.clone()
            }
            .unwrap_or_default();
            let attempt = u32::try_from(attempts.len()).unwrap_or(u32::MAX);
            if let Some(handoff) = handoff.as_mut() {
                // Held here by construction: the loop only comes back while `may_send`.
                if let Err(refused) = handoff.handle_send() {
                    tracing::error!(%refused, "a decode attempt would resend a used handoff");
                    return Err(exhausted(attempts, PushError::NoRoutableInstances));
                }
            }
            let sent = self
                .dispatch_classified(pick, this, deadline, (attempt, &excluded))
                .await;
            let failure = match sent {
                // Every attempt reads its first item ahead, the last one too: a request that was
                // retried ends with one error listing its attempts, never a stream error.
                Ok(mut stream) => match stream.peek().await {
                    None => {
                        if let Some(handoff) = handoff.as_mut() {
                            let _ = handoff.handle_send_result(SendOutcome::Answered);
                        }
                        return Ok(stream);
                    }
                    Some((error, class)) => (error, class),
                },
                Err(failure) => failure,
            };
            let (error, class) = failure;
            let handle_spent = handoff.as_mut().is_some_and(|handoff| {
                // The mutant takes a used handle back as if the attempt had never left.
                let unsent =
                    class.request_unsent() || self.mutant.is(DispatchMutant::ResendHandoff);
                let outcome = if unsent {
                    SendOutcome::Unsent
                } else {
                    SendOutcome::FailedAfterSend
                };
                let _ = handoff.handle_send_result(outcome);
                !handoff.may_send()
            });
            attempts.push(Attempt {
                instance: id,
                class,
                error,
            });
            let expired = deadline.is_some_and(|d| Instant::now() >= d);
            if last || !class.retry_elsewhere() || expired || handle_spent {
                return Err(exhausted(attempts, PushError::NoRoutableInstances));
            }
            self.retries.record(class);
            tracing::debug!(instance = id, %class, attempt = attempts.len(), "retrying the request on another worker");
            if !self.mutant.is(DispatchMutant::ReuseFailed) {
                excluded.push(id);
            }
        }
    }

    /// A pick as [`select_or_wait`](Self::select_or_wait) never in `excluded` and, while
    /// another worker is routable, never in `avoid`.
    async fn select_avoiding(
        &self,
        request: &GenerateRequest,
        excluded: &[InstanceId],
        avoid: &[InstanceId],
        deadline: Option<Instant>,
    ) -> Result<Pick, PushError> {
        let steer = !self.mutant.is(DispatchMutant::IgnoresAvoid);
        if steer && avoid.iter().any(|id| !excluded.contains(id)) {
            let mut both = excluded.to_vec();
            both.extend(avoid.iter().filter(|id| !excluded.contains(id)));
            match self.select_or_wait(request, &both, deadline).await {
                // Only avoided workers are left: one of them may take it.
                Err(PushError::NoRoutableInstances) => {
                    tracing::debug!(
                        ?avoid,
                        "only avoided workers are routable: picking among them"
                    );
                }
                other => return other,
            }
        }
        self.select_or_wait(request, excluded, deadline).await
    }

    /// Send `request` to the named instance, whatever the mode.
    pub async fn generate_direct(
        &self,
        instance: InstanceId,
        request: GenerateRequest,
    ) -> Result<RoutedStream<L::Stream>, PushError> {
        let deadline = self.config.request_timeout.map(|t| Instant::now() + t);
        let target = self.direct_target(instance)?;
        let pick = Pick {
            instance: target,
            overlap: None,
            affinity: None,
            booking: None,
        };
        self.dispatch(pick, request, deadline).await
    }

    /// A request's only attempt (no retries).
    pub(super) async fn dispatch(
        &self,
        pick: Pick,
        request: GenerateRequest,
        deadline: Option<Instant>,
    ) -> Result<RoutedStream<L::Stream>, PushError> {
        self.dispatch_classified(pick, request, deadline, (0, &[]))
            .await
            .map_err(|(e, _)| e)
    }

    /// Send one attempt (number `attempt`, after failing on `failed`) of `request` through
    /// the link to the picked instance; the pick's booking then lives in the stream.
    async fn dispatch_classified(
        &self,
        pick: Pick,
        request: GenerateRequest,
        deadline: Option<Instant>,
        (attempt, failed): (u32, &[InstanceId]),
    ) -> Result<RoutedStream<L::Stream>, (PushError, FailureClass)> {
        let Pick {
            instance,
            overlap,
            affinity,
            booking,
        } = pick;
        let id = instance.instance_id;
        if let Some(overlap) = overlap {
            self.kv_decisions.record(overlap);
        }
        let dispatch = Dispatch {
            instance: &instance,
            attempt,
            failed,
            expected_overlap_blocks: overlap,
            affinity,
        };
        let send = self.link.open(dispatch, request, deadline);
        let sent = match deadline {
            Some(d) => tokio::time::timeout_at(d, send)
                .await
                .unwrap_or(Err(TransportError::Timeout)),
            None => send.await,
        };
        match sent {
            Ok(inner) => Ok(RoutedStream {
                instance: id,
                overlap,
                affinity,
                inner,
                view: self.view.clone(),
                peeked: None,
                booking,
            }),
            Err(e) => Err(classify(&self.view, id, e)),
        }
    }
}

/// The error a request ends with: its only attempt's own error, or [`PushError::Exhausted`]
/// after retries; `none_left` (why no attempt could start) when there was no attempt.
fn exhausted(mut attempts: Vec<Attempt>, none_left: PushError) -> PushError {
    match attempts.len() {
        0 => none_left,
        1 => attempts.pop().map_or(none_left, |a| a.error),
        _ => PushError::Exhausted { attempts },
    }
}
