//! The worker side: serve an [`Engine`] on a TCP listener.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use super::engine::{Engine, EngineError, EngineStream};
use super::error::{FrameError, RemoteError};
use super::events::{Hub, KvEventSource};
use super::stream::{self, ReadHalf, WriteHalf};
use super::wire::{self, Frame, DEFAULT_MAX_FRAME_LEN};
use super::writer::Writer;
use crate::request::{GenerateRequest, GenerateResponse};

/// Worker-side limits.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Largest frame accepted or sent, in bytes (payload, without the 4-byte prefix).
    pub max_frame_len: usize,
    /// Requests in flight per connection; beyond it a request is refused with
    /// [`RemoteError::Overloaded`].
    pub max_in_flight: usize,
    /// Open connections; beyond it new connections are closed at once.
    pub max_connections: usize,
    /// With [`serve_with_kv_events`]: how long the worker waits after a request start before
    /// it takes the KV events, so that requests starting meanwhile share one batch (default
    /// [`KV_COALESCE`](super::KV_COALESCE), 1 ms; zero: a batch per request start, lowest
    /// latency, highest cost per request).
    pub kv_coalesce: Duration,
    /// TLS for every connection (`None`, the default: plain TCP). The handshake runs on the
    /// connection's own task, bounded by [`ServerTls::handshake_timeout`], so a client that
    /// stalls in it delays no one else; a connection that fails it is closed before any frame
    /// is read, logged, and counted ([`ServerHandle::tls_handshake_failures`]).
    ///
    /// [`ServerTls::handshake_timeout`]: super::ServerTls::handshake_timeout
    #[cfg(feature = "tls")]
    pub tls: Option<super::tls::ServerTls>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            max_in_flight: 1024,
            max_connections: 4096,
            kv_coalesce: super::events::KV_COALESCE,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

/// A running worker listener. Dropping it (or [`shutdown`](ServerHandle::shutdown)) stops
/// accepting and closes every connection at once, without finishing streams: to clients it
/// looks like the worker died. [`drain`](ServerHandle::drain) stops gracefully instead.
#[derive(Debug)]
pub struct ServerHandle {
    local_addr: SocketAddr,
    shutdown: CancellationToken,
    drain: CancellationToken,
    connections: Arc<OpenCount>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// How a [`ServerHandle::drain`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainReport {
    /// How long the drain took.
    pub elapsed: Duration,
    /// Connections still open when the drain timeout passed, closed then with their requests
    /// cut (0 when every connection drained in time).
    pub cut_connections: usize,
}

impl DrainReport {
    /// Whether every connection drained before the timeout (no request was cut).
    pub fn complete(&self) -> bool {
        self.cut_connections == 0
    }
}

/// The open connections, and a wake-up for a drain waiting for them to close.
#[derive(Debug, Default)]
struct OpenCount {
    count: AtomicUsize,
    closed: Notify,
    /// Connections closed because their TLS handshake failed or timed out.
    #[cfg(feature = "tls")]
    handshake_failures: std::sync::atomic::AtomicU64,
}

impl ServerHandle {
    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// How many client connections are open now.
    pub fn open_connections(&self) -> usize {
        self.connections.count.load(Ordering::Acquire)
    }

    /// How many connections failed their TLS handshake (a certificate the worker does not
    /// trust or none where one is required, a client that does not speak TLS, the handshake
    /// timeout) since the listener started.
    #[cfg(feature = "tls")]
    pub fn tls_handshake_failures(&self) -> u64 {
        self.connections.handshake_failures.load(Ordering::Relaxed)
    }

    /// Stop gracefully: tell every connection the worker is draining ([`Frame::Draining`]),
    /// serve the requests its client sent before acknowledging ([`Frame::DrainAck`]) to their
    /// end, and close each connection once acknowledged and idle. Connections accepted
    /// meanwhile are told at once (a client that had not yet heard of the stop is served, not
    /// refused). When every connection has closed, or `timeout` passed (the rest are then
    /// closed, their requests cut, and the report says how many), the listener closes.
    ///
    /// Deregister the worker from discovery first, so that no new client connects.
    pub async fn drain(mut self, timeout: Duration) -> DrainReport {
        let started = tokio::time::Instant::now();
        self.drain.cancel();
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let cut_connections = loop {
            // Registered before the check, so a close in between is not missed.
            let closed = self.connections.closed.notified();
            let open = self.connections.count.load(Ordering::Acquire);
            if open == 0 {
                break 0;
            }
            tokio::select! {
                _ = closed => {}
                _ = &mut deadline => break self.connections.count.load(Ordering::Acquire),
            }
        };
        if cut_connections > 0 {
            tracing::warn!(
                open = cut_connections,
                ?timeout,
                "drain timeout passed; closing the remaining connections"
            );
        }
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        DrainReport {
            elapsed: started.elapsed(),
            cut_connections,
        }
    }

