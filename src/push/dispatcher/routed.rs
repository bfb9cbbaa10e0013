//! What a dispatch hands back: a held pick ([`HeldPick`]) and a routed request's responses
//! ([`RoutedStream`]), and how a link's failure becomes a dispatcher error.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_core::Stream;

use super::booking::Booking;
use super::picked::Pick;
use super::{Dispatcher, WorkerLink};
use crate::discovery::{Instance, InstanceId};
use crate::health::FailureClass;
use crate::push::affinity::AffinityOutcome;
use crate::push::health::failure_class;
use crate::push::view::InstanceStatus;
use crate::push::{PushError, RoutableView};
use crate::request::{GenerateRequest, GenerateResponse};
use crate::transport::TransportError;

/// Map a transport failure to a dispatcher error and its class, and report it to the instance's
/// breaker (which opens only on a connection-level failure, per [`failure_class`]).
pub(super) fn classify(
    view: &RoutableView,
    instance: InstanceId,
    error: TransportError,
) -> (PushError, FailureClass) {
    let class = failure_class(&error);
    view.report_failure(instance, class);
    let error = match error {
        TransportError::Timeout => PushError::Timeout { instance },
        TransportError::Remote(_) | TransportError::RequestTooLarge { .. } => {
            PushError::Transport {
                instance,
                source: error,
            }
        }
        _ => {
            if view.is_discovered(instance) {
                PushError::Transport {
                    instance,
                    source: error,
                }
            } else {
                PushError::InstanceGone(instance)
            }
        }
    };
    (error, class)
}

/// A pick of [`Dispatcher::select_held`]: the instance, and the work booked on it until
/// dropped (or until the stream of [`Dispatcher::dispatch_held`] that took it ends).
pub struct HeldPick {
    instance: Arc<Instance>,
    overlap: Option<usize>,
    affinity: Option<AffinityOutcome>,
    booking: Option<Booking>,
}

impl From<Pick> for HeldPick {
    fn from(pick: Pick) -> Self {
        HeldPick {
            instance: pick.instance,
            overlap: pick.overlap,
            affinity: pick.affinity,
            booking: pick.booking,
        }
    }
}

impl std::fmt::Debug for HeldPick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldPick")
            .field("instance", &self.instance.instance_id)
            .field("overlap", &self.overlap)
            .finish()
    }
}

impl HeldPick {
    /// The picked instance.
    pub fn instance(&self) -> &Arc<Instance> {
        &self.instance
    }

    /// In KV mode, the leading blocks the selector expected the worker to have cached.
    pub fn expected_overlap_blocks(&self) -> Option<usize> {
        self.overlap
    }

    /// How session affinity decided the pick (`None`: no session key, or affinity off).
    pub fn affinity(&self) -> Option<AffinityOutcome> {
        self.affinity
    }

    /// The prefill work (uncached prompt tokens) this pick booked on the instance (KV mode).
    pub fn booked_work(&self) -> Option<u64> {
        self.booking.as_ref().map(Booking::amount)
    }
}

impl<L: WorkerLink> Dispatcher<L> {
    /// Send `request` through the link to the instance `selection` picked, as the request's
    /// only attempt, and stream its responses: the selection's booking moves into the returned
    /// stream and is released when the request is over (the stream ended or failed, or was
    /// dropped: cancelled),
    /// exactly as [`generate`](Self::generate)'s own pick's is. For callers that pick first
    /// and dispatch that very pick later (conditional disaggregation probes the pick before
    /// deciding), so the work stays booked from the pick to the end of the request.
    ///
    /// The instance must still be routable (else [`PushError::InstanceGone`] or
    /// [`PushError::DirectTargetNotRoutable`], and the booking is released). The deadline is
    /// [`PushConfig::request_timeout`](super::PushConfig::request_timeout) from this call.
    /// Nothing is retried: a caller that wants a retry elsewhere picks again.
    pub async fn dispatch_held(
        &self,
        selection: HeldPick,
        request: GenerateRequest,
    ) -> Result<RoutedStream<L::Stream>, PushError> {
        let deadline = self
            .config
            .request_timeout
            .map(|t| tokio::time::Instant::now() + t);
        let id = selection.instance.instance_id;
        // The address as discovered now: the instance may have moved since the pick.
        let instance = match self.view.status(id) {
            InstanceStatus::Routable(instance) => instance,
            InstanceStatus::Unknown => return Err(PushError::InstanceGone(id)),
            InstanceStatus::NotAdmitted | InstanceStatus::Unhealthy(_) => {
                return Err(PushError::DirectTargetNotRoutable(id))
            }
        };
        let pick = Pick {
            instance,
            overlap: selection.overlap,
            affinity: selection.affinity,
            booking: selection.booking,
        };
        self.dispatch(pick, request, deadline).await
    }
}

