//! The decode hop that follows the topology's decode set (the hop's follower task points it
//! at each new decode endpoint).

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::DecodePool;
use super::{Decode, DecodeError, DecodeStream};
use crate::binding::PrefillOutcome;
use crate::discovery::{Discovery, EndpointId};
use crate::push::{Dispatcher, PushConfig, PushError, PushMode, RoutableView};
use crate::request::GenerateRequest;

/// One decode endpoint's dispatcher and the guard of its discovery feed.
struct Slot {
    endpoint: EndpointId,
    pool: DecodePool,
    /// Cancels the feed when the last request holding the slot lets go of it.
    _feed: DropGuard,
}

/// [`Decode`] over the dispatcher of the topology's current decode set. When the decode
/// endpoint changes, a new dispatcher is built over the new endpoint and swapped in; requests
/// already decoding finish on the old one. Without a decode set, requests fail at once with
/// [`PushError::NoRoutableInstances`].
pub struct FollowingDecode {
    slot: ArcSwapOption<Slot>,
    mode: PushMode,
    push: PushConfig,
}

impl std::fmt::Debug for FollowingDecode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FollowingDecode")
            .field("endpoint", &self.endpoint())
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl FollowingDecode {
    /// No decode set yet; dispatchers are built in `mode` with `push`.
    pub(crate) fn new(mode: PushMode, push: PushConfig) -> Self {
        FollowingDecode {
            slot: ArcSwapOption::empty(),
            mode,
            push,
        }
    }

    /// The decode endpoint requests go to now, if any.
    pub fn endpoint(&self) -> Option<EndpointId> {
        self.slot.load().as_ref().map(|s| s.endpoint.clone())
    }

    /// How many decode instances are routable now (0 without a decode set).
    pub fn routable(&self) -> usize {
        self.slot
            .load()
            .as_ref()
            .map_or(0, |s| s.pool.dispatcher().view().routable().len())
    }

    /// The current decode dispatcher's view, if any (for waits in tests and demos).
    pub fn view(&self) -> Option<RoutableView> {
        self.slot
            .load()
            .as_ref()
            .map(|s| s.pool.dispatcher().view().clone())
    }

    pub(crate) fn clear(&self) {
        self.slot.store(None);
    }

    /// Point at `endpoint` (a new dispatcher over `discovery`'s watch of it), or at nothing.
    pub(crate) async fn retarget(
        &self,
        discovery: &Arc<dyn Discovery>,
        endpoint: Option<EndpointId>,
        catch_up: Duration,
        cancel: &CancellationToken,
    ) {
        let Some(endpoint) = endpoint else {
            if self.slot.swap(None).is_some() {
                tracing::info!("decode set gone: decode requests fail until one returns");
            }
            return;
        };
        let events = match discovery.watch(&endpoint).await {
            Ok(events) => events,
            Err(error) => {
                tracing::warn!(%endpoint, %error, "watching the decode endpoint failed");
                self.slot.store(None);
                return;
            }
        };
        let feed = cancel.child_token();
        let view = RoutableView::spawn_with(events, None, feed.clone(), self.push.health);
        // Use it once it knows an instance (the topology already saw one), bounded.
        let _ = tokio::time::timeout(catch_up, view.wait_for(|r| !r.is_empty())).await;
        let pool = DecodePool::new(Dispatcher::new(view, self.mode.clone(), self.push.clone()));
        tracing::info!(%endpoint, "decode hop follows a new decode set");
        self.slot.store(Some(Arc::new(Slot {
            endpoint,
            pool,
            _feed: feed.drop_guard(),
        })));
    }
}

impl Decode for FollowingDecode {
    fn decode(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        let slot = self.slot.load_full();
        async move {
            let Some(slot) = slot else {
                return Err(DecodeError::Push(PushError::NoRoutableInstances));
            };
            let stream = slot.pool.decode(request, prefill).await?;
            // The stream holds the slot: a retarget mid-request does not end this feed.
            let stream: DecodeStream = Box::pin(Holding {
                inner: stream,
                _slot: slot,
            });
            Ok(stream)
        }
        .boxed()
    }
}

/// A decode stream that keeps its dispatcher's slot alive.
struct Holding {
    inner: DecodeStream,
    _slot: Arc<Slot>,
}

impl futures_core::Stream for Holding {
    type Item = <DecodeStream as futures_core::Stream>::Item;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}
