//! The decode hop over a decode dispatcher.

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};

use super::{Decode, DecodeError, DecodeStream};
use crate::binding::PrefillOutcome;
use crate::discovery::InstanceId;
use crate::push::Dispatcher;
use crate::request::GenerateRequest;

/// [`Decode`] over a dispatcher of the decode set: the request (with its prefill handoff, if
/// any) goes to one decode worker and its responses stream back.
#[derive(Debug)]
pub struct DecodePool {
    dispatcher: Dispatcher,
}

impl DecodePool {
    /// The decode hop over `dispatcher`.
    pub fn new(dispatcher: Dispatcher) -> Self {
        DecodePool { dispatcher }
    }

    /// The dispatcher.
    pub fn dispatcher(&self) -> &Dispatcher {
        &self.dispatcher
    }
}

impl Decode for DecodePool {
    fn decode(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        self.decode_avoiding(request, prefill, &[])
    }

    fn decode_avoiding<'a>(
        &'a self,
        mut request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
        avoid: &'a [InstanceId],
    ) -> BoxFuture<'a, Result<DecodeStream, DecodeError>> {
        async move {
            if let Some(outcome) = prefill {
                // The router already sets it; keep the outcome authoritative either way.
                request.handoff = outcome.handoff.or(request.handoff);
            }
            // The first response says where the prefill ran when the decode worker does not
            // (an engine's stream never does), so the frontend can tell its client.
            let mut handoff = request.handoff.clone();
            let stream = self.dispatcher.generate_avoiding(request, avoid).await?;
            let stream: DecodeStream = Box::pin(stream.map(move |item| {
                item.map(|mut response| {
                    if let Some(info) = handoff.take() {
                        response.prefill.get_or_insert(info);
                    }
                    response
                })
                .map_err(DecodeError::from)
            }));
            Ok(stream)
        }
        .boxed()
    }
}
