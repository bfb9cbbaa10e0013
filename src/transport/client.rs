//! The frontend side: one multiplexed connection per worker instance.

use std::collections::HashMap;
use std::future::Future as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_core::Stream;
use futures_util::StreamExt;
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use super::error::{FrameError, RemoteError, TransportError};
use super::events::KvEventSink;
use super::feed::Feed;
use super::stream::{self, ReadHalf};
use super::wire::{self, Frame, DEFAULT_MAX_FRAME_LEN};
use super::writer::Writer;
use crate::request::{GenerateRequest, GenerateResponse};

/// Client-side limits.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Largest frame accepted or sent, in bytes (payload, without the 4-byte prefix).
    pub max_frame_len: usize,
    /// How long connecting may take.
    pub connect_timeout: Duration,
    /// Requests in flight per connection; further requests wait for a slot.
    pub max_in_flight: usize,
    /// Responses buffered per request before the connection's reader waits for the caller.
    pub stream_buffer: usize,
    /// With [`Connection::connect_with_kv_events`]: also subscribe to the worker's load
    /// reports ([`Frame::LoadSubscribe`]), delivered to the sink's
    /// [`KvEventSink::load_report`] (default true). Turn it off for a pool with workers that
    /// predate load reports: they close a connection that sends the subscription.
    pub load_reports: bool,
    /// TLS to the worker (`None`, the default: plain TCP). The handshake must finish within
    /// `connect_timeout` too; a failure is [`TransportError::Tls`].
    #[cfg(feature = "tls")]
    pub tls: Option<super::tls::ClientTls>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            connect_timeout: Duration::from_secs(5),
            max_in_flight: 1024,
            stream_buffer: 64,
            load_reports: true,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

/// What the reader task hands a pending request.
enum Event {
    Data(GenerateResponse),
    End,
    Failed(TransportError),
}

struct Pending {
    /// Why the connection closed, once it has; new requests are refused with it.
    failure: Option<TransportError>,
    streams: HashMap<u64, mpsc::Sender<Event>>,
}

/// State shared by the connection's handles and its two tasks.
struct Shared {
    addr: SocketAddr,
    config: ClientConfig,
    writer: Writer,
    pending: Mutex<Pending>,
    next_id: AtomicU64,
    slots: Arc<Semaphore>,
    /// Cancelled when the connection is finished, by either task or by the last handle.
    closed: CancellationToken,
    /// Cancelled when the worker announced a drain ([`Frame::Draining`]): no new requests.
    draining: CancellationToken,
    /// Arms the KV event feed's snapshot requests (see
    /// [`Connection::request_kv_snapshot`]); `None` without a subscription.
    kv_snapshot: Option<Arc<tokio::sync::Notify>>,
}

impl Shared {
    /// Record the failure and drop every pending sender: each stream then sees its channel
    /// close without a terminal event and reports `failure`.
    fn fail_all(&self, failure: TransportError) {
        let drained = {
            let mut pending = self.pending.lock();
            if pending.failure.is_none() {
                pending.failure = Some(failure);
            }
            std::mem::take(&mut pending.streams)
        };
        self.closed.cancel();
        drop(drained);
    }

    fn failure(&self) -> TransportError {
        self.pending
            .lock()
            .failure
            .clone()
            .unwrap_or(TransportError::Disconnected {
                reason: "connection closed".into(),
            })
    }

    /// Forget a request and tell the worker to stop it (best effort: without a runtime to send
    /// the Cancel, the worker's own deadline still ends it).
    fn cancel(&self, id: u64) {
        let was_pending = self.pending.lock().streams.remove(&id).is_some();
        if was_pending && !self.closed.is_cancelled() {
            if let Some(bytes) = wire::encode_bounded(&Frame::Cancel { id }, usize::MAX) {
                self.writer.send_detached(bytes);
            }
        }
    }
}

/// Closes the connection when the last handle (the [`Connection`] clones and the streams) goes.
struct Handle {
    shared: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.closed.cancel();
    }
}

