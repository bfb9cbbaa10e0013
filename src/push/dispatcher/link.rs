//! The dispatcher's send step: the one seam between choosing a worker and reaching it.
//!
//! Everything the dispatcher decides (the pick, the booking, the retry elsewhere, the release,
//! the breaker report) happens on its side of [`WorkerLink::open`]; the link only carries one
//! attempt of a request to one instance and hands back its responses or a typed
//! [`TransportError`], whose [`failure_class`](crate::push::failure_class) the dispatcher
//! reads. Production dispatchers send over [`TcpLink`] (the request plane's connection pool);
//! the simulator supplies an in-memory link to simulated workers, so it exercises this same
//! select → book → send → retry → release loop instead of a copy of it.
//!
//! Cost: static dispatch. [`Dispatcher`](super::Dispatcher) is generic over its link, with [`TcpLink`] as the
//! default type parameter, so `Dispatcher` still names the production dispatcher and its send
//! compiles to a direct call into the connection pool: no vtable, and no boxed future or
//! stream per request (an `Arc<dyn WorkerLink>` would need one box per request for the
//! future, since a trait object's async method cannot return an unsized future unboxed).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use futures_core::Stream;
use futures_util::future::{BoxFuture, FutureExt, Shared};
use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::DropGuard;

use super::warm::{self, Warm};
use crate::discovery::{Instance, InstanceId};
use crate::push::affinity::AffinityOutcome;
use crate::push::kv_feed::KvFeed;
use crate::push::RoutableView;
use crate::request::{GenerateRequest, GenerateResponse};
use crate::transport::{ClientConfig, Connection, ResponseStream, TransportError};

/// How a [`Dispatcher`](super::Dispatcher) reaches a worker: open one request's response stream on one instance.
///
/// Implementations carry, they do not decide: they must not retry, pick another instance or
/// report to the view's breakers (the dispatcher does all three, from the error's
/// [`failure_class`](crate::push::failure_class)). A deadline, when given, is the request's:
/// the returned stream should end with [`TransportError::Timeout`] once it passes (the
/// dispatcher also bounds `open` itself by it).
pub trait WorkerLink: Send + Sync + 'static {
    /// The responses of one request; dropping it before its end cancels the request.
    type Stream: Stream<Item = Result<GenerateResponse, TransportError>> + Send + Unpin + 'static;

    /// Send `request` to `dispatch.instance` and return its response stream, or why it could
    /// not be sent. Called in the same poll as the pick it carries.
    fn open(
        &self,
        dispatch: Dispatch<'_>,
        request: GenerateRequest,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Self::Stream, TransportError>> + Send;

    /// Drop whatever the link keeps for `instance` (it left discovery). Nothing by default.
    fn forget(&self, instance: InstanceId) {
        let _ = instance;
    }
}

/// One attempt of a routed request as the dispatcher hands it to its [`WorkerLink`]: where it
/// goes, and what the pick that chose it knew. Only the dispatcher builds one.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Dispatch<'a> {
    /// The instance the attempt goes to.
    pub instance: &'a Arc<Instance>,
    /// 0 for a request's first attempt, then 1, 2... for its retries elsewhere.
    pub attempt: u32,
    /// The instances this request already failed on, oldest first (excluded from this pick).
    pub failed: &'a [InstanceId],
    /// In KV mode, the leading blocks of the request the selector credited the instance with.
    pub expected_overlap_blocks: Option<usize>,
    /// How session affinity decided the pick (`None`: no session key, or affinity off).
    pub affinity: Option<AffinityOutcome>,
}

/// The production link: one multiplexed request-plane [`Connection`] per instance, opened on
/// first use and replaced when it closed or the instance moved. In KV mode each connection
/// also carries its worker's KV cache events into the dispatcher's index, and every worker is
/// connected as soon as it enters the routable view (`warm.rs`), so its snapshot is in before
/// the first pick.
pub struct TcpLink {
    pool: Arc<Pool>,
    /// Stops the eager connects when the link (its dispatcher) drops (KV mode only).
    _warm: Option<DropGuard>,
}

/// The connections, shared with the eager connects (which hold it weakly).
struct Pool {
    client: ClientConfig,
    view: RoutableView,
    connections: Mutex<HashMap<InstanceId, Connection>>,
    /// The connect in flight per instance, and the address it dials.
    dialling: Mutex<HashMap<InstanceId, (SocketAddr, Dial)>>,
    /// Where the connections' KV events go (KV mode only).
    kv_feed: Option<Arc<KvFeed>>,
}

impl std::fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLink")
            .field("connections", &self.pool.connections.lock().len())
            .field("eager", &self._warm.is_some())
            .finish_non_exhaustive()
    }
}

