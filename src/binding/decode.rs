//! The decode hop over a decode dispatcher.

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};

use crate::push::Dispatcher;
use crate::router::{Decode, DecodeError, DecodeStream, PrefillOutcome};
use crate::transport::GenerateRequest;

/// [`Decode`] over a dispatcher of the decode set: the request (with its prefill handoff, if
/// any) goes to one decode worker and its responses stream back.
#[derive(Debug)]
pub struct DecodePool {
    router: Dispatcher,
}

impl DecodePool {
    /// The decode hop over `router`.
    pub fn new(router: Dispatcher) -> Self {
        DecodePool { router }
    }

    /// The dispatcher.
    pub fn router(&self) -> &Dispatcher {
        &self.router
    }
}

impl Decode for DecodePool {
    fn decode(
        &self,
        mut request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        async move {
            if let Some(outcome) = prefill {
                // The router already sets it; keep the outcome authoritative either way.
                request.handoff = outcome.handoff.or(request.handoff);
            }
            let stream = self.router.generate(request).await?;
            let stream: DecodeStream = Box::pin(stream.map(|item| item.map_err(DecodeError::from)));
            Ok(stream)
        }
        .boxed()
    }
}