/// A multiplexed connection to one worker. Cheap to clone; closed when the last clone and the
/// last of its response streams are dropped.
#[derive(Clone)]
pub struct Connection {
    handle: Arc<Handle>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("addr", &self.handle.shared.addr)
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl Connection {
    /// Connect to a worker at `addr` (TCP_NODELAY on; the TLS handshake when
    /// `config.tls` is set) and start the connection's reader task on the current tokio
    /// runtime.
    pub async fn connect(addr: SocketAddr, config: ClientConfig) -> Result<Self, TransportError> {
        Self::connect_inner(addr, config, None).await
    }

    /// [`connect`](Self::connect), and subscribe to the worker's KV cache event batches: they
    /// go to `sink` (decoded off the reader task, bounded; see [`KvEventSink`]) until the
    /// connection ends, which the sink hears as [`KvEventSink::closed`]. A worker that
    /// publishes no events serves the connection as usual. With
    /// [`ClientConfig::load_reports`] the worker's load reports go to the same sink
    /// ([`KvEventSink::load_report`]).
    pub async fn connect_with_kv_events(
        addr: SocketAddr,
        config: ClientConfig,
        sink: Arc<dyn KvEventSink>,
    ) -> Result<Self, TransportError> {
        Self::connect_inner(addr, config, Some(sink)).await
    }

    async fn connect_inner(
        addr: SocketAddr,
        config: ClientConfig,
        sink: Option<Arc<dyn KvEventSink>>,
    ) -> Result<Self, TransportError> {
        let stream =
            match tokio::time::timeout(config.connect_timeout, TcpStream::connect(addr)).await {
                Err(_) => return Err(TransportError::ConnectTimeout { addr }),
                Ok(Err(e)) => {
                    return Err(TransportError::Connect {
                        addr,
                        reason: e.to_string(),
                    })
                }
                Ok(Ok(s)) => s,
            };
        // Without NODELAY a small request can sit behind Nagle + delayed ACK for ~40 ms.
        stream
            .set_nodelay(true)
            .map_err(|e| TransportError::Connect {
                addr,
                reason: e.to_string(),
            })?;
        #[cfg(feature = "tls")]
        let (rd, wr) = match &config.tls {
            Some(tls) => stream::split_tls(
                tls.connect(stream, addr, config.connect_timeout)
                    .await?
                    .into(),
            ),
            None => stream::split_tcp(stream),
        };
        #[cfg(not(feature = "tls"))]
        let (rd, wr) = stream::split_tcp(stream);
        let closed = CancellationToken::new();
        let writer = Writer::new(wr, config.max_frame_len, closed.clone());
        let shared = Arc::new(Shared {
            addr,
            slots: Arc::new(Semaphore::new(config.max_in_flight.max(1))),
            config,
            writer,
            pending: Mutex::new(Pending {
                failure: None,
                streams: HashMap::new(),
            }),
            next_id: AtomicU64::new(1),
            closed,
            draining: CancellationToken::new(),
            kv_snapshot: sink.as_ref().map(|_| Arc::new(tokio::sync::Notify::new())),
        });
        let connection = Connection {
            handle: Arc::new(Handle {
                shared: Arc::clone(&shared),
            }),
        };
        let feed = match sink {
            Some(sink) => {
                // First on the wire, so the worker subscribes before it sees any request.
                let mut subscribe = vec![Frame::KvSubscribe];
                if shared.config.load_reports {
                    subscribe.push(Frame::LoadSubscribe);
                }
                for frame in &subscribe {
                    let bytes = bytes::Bytes::from(wire::encode_frame(frame));
                    if !shared.writer.send(bytes).await {
                        return Err(TransportError::Disconnected {
                            reason: "connection closed while subscribing to KV events".into(),
                        });
                    }
                }
                // After the subscribe, so a snapshot request follows it on the wire.
                let trigger = shared.kv_snapshot.clone().unwrap_or_default();
                Some(Feed::spawn(sink, Some(shared.writer.clone()), trigger))
            }
            None => None,
        };
        tokio::spawn(read_loop(rd, shared, feed));
        Ok(connection)
    }

    /// Ask the worker for a snapshot of its KV cache now, for a connection made with
    /// [`connect_with_kv_events`](Self::connect_with_kv_events) whose sink
    /// [`wants_snapshots`](KvEventSink::wants_snapshots) (otherwise nothing happens). From then
    /// on the connection also asks after every lost batch, at most once per
    /// [`KV_SNAPSHOT_RETRY`](super::KV_SNAPSHOT_RETRY). Call it once the sink applies what it
    /// gets (the dispatcher calls it when it adopts the connection), so the snapshot is not
    /// refused as coming from a connection not yet in use.
    pub fn request_kv_snapshot(&self) {
        if let Some(trigger) = &self.handle.shared.kv_snapshot {
            trigger.notify_one();
        }
    }

    /// The worker's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.handle.shared.addr
    }

    /// Whether the connection has closed (it then refuses new requests).
    pub fn is_closed(&self) -> bool {
        self.handle.shared.closed.is_cancelled()
    }

    /// Whether the worker announced it is draining ([`Frame::Draining`]): the connection then
    /// refuses new requests with [`TransportError::Draining`] (send them to another worker),
    /// while the requests already sent on it continue to their end.
    pub fn is_draining(&self) -> bool {
        self.handle.shared.draining.is_cancelled()
    }