impl TcpLink {
    pub(super) fn new(
        client: ClientConfig,
        view: RoutableView,
        kv_feed: Option<Arc<KvFeed>>,
    ) -> Self {
        let eager = kv_feed.is_some();
        let pool = Arc::new(Pool {
            client,
            view: view.clone(),
            connections: Mutex::new(HashMap::new()),
            dialling: Mutex::new(HashMap::new()),
            kv_feed,
        });
        // Only KV events make a connection worth having before a request: it brings the
        // worker's cache state. Without them there is nothing to warm, so connections stay
        // lazy (and an idle pool is never dialled).
        let warm = if eager {
            warm::spawn(&pool, view)
        } else {
            None
        };
        TcpLink { pool, _warm: warm }
    }

    /// Whether `instance` has a pooled connection that takes new requests.
    pub fn is_connected(&self, instance: &Instance) -> bool {
        self.pool.is_connected(instance)
    }
}

/// The pooled connection to `instance` if it takes new requests.
fn live(conns: &HashMap<InstanceId, Connection>, instance: &Instance) -> Option<Connection> {
    conns
        .get(&instance.instance_id)
        // A draining connection takes nothing new: a fresh one is served until its own drain
        // notice (see docs/transport.md, "Draining").
        .filter(|c| !c.is_closed() && !c.is_draining() && c.peer_addr() == instance.address)
        .cloned()
}

/// A connect in flight, shared by every caller that wants the same instance meanwhile; it
/// resolves to the pooled connection.
type Dial = Shared<BoxFuture<'static, Result<Connection, TransportError>>>;

impl Pool {
    /// The open connection to `instance`, or a new one. Callers that find no connection while
    /// one is being opened to the same address (a request racing the eager connect, or
    /// concurrent first requests) await that one: one dial per instance at a time.
    async fn connection(
        self: &Arc<Self>,
        instance: &Instance,
    ) -> Result<Connection, TransportError> {
        if let Some(c) = live(&self.connections.lock(), instance) {
            return Ok(c);
        }
        let dial = {
            let mut dialling = self.dialling.lock();
            match dialling.get(&instance.instance_id) {
                Some((address, dial)) if *address == instance.address => dial.clone(),
                _ => {
                    // Bounded by the discovered set: dials of departed instances go.
                    dialling.retain(|k, _| self.view.is_discovered(*k));
                    let dial = self.dial(instance.clone());
                    dialling.insert(instance.instance_id, (instance.address, dial.clone()));
                    dial
                }
            }
        };
        dial.await
    }

    /// Open and pool a connection to `instance` (subscribed to its KV events in KV mode), on
    /// a task of its own: it runs to its end (the connect timeout bounds it) whoever still
    /// waits, and clears its `dialling` entry itself, so no caller ever gets a stale outcome.
    fn dial(self: &Arc<Self>, instance: Instance) -> Dial {
        let pool = Arc::downgrade(self);
        let client = self.client.clone();
        // KV mode: the connection carries the worker's KV events too.
        let sink = self
            .kv_feed
            .as_ref()
            .map(|feed| feed.sink(instance.instance_id));
        let task = tokio::spawn(async move {
            let fresh = match sink {
                Some((sink, generation)) => {
                    Connection::connect_with_kv_events(instance.address, client, sink)
                        .await
                        .map(|c| (c, Some(generation)))
                }
                None => Connection::connect(instance.address, client)
                    .await
                    .map(|c| (c, None)),
            };
            // The link is gone: nobody to pool it for (the connection closes on drop).
            let pool = pool.upgrade().ok_or_else(|| TransportError::Disconnected {
                reason: "the dispatcher was dropped while connecting".into(),
            })?;
            pool.dialling.lock().remove(&instance.instance_id);
            let (fresh, generation) = fresh?;
            Ok(pool.adopt(&instance, fresh, generation))
        });
        // A join error: the runtime is shutting down (the task does not panic).
        async move {
            task.await.unwrap_or_else(|_| {
                Err(TransportError::Disconnected {
                    reason: "the connect task was stopped".into(),
                })
            })
        }
        .boxed()
        .shared()
    }