    /// Stop accepting and close all connections (pending streams end without a final frame).
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Shut down and wait until the accept loop has exited (the listener is closed).
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Serve `engine` on `listener` until the returned handle is shut down or dropped. Must be
/// called within a tokio runtime.
pub fn serve(
    listener: TcpListener,
    engine: Arc<dyn Engine>,
    config: ServerConfig,
) -> io::Result<ServerHandle> {
    serve_inner(listener, engine, config, None)
}

/// [`serve`], and publish the KV cache event batches `events` yields to every connection that
/// subscribes ([`Frame::KvSubscribe`], sent by
/// [`Connection::connect_with_kv_events`](super::Connection::connect_with_kv_events)).
/// Connections that do not subscribe see the request plane exactly as from [`serve`].
pub fn serve_with_kv_events(
    listener: TcpListener,
    engine: Arc<dyn Engine>,
    config: ServerConfig,
    events: Arc<dyn KvEventSource>,
) -> io::Result<ServerHandle> {
    serve_inner(listener, engine, config, Some(events))
}

fn serve_inner(
    listener: TcpListener,
    engine: Arc<dyn Engine>,
    config: ServerConfig,
    events: Option<Arc<dyn KvEventSource>>,
) -> io::Result<ServerHandle> {
    let local_addr = listener.local_addr()?;
    let shutdown = CancellationToken::new();
    let drain = CancellationToken::new();
    let connections = Arc::new(OpenCount::default());
    let hub = events.map(|source| {
        Hub::spawn(
            source,
            config.max_frame_len,
            config.kv_coalesce,
            shutdown.clone(),
        )
    });
    let task = tokio::spawn(accept_loop(
        listener,
        engine,
        config,
        hub,
        (shutdown.clone(), drain.clone()),
        Arc::clone(&connections),
    ));
    Ok(ServerHandle {
        local_addr,
        shutdown,
        drain,
        connections,
        task: Some(task),
    })
}

async fn accept_loop(
    listener: TcpListener,
    engine: Arc<dyn Engine>,
    config: ServerConfig,
    hub: Option<Arc<Hub>>,
    (shutdown, drain): (CancellationToken, CancellationToken),
    connections: Arc<OpenCount>,
) {
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                if connections.count.load(Ordering::Acquire) >= config.max_connections {
                    tracing::warn!(%peer, "refusing connection: too many open");
                    continue;
                }
                connections.count.fetch_add(1, Ordering::AcqRel);
                let engine = Arc::clone(&engine);
                let config = config.clone();
                let token = shutdown.child_token();
                let connections = Arc::clone(&connections);
                let hub = hub.clone();
                let drain = drain.clone();
                tokio::spawn(async move {
                    let _open = OpenConnection(Arc::clone(&connections));
                    if let Some((rd, wr)) =
                        establish(stream, peer, &config, &token, &connections).await
                    {
                        serve_connection((rd, wr), peer, engine, config, hub, (token, drain)).await;
                    }
                });
            }
            Err(e) => {
                // Typically EMFILE: back off briefly instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Counts an open connection until dropped (also when its task panics).
struct OpenConnection(Arc<OpenCount>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::AcqRel);
        self.0.closed.notify_waiters();
    }
}

/// Start the engine; a panicking engine fails this request, not the connection.
fn start(engine: &dyn Engine, request: GenerateRequest) -> EngineStream {
    match std::panic::catch_unwind(AssertUnwindSafe(|| engine.generate(request))) {
        Ok(stream) => stream,
        Err(_) => {
            tracing::error!("engine panicked starting a request");
            Box::pin(futures_util::stream::iter([Err(EngineError::new(
                "engine panicked",
            ))]))
        }
    }
}

/// The engine stream's next item; a panic inside the engine becomes an error item (and the
/// stream is not polled again, since an error is the last frame).
async fn next_item(stream: &mut EngineStream) -> Option<Result<GenerateResponse, EngineError>> {
    match AssertUnwindSafe(stream.next()).catch_unwind().await {
        Ok(item) => item,
        Err(_) => {
            tracing::error!("engine panicked while generating");
            Some(Err(EngineError::new("engine panicked")))
        }
    }
}

/// Why a server connection closed.
enum Closed {
    Eof,
    Io(io::Error),
    Frame(FrameError),
    Shutdown,
    /// Drained: the client acknowledged the drain and its requests finished.
    Drained,
}