    /// Resolves to `true` when the worker announces a drain, or `false` when the connection
    /// closes without one. Holds no handle: waiting on it does not keep the connection open.
    pub fn drain_notice(&self) -> impl std::future::Future<Output = bool> + Send + 'static {
        let draining = self.handle.shared.draining.clone();
        let closed = self.handle.shared.closed.clone();
        async move {
            tokio::select! {
                biased;
                _ = draining.cancelled() => true,
                _ = closed.cancelled() => draining.is_cancelled(),
            }
        }
    }

    /// Send `request`; its responses arrive on the returned stream. With a `deadline`, the
    /// stream fails with [`TransportError::Timeout`] once it passes and the worker is told to
    /// stop; the worker also receives the remaining budget and stops on its own.
    pub async fn generate(
        &self,
        request: GenerateRequest,
        deadline: Option<Instant>,
    ) -> Result<ResponseStream, TransportError> {
        let shared = &self.handle.shared;
        if shared.closed.is_cancelled() {
            return Err(shared.failure());
        }
        if shared.draining.is_cancelled() {
            return Err(TransportError::Draining);
        }
        let permit = Arc::clone(&shared.slots)
            .acquire_owned()
            .await
            .map_err(|_| shared.failure())?;
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let timeout_ms = deadline.map(|d| {
            let left = d.saturating_duration_since(Instant::now());
            // Rounded up: the worker's deadline (its receipt plus this) must not fall before
            // the caller's, or the worker's DeadlineExceeded would end the stream early.
            u64::try_from(left.as_nanos().div_ceil(1_000_000))
                .unwrap_or(u64::MAX)
                .max(1)
        });
        let frame = Frame::Request {
            id,
            timeout_ms,
            request,
        };
        let max = shared.config.max_frame_len;
        let bytes =
            wire::encode_bounded(&frame, max).ok_or(TransportError::RequestTooLarge { max })?;
        let (tx, rx) = mpsc::channel(shared.config.stream_buffer.max(1));
        {
            let mut pending = shared.pending.lock();
            if let Some(failure) = &pending.failure {
                return Err(failure.clone());
            }
            pending.streams.insert(id, tx);
        }
        // Checked under the write lock: the reader sets `draining` before it writes the
        // acknowledgement under the same lock, so this request is either on the wire before the
        // acknowledgement (and served) or not sent at all.
        let draining = &shared.draining;
        match shared
            .writer
            .send_unless(bytes, || draining.is_cancelled())
            .await
        {
            Some(true) => {}
            Some(false) => {
                shared.pending.lock().streams.remove(&id);
                return Err(TransportError::Draining);
            }
            None => {
                shared.pending.lock().streams.remove(&id);
                return Err(shared.failure());
            }
        }
        Ok(ResponseStream {
            conn: self.clone(),
            id,
            rx,
            deadline: deadline.map(|d| Box::pin(tokio::time::sleep_until(d))),
            open: true,
            done: false,
            _slot: permit,
        })
    }
}