/// The responses of a routed request, and which instance serves it. Dropping it cancels the
/// request at the worker; the work the pick booked there is released when the stream ends or
/// fails (the request is over, whether or not the caller drops the stream yet) or drops. `S` is the link's
/// stream ([`WorkerLink::Stream`](super::WorkerLink::Stream)): the request plane's by default.
pub struct RoutedStream<S = super::LinkStream> {
    pub(super) instance: InstanceId,
    pub(super) overlap: Option<usize>,
    pub(super) affinity: Option<AffinityOutcome>,
    pub(super) inner: S,
    pub(super) view: RoutableView,
    /// The first item, read ahead by a retrying `generate` (`Some(None)`: the stream ended).
    pub(super) peeked: Option<Option<Result<GenerateResponse, PushError>>>,
    /// Released when the stream ends or fails (the request is over) or drops (cancelled).
    pub(super) booking: Option<Booking>,
}

impl<S> std::fmt::Debug for RoutedStream<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutedStream")
            .field("instance", &self.instance)
            .field("overlap", &self.overlap)
            .finish()
    }
}

impl<S> RoutedStream<S> {
    /// The instance serving this request.
    pub fn instance_id(&self) -> InstanceId {
        self.instance
    }

    /// In KV mode, the leading blocks the selector expected the worker to have cached.
    pub fn expected_overlap_blocks(&self) -> Option<usize> {
        self.overlap
    }

    /// How session affinity decided the pick (`None`: no session key, or affinity off).
    pub fn affinity(&self) -> Option<AffinityOutcome> {
        self.affinity
    }
}

impl<S> RoutedStream<S>
where
    S: Stream<Item = Result<GenerateResponse, TransportError>> + Unpin,
{
    /// Read the first item ahead. An error is returned with its class (the stream is then
    /// spent); a response or the end is kept for the caller.
    pub(super) async fn peek(&mut self) -> Option<(PushError, FailureClass)> {
        use futures_util::StreamExt;
        match self.inner.next().await {
            Some(Err(e)) => {
                self.booking = None;
                Some(classify(&self.view, self.instance, e))
            }
            Some(Ok(response)) => {
                self.peeked = Some(Some(Ok(response)));
                None
            }
            None => {
                self.booking = None;
                self.peeked = Some(None);
                None
            }
        }
    }
}

impl<S> Stream for RoutedStream<S>
where
    S: Stream<Item = Result<GenerateResponse, TransportError>> + Unpin,
{
    type Item = Result<GenerateResponse, PushError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(first) = this.peeked.take() {
            return Poll::Ready(first);
        }
        match Pin::new(&mut this.inner).poll_next(cx) {
            Poll::Ready(Some(Err(e))) => {
                // The request is over: its work no longer weighs on the worker.
                this.booking = None;
                Poll::Ready(Some(Err(classify(&this.view, this.instance, e).0)))
            }
            Poll::Ready(Some(Ok(r))) => Poll::Ready(Some(Ok(r))),
            Poll::Ready(None) => {
                this.booking = None;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