/// Where a connection stands in a drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DrainState {
    /// Serving as usual.
    Serving,
    /// `Draining` sent: requests the client sent before its acknowledgement are still served.
    Told,
    /// The client acknowledged: no new request is served; the connection closes when idle.
    Acknowledged,
}

/// Set up an accepted connection: TCP_NODELAY, and the TLS handshake when configured. `None`
/// when the handshake failed, timed out or the server shut down meanwhile (the connection is
/// then dropped, closing it).
async fn establish(
    stream: TcpStream,
    peer: SocketAddr,
    config: &ServerConfig,
    token: &CancellationToken,
    connections: &OpenCount,
) -> Option<(ReadHalf, WriteHalf)> {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "set_nodelay failed");
    }
    #[cfg(feature = "tls")]
    if let Some(tls) = &config.tls {
        let handshake = tokio::select! {
            _ = token.cancelled() => return None,
            handshake = tls.accept(stream) => handshake,
        };
        return match handshake {
            Ok(stream) => Some(stream::split_tls(stream.into())),
            Err(reason) => {
                connections
                    .handshake_failures
                    .fetch_add(1, Ordering::Relaxed);
                // Warn, not debug: a frontend with the wrong CA or certificate fails every
                // request it sends here, and this line is where the operator sees why.
                tracing::warn!(%peer, %reason, "closing connection: TLS handshake failed");
                None
            }
        };
    }
    // Without the feature these are used only above.
    let _ = (config, token, connections);
    Some(stream::split_tcp(stream))
}

async fn serve_connection(
    (rd, wr): (ReadHalf, WriteHalf),
    peer: SocketAddr,
    engine: Arc<dyn Engine>,
    config: ServerConfig,
    hub: Option<Arc<Hub>>,
    (token, drain): (CancellationToken, CancellationToken),
) {
    let max = config.max_frame_len;
    let writer = Writer::new(wr, max, token.clone());
    let active: Arc<Mutex<HashMap<u64, CancellationToken>>> = Arc::default();
    let mut frames = FramedRead::new(rd, wire::codec(max));
    let mut subscribed = false;
    let mut drain_state = DrainState::Serving;
    // Woken when a spawned request ends, so an acknowledged drain closes once idle.
    let finished = Arc::new(Notify::new());
    let closed = loop {
        let next = tokio::select! {
            _ = token.cancelled() => break Closed::Shutdown,
            _ = drain.cancelled(), if drain_state == DrainState::Serving => {
                drain_state = DrainState::Told;
                if !send(&writer, Frame::Draining, max).await {
                    break Closed::Shutdown;
                }
                continue;
            }
            _ = finished.notified(), if drain_state == DrainState::Acknowledged => {
                if active.lock().is_empty() {
                    break Closed::Drained;
                }
                continue;
            }
            next = frames.next() => next,
        };
        let bytes = match next {
            None => break Closed::Eof,
            Some(Err(e)) => match wire::classify_read_error(&e, max) {
                Some(frame_error) => break Closed::Frame(frame_error),
                None => break Closed::Io(e),
            },
            Some(Ok(bytes)) => bytes,
        };
        match wire::decode_frame(&bytes) {
            Err(e) => break Closed::Frame(e),
            Ok(Frame::Request {
                id,
                timeout_ms,
                request,
            }) => {
                // Decide under the lock, act after it: the guard must not live across awaits.
                let admit = {
                    let table = active.lock();
                    if table.contains_key(&id) {
                        None
                    } else if drain_state == DrainState::Acknowledged {
                        // The client said it sends nothing more: refuse, untouched.
                        Some(Err(RemoteError::Draining))
                    } else if table.len() < config.max_in_flight {
                        Some(Ok(()))
                    } else {
                        Some(Err(RemoteError::Overloaded))
                    }
                };
                match admit {
                    None => {
                        break Closed::Frame(FrameError::Unexpected {
                            reason: format!("duplicate request id {id}"),
                        })
                    }
                    Some(Err(error)) => {
                        let frame = Frame::Error { id, error };
                        if !send(&writer, frame, max).await {
                            break Closed::Shutdown;
                        }
                        continue;
                    }
                    Some(Ok(())) => {}
                }
                let mut stream = start(engine.as_ref(), request);
                // The prefill's cache changes are in the source now.
                if let Some(hub) = &hub {
                    hub.poke();
                }
                // Poll once here: an engine with its answer ready (a cached or one-token
                // reply) is served from this task, without spawning one per request.
                if let Some(item) = next_item(&mut stream).now_or_never() {
                    let (frame, last) = to_frame(id, item);
                    if !send(&writer, frame, max).await {
                        break Closed::Shutdown;
                    }
                    if last {
                        continue;
                    }
                }
                let request_token = token.child_token();
                active.lock().insert(id, request_token.clone());
                tokio::spawn(run_request(
                    id,
                    stream,
                    timeout_ms,
                    writer.clone(),
                    request_token,
                    (Arc::clone(&active), Arc::clone(&finished)),
                    max,
                ));
            }
            Ok(Frame::Cancel { id }) => {
                // Unknown ids are normal: the request may have just finished.
                if let Some(request_token) = active.lock().remove(&id) {
                    request_token.cancel();
                }
            }
            Ok(Frame::KvSubscribe) => {
                // A worker without events has nothing to send; a second subscribe is a no-op.
                if let Some(hub) = &hub {
                    if !subscribed {
                        subscribed = true;
                        hub.subscribe(writer.clone(), token.clone());
                    }
                }
            }
            Ok(Frame::DrainAck) => {
                if drain_state != DrainState::Told {
                    break Closed::Frame(FrameError::Unexpected {
                        reason: "drain acknowledged but not announced".into(),
                    });
                }
                drain_state = DrainState::Acknowledged;
                tracing::debug!(%peer, in_flight = active.lock().len(), "client acknowledged the drain");
                if active.lock().is_empty() {
                    break Closed::Drained;
                }
            }
            Ok(
                Frame::Data { .. }
                | Frame::End { .. }
                | Frame::Error { .. }
                | Frame::KvEvents { .. }
                | Frame::Draining,
            ) => {
                break Closed::Frame(FrameError::Unexpected {
                    reason: "client sent a worker frame".into(),
                })
            }
        }
    };
    match closed {
        Closed::Eof | Closed::Shutdown => tracing::debug!(%peer, "connection closed"),
        Closed::Drained => tracing::debug!(%peer, "connection drained"),
        Closed::Io(e) => tracing::debug!(%peer, error = %e, "connection lost"),
        Closed::Frame(e) => {
            tracing::warn!(%peer, error = %e, "closing connection: bad frame from client")
        }
    }
    // Stops the writer and every request of this connection (their engine streams drop).
    token.cancel();
}