async fn read_loop(rd: ReadHalf, shared: Arc<Shared>, feed: Option<Feed>) {
    let max = shared.config.max_frame_len;
    let mut frames = FramedRead::new(rd, wire::codec(max));
    let failure = loop {
        let next = tokio::select! {
            _ = shared.closed.cancelled() => break TransportError::Disconnected { reason: "connection closed".into() },
            next = frames.next() => next,
        };
        let bytes = match next {
            None => {
                break TransportError::Disconnected {
                    reason: "worker closed the connection".into(),
                }
            }
            Some(Err(e)) => match wire::classify_read_error(&e, max) {
                Some(frame_error) => break TransportError::Frame(frame_error),
                #[cfg(feature = "tls")]
                None if super::tls::is_tls_error(&e) => {
                    break TransportError::Tls {
                        addr: shared.addr,
                        reason: e.to_string(),
                    }
                }
                None => {
                    break TransportError::Disconnected {
                        reason: e.to_string(),
                    }
                }
            },
            Some(Ok(bytes)) => bytes,
        };
        let (id, event) = match wire::decode_frame(&bytes) {
            Err(e) => break TransportError::Frame(e),
            Ok(Frame::Data { id, response }) => (id, Event::Data(response)),
            Ok(Frame::End { id }) => (id, Event::End),
            Ok(Frame::Error { id, error }) => (id, Event::Failed(TransportError::Remote(error))),
            Ok(Frame::KvEvents { payload }) => {
                // Unasked-for events (no subscription) are ignored, not a protocol error.
                if let Some(feed) = &feed {
                    feed.offer(payload);
                }
                continue;
            }
            Ok(Frame::KvSnapshotChunk { seq, last, payload }) => {
                if let Some(feed) = &feed {
                    feed.offer_chunk(seq, last, payload);
                }
                continue;
            }
            Ok(Frame::KvSnapshotUnavailable) => {
                if let Some(feed) = &feed {
                    feed.offer_unavailable();
                }
                continue;
            }
            Ok(Frame::LoadReport { payload }) => {
                // Unasked-for reports are ignored too; a bad one is the sink's to count.
                if let Some(feed) = &feed {
                    feed.report(&payload);
                }
                continue;
            }
            Ok(Frame::Draining) => {
                if !shared.draining.is_cancelled() {
                    shared.draining.cancel();
                    tracing::debug!(addr = %shared.addr, "worker draining: no new requests on this connection");
                    let ack = bytes::Bytes::from(wire::encode_frame(&Frame::DrainAck));
                    // Written after `draining` is set (see `generate`); a failed write closes
                    // the connection, and the loop then ends on `closed`.
                    shared.writer.send(ack).await;
                }
                continue;
            }
            Ok(
                Frame::Request { .. }
                | Frame::Cancel { .. }
                | Frame::KvSubscribe
                | Frame::DrainAck
                | Frame::KvSnapshotRequest
                | Frame::LoadSubscribe,
            ) => {
                break TransportError::Frame(FrameError::Unexpected {
                    reason: "worker sent a client frame".into(),
                })
            }
        };
        let last = match &event {
            Event::Data(r) => r.finish.is_some(),
            Event::End | Event::Failed(_) => true,
        };
        // A frame for an unknown id belongs to a request the caller already dropped.
        let sender = if last {
            shared.pending.lock().streams.remove(&id)
        } else {
            shared.pending.lock().streams.get(&id).cloned()
        };
        if let Some(sender) = sender {
            // Waiting here applies back-pressure from a slow caller to the whole connection
            // (bounded memory); a caller that stopped reading should drop its stream.
            let _ = sender.send(event).await;
        }
    };
    if let TransportError::Frame(e) = &failure {
        tracing::warn!(addr = %shared.addr, error = %e, "closing connection: bad frame from worker");
    }
    shared.fail_all(failure);
    // The feed's task delivers what it buffered, then tells the sink the stream ended.
    drop(feed);
}

/// The responses of one request. Dropping it before the end cancels the request at the worker.
pub struct ResponseStream {
    conn: Connection,
    id: u64,
    rx: mpsc::Receiver<Event>,
    deadline: Option<Pin<Box<Sleep>>>,
    /// The worker may still send for this request (so dropping must send Cancel).
    open: bool,
    /// The stream has yielded its last item.
    done: bool,
    _slot: OwnedSemaphorePermit,
}

impl std::fmt::Debug for ResponseStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseStream")
            .field("id", &self.id)
            .field("done", &self.done)
            .finish()
    }
}

impl ResponseStream {
    /// The request id on its connection.
    pub fn request_id(&self) -> u64 {
        self.id
    }
}

impl Stream for ResponseStream {
    type Item = Result<GenerateResponse, TransportError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        // The deadline first: a worker streaming faster than the caller reads must not be
        // able to outrun it.
        if let Some(deadline) = this.deadline.as_mut() {
            if deadline.as_mut().poll(cx).is_ready() {
                this.done = true;
                this.open = false;
                this.conn.handle.shared.cancel(this.id);
                return Poll::Ready(Some(Err(TransportError::Timeout)));
            }
        }
        match this.rx.poll_recv(cx) {
            Poll::Ready(Some(Event::Data(response))) => {
                if response.finish.is_some() {
                    this.open = false;
                    this.done = true;
                }
                return Poll::Ready(Some(Ok(response)));
            }
            Poll::Ready(Some(Event::End)) => {
                this.open = false;
                this.done = true;
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Event::Failed(e))) => {
                this.open = false;
                this.done = true;
                // The worker enforces the same deadline; whichever side notices first, the
                // caller sees one error for it.
                let e = match e {
                    TransportError::Remote(RemoteError::DeadlineExceeded) => {
                        TransportError::Timeout
                    }
                    other => other,
                };
                return Poll::Ready(Some(Err(e)));
            }
            Poll::Ready(None) => {
                this.open = false;
                this.done = true;
                return Poll::Ready(Some(Err(this.conn.handle.shared.failure())));
            }
            Poll::Pending => {}
        }
        Poll::Pending
    }
}

impl Drop for ResponseStream {
    fn drop(&mut self) {
        if self.open {
            self.conn.handle.shared.cancel(self.id);
        }
    }
}
