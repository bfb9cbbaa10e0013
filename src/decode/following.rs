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
use crate::advert::SetLink;
use crate::binding::PrefillOutcome;
use crate::discovery::{Discovery, EndpointId, InstanceId};
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
    /// Timeouts of the links to a decode set of engines.
    #[cfg(feature = "engine")]
    engine: crate::engine::EngineLinkConfig,
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
            #[cfg(feature = "engine")]
            engine: crate::engine::EngineLinkConfig::default(),
        }
    }

    /// Reach a decode set of engines with these timeouts.
    #[cfg(feature = "engine")]
    pub(crate) fn with_engine(mut self, engine: crate::engine::EngineLinkConfig) -> Self {
        self.engine = engine;
        self
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
        wanted: Option<(EndpointId, Option<SetLink>)>,
        catch_up: Duration,
        cancel: &CancellationToken,
    ) {
        let (endpoint, link) = match wanted {
            Some((endpoint, link)) => (Some(endpoint), link),
            None => (None, None),
        };
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
        let dispatcher = match self.dispatcher(view, link.unwrap_or(SetLink::RequestPlane)) {
            Ok(dispatcher) => dispatcher,
            Err(error) => {
                // Logged once per change of the decode set (the follower calls once).
                tracing::error!(%endpoint, %error, "the decode set cannot be routed to");
                self.slot.store(None);
                return;
            }
        };
        let pool = DecodePool::new(dispatcher);
        tracing::info!(%endpoint, "decode hop follows a new decode set");
        self.slot.store(Some(Arc::new(Slot {
            endpoint,
            pool,
            _feed: feed.drop_guard(),
        })));
    }
}

impl FollowingDecode {
    /// The decode dispatcher over `view` for a set reached by `link`.
    fn dispatcher(&self, view: RoutableView, link: SetLink) -> Result<Dispatcher, DecodeError> {
        match link {
            SetLink::RequestPlane => {
                Ok(Dispatcher::new(view, self.mode.clone(), self.push.clone()))
            }
            #[cfg(feature = "engine")]
            SetLink::Engine {
                protocol,
                block_size,
            } => {
                tracing::info!(%protocol, block_size, "the decode set's workers are engines");
                let link = crate::engine::EngineLink::new(
                    crate::engine::EngineRole::Decode,
                    block_size,
                    self.engine.clone(),
                );
                Ok(Dispatcher::with_engine(
                    view,
                    self.mode.clone(),
                    self.push.clone(),
                    link,
                ))
            }
            #[cfg(not(feature = "engine"))]
            SetLink::Engine { protocol, .. } => {
                drop(view);
                Err(DecodeError::Failed {
                    message: format!(
                        "the decode set's workers are {protocol} engines: this build lacks feature `engine`"
                    ),
                })
            }
            SetLink::Mixed => Err(DecodeError::Failed {
                message: "the decode set's cards mix worker protocols".into(),
            }),
        }
    }
}

impl Decode for FollowingDecode {
    fn decode(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        self.decode_avoiding(request, prefill, &[])
    }

    fn decode_avoiding<'a>(
        &'a self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
        avoid: &'a [InstanceId],
    ) -> BoxFuture<'a, Result<DecodeStream, DecodeError>> {
        let slot = self.slot.load_full();
        async move {
            let Some(slot) = slot else {
                return Err(DecodeError::Push(PushError::NoRoutableInstances));
            };
            let stream = slot.pool.decode_avoiding(request, prefill, avoid).await?;
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