/// Turn an engine item (or the end of its stream) into a frame; true if it is the last one.
fn to_frame(id: u64, item: Option<Result<GenerateResponse, EngineError>>) -> (Frame, bool) {
    match item {
        None => (Frame::End { id }, true),
        Some(Ok(response)) => {
            let last = response.finish.is_some();
            (Frame::Data { id, response }, last)
        }
        Some(Err(e)) => (
            Frame::Error {
                id,
                error: RemoteError::Engine { message: e.message },
            },
            true,
        ),
    }
}

/// Drive one request's engine stream to the end, a cancel, the deadline, or connection close.
async fn run_request(
    id: u64,
    mut stream: EngineStream,
    timeout_ms: Option<u64>,
    writer: Writer,
    token: CancellationToken,
    (active, finished): (Arc<Mutex<HashMap<u64, CancellationToken>>>, Arc<Notify>),
    max: usize,
) {
    let deadline = tokio::time::sleep(timeout_ms.map_or(
        Duration::from_secs(u64::from(u32::MAX)),
        Duration::from_millis,
    ));
    tokio::pin!(deadline);
    loop {
        let item = tokio::select! {
            biased;
            _ = token.cancelled() => break,
            _ = &mut deadline => {
                let frame = Frame::Error { id, error: RemoteError::DeadlineExceeded };
                send(&writer, frame, max).await;
                break;
            }
            item = next_item(&mut stream) => item,
        };
        let (frame, last) = to_frame(id, item);
        let sent = tokio::select! {
            _ = token.cancelled() => false,
            sent = send(&writer, frame, max) => sent,
        };
        if !sent || last {
            break;
        }
    }
    // Generation stops here (the engine stream is dropped) whatever ended the loop.
    drop(stream);
    active.lock().remove(&id);
    // A permit is stored if the connection is not waiting now: it re-checks at its next wait.
    finished.notify_one();
}

/// Send a frame, replacing a response too large to frame by an error; false when the
/// connection is finished.
async fn send(writer: &Writer, frame: Frame, max: usize) -> bool {
    let id = frame.request_id().unwrap_or_default();
    let bytes = match wire::encode_bounded(&frame, max) {
        Some(bytes) => bytes,
        None => {
            let error = Frame::Error {
                id,
                error: RemoteError::ResponseTooLarge,
            };
            match wire::encode_bounded(&error, max) {
                Some(bytes) => bytes,
                None => return false,
            }
        }
    };
    writer.send(bytes).await
}