    /// Pool `fresh` as `instance`'s connection, unless a usable one is pooled already; the
    /// pooled one.
    fn adopt(&self, instance: &Instance, fresh: Connection, generation: Option<u64>) -> Connection {
        let id = instance.instance_id;
        let mut conns = self.connections.lock();
        // Drop connections of instances that left discovery, so the pool stays bounded by the
        // discovered set.
        conns.retain(|k, c| !c.is_closed() && self.view.is_discovered(*k));
        // Another caller connected concurrently: share theirs, ours closes on drop (and its
        // event stream, never adopted, changes nothing).
        if let Some(c) = live(&conns, instance) {
            return c;
        }
        conns.insert(id, fresh.clone());
        self.view
            .mark_draining_on(id, instance.address, fresh.drain_notice());
        // A new connection starts the worker's index entries afresh: events between the old
        // stream's end and this one's start may be lost.
        if let (Some(feed), Some(generation)) = (&self.kv_feed, generation) {
            feed.adopt(id, generation);
            // Adopted first, so the snapshot is applied rather than refused as stale.
            fresh.request_kv_snapshot();
        }
        fresh
    }
}

impl Warm for Pool {
    fn is_connected(&self, instance: &Instance) -> bool {
        live(&self.connections.lock(), instance).is_some()
    }

    async fn connect(self: &Arc<Self>, instance: &Instance) -> Result<(), TransportError> {
        self.connection(instance).await.map(drop)
    }
}

impl WorkerLink for TcpLink {
    type Stream = ResponseStream;

    async fn open(
        &self,
        dispatch: Dispatch<'_>,
        request: GenerateRequest,
        deadline: Option<Instant>,
    ) -> Result<ResponseStream, TransportError> {
        let conn = self.pool.connection(dispatch.instance).await?;
        conn.generate(request, deadline).await
    }

    fn forget(&self, instance: InstanceId) {
        self.pool.connections.lock().remove(&instance);
    }
}

/// An engine link is a worker link: the dispatcher's seam, carried by the link's own `open`.
#[cfg(feature = "engine")]
impl WorkerLink for crate::engine::EngineLink {
    type Stream = crate::engine::EngineStream;

    async fn open(
        &self,
        dispatch: Dispatch<'_>,
        request: GenerateRequest,
        deadline: Option<Instant>,
    ) -> Result<Self::Stream, TransportError> {
        self.send_to(dispatch.instance, request, deadline).await
    }
}

/// The production dispatchers' link: the request plane to our own workers ([`TcpLink`]) or,
/// with feature `engine`, HTTP to engines ([`EngineLink`](crate::engine::EngineLink)). Which
/// one a dispatcher gets is decided once, from its set's card, where it is built (the binding
/// factory, the decode follower): one set never mixes protocols, and the dispatcher itself has
/// no engine branch.
#[derive(Debug)]
#[non_exhaustive]
pub enum Link {
    /// Our request plane.
    Tcp(TcpLink),
    /// An engine protocol over HTTP.
    #[cfg(feature = "engine")]
    Engine(Box<crate::engine::EngineLink>),
}

impl Link {
    /// Whether `instance` has a pooled request-plane connection that takes new requests
    /// (always false for an engine link: its HTTP pool is hyper's).
    pub fn is_connected(&self, instance: &Instance) -> bool {
        match self {
            Link::Tcp(link) => link.is_connected(instance),
            #[cfg(feature = "engine")]
            Link::Engine(_) => false,
        }
    }
}

/// The responses of one request through a [`Link`].
#[non_exhaustive]
pub enum LinkStream {
    /// From the request plane.
    Tcp(ResponseStream),
    /// From an engine.
    #[cfg(feature = "engine")]
    Engine(crate::engine::EngineStream),
}

impl std::fmt::Debug for LinkStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LinkStream::Tcp(_) => "LinkStream::Tcp",
            #[cfg(feature = "engine")]
            LinkStream::Engine(_) => "LinkStream::Engine",
        })
    }
}

impl Stream for LinkStream {
    type Item = Result<GenerateResponse, TransportError>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        match self.get_mut() {
            LinkStream::Tcp(s) => std::pin::Pin::new(s).poll_next(cx),
            #[cfg(feature = "engine")]
            LinkStream::Engine(s) => s.as_mut().poll_next(cx),
        }
    }
}

impl WorkerLink for Link {
    type Stream = LinkStream;

    async fn open(
        &self,
        dispatch: Dispatch<'_>,
        request: GenerateRequest,
        deadline: Option<Instant>,
    ) -> Result<LinkStream, TransportError> {
        match self {
            Link::Tcp(link) => link
                .open(dispatch, request, deadline)
                .await
                .map(LinkStream::Tcp),
            #[cfg(feature = "engine")]
            Link::Engine(link) => link
                .open(dispatch, request, deadline)
                .await
                .map(LinkStream::Engine),
        }
    }

    fn forget(&self, instance: InstanceId) {
        match self {
            Link::Tcp(link) => link.forget(instance),
            #[cfg(feature = "engine")]
            Link::Engine(link) => link.forget(instance),
        }
    }
}
