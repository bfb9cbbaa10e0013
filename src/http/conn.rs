//! The frontend's connections: the accept loop with its connection cap, each connection's
//! timeouts (header read, idle keep-alive, and the request deadline as a last resort for a
//! client that stops reading), and the ordered shutdown (drain delay, graceful drain up to a
//! bound, then close what is left).
//!
//! Each connection is served by hyper's HTTP/1.1 connection (no timer of hyper's own is set);
//! a watchdog beside it knows the connection's phase from two taps, the socket's reads and the
//! service's calls and response bodies, and closes it (drops the connection future, which drops
//! any handler still running) when the phase's deadline passes.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, Response};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::state::{App, DropReason, HttpConfig};

/// When a request began: its first byte on the connection (set by the connection layer, read
/// by the handlers so the request deadline covers the headers and the body too).
#[derive(Clone, Copy, Debug)]
pub(super) struct RequestStart(pub(super) Instant);

/// After the request deadline, how long the connection layer waits for the handler's own
/// answer (a 504, or an error event) before it closes the connection itself.
const DEADLINE_GRACE: Duration = Duration::from_secs(1);

/// How a shutdown ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServeSummary {
    /// Connections still open at the end of the shutdown bound, closed then (their requests,
    /// if any, were cut off).
    pub closed_at_bound: usize,
}

/// Where a connection is.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// Waiting for a request: since the accept (`fresh`) or the end of the previous response;
    /// `first_byte` once part of the next request arrived.
    Waiting {
        since: Instant,
        fresh: bool,
        first_byte: Option<Instant>,
    },
    /// A request (`ticket`) is being answered since `start`.
    Busy { start: Instant, ticket: u64 },
}

/// The per-connection timeouts.
#[derive(Clone, Copy, Debug)]
struct Limits {
    header: Duration,
    idle: Duration,
    request: Duration,
}

/// A connection's phase, shared by its socket tap, its service and its watchdog.
struct ConnState {
    phase: Mutex<Phase>,
    next_ticket: std::sync::atomic::AtomicU64,
    changed: Notify,
}

impl ConnState {
    fn new() -> Self {
        ConnState {
            phase: Mutex::new(Phase::Waiting {
                since: Instant::now(),
                fresh: true,
                first_byte: None,
            }),
            next_ticket: std::sync::atomic::AtomicU64::new(0),
            changed: Notify::new(),
        }
    }

    fn phase(&self) -> MutexGuard<'_, Phase> {
        // A panic while holding it cannot leave a phase half-written (plain copies).
        self.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes arrived: the first of a request starts its header timer.
    fn on_read(&self) {
        let mut phase = self.phase();
        if let Phase::Waiting {
            first_byte: first @ None,
            ..
        } = &mut *phase
        {
            *first = Some(Instant::now());
            drop(phase);
            self.changed.notify_one();
        }
    }

    /// A request's headers are complete: it is being answered. Its ticket and start.
    fn begin(&self) -> (u64, Instant) {
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let mut phase = self.phase();
        let start = match *phase {
            Phase::Waiting {
                first_byte: Some(at),
                ..
            } => at,
            _ => Instant::now(),
        };
        *phase = Phase::Busy { start, ticket };
        drop(phase);
        self.changed.notify_one();
        (ticket, start)
    }

    /// Request `ticket`'s response ended (or was dropped): the connection waits for the next.
    fn end(&self, ticket: u64) {
        let mut phase = self.phase();
        if matches!(*phase, Phase::Busy { ticket: t, .. } if t == ticket) {
            *phase = Phase::Waiting {
                since: Instant::now(),
                fresh: false,
                first_byte: None,
            };
            drop(phase);
            self.changed.notify_one();
        }
    }

    /// When the current phase ends the connection, and why.
    fn deadline(&self, limits: Limits) -> (Instant, DropReason) {
        match *self.phase() {
            Phase::Waiting {
                first_byte: Some(at),
                ..
            } => (at + limits.header, DropReason::HeaderTimeout),
            Phase::Waiting {
                since, fresh: true, ..
            } => (since + limits.header, DropReason::HeaderTimeout),
            Phase::Waiting { since, .. } => (since + limits.idle, DropReason::IdleTimeout),
            Phase::Busy { start, .. } => (
                start + limits.request + DEADLINE_GRACE,
                DropReason::RequestTimeout,
            ),
        }
    }
}

/// The socket, tapped: reads tell the connection's state that bytes arrived.
struct Tapped {
    io: TcpStream,
    state: Arc<ConnState>,
}

impl AsyncRead for Tapped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.state.on_read();
        }
        polled
    }
}

impl AsyncWrite for Tapped {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Ends a request's busy phase when its response body ends or is dropped.
struct Ticket {
    state: Arc<ConnState>,
    ticket: u64,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.state.end(self.ticket);
    }
}

/// A response body that ends its request's busy phase when dropped (hyper drops it once
/// written, or when the connection closes).
struct TrackedBody {
    body: Body,
    _ticket: Ticket,
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The router as a hyper service, telling the connection's state when requests begin and end.
#[derive(Clone)]
struct Tracked {
    inner: TowerToHyperService<axum::Router>,
    state: Arc<ConnState>,
}

type ServiceFuture =
    Pin<Box<dyn Future<Output = Result<Response<TrackedBody>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for Tracked {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = ServiceFuture;

    fn call(&self, mut request: Request<Incoming>) -> Self::Future {
        let (ticket, start) = self.state.begin();
        request.extensions_mut().insert(RequestStart(start));
        let ticket = Ticket {
            state: Arc::clone(&self.state),
            ticket,
        };
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|body| TrackedBody {
                body,
                _ticket: ticket,
            }))
        })
    }
}

/// Where the server is in its shutdown (broadcast to every connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Serving,
    /// Finish the request in progress, take no more (hyper's graceful shutdown).
    Drain,
    /// The shutdown bound passed: close now.
    Close,
}

/// One connection in the open-connections gauge, holding its slot under the cap.
struct Slot {
    app: App,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.app.metrics().connections.dec();
    }
}

async fn connection(
    tcp: TcpStream,
    app: App,
    router: axum::Router,
    limits: Limits,
    mut stage: watch::Receiver<Stage>,
    slot: Slot,
    closed_at_bound: Arc<AtomicUsize>,
) {
    let state = Arc::new(ConnState::new());
    let io = TokioIo::new(Tapped {
        io: tcp,
        state: Arc::clone(&state),
    });
    let service = Tracked {
        inner: TowerToHyperService::new(router),
        state: Arc::clone(&state),
    };
    // hyper's own header timer stays off (it would need hyper's timer and counts idle time
    // as header time); the watchdog below keeps the timeouts.
    let conn = hyper::server::conn::http1::Builder::new()
        .header_read_timeout(None)
        .serve_connection(io, service);
    let mut conn = std::pin::pin!(conn);
    let mut graceful = false;
    if *stage.borrow_and_update() != Stage::Serving {
        conn.as_mut().graceful_shutdown();
        graceful = true;
    }
    loop {
        let changed = state.changed.notified();
        let (deadline, reason) = state.deadline(limits);
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "HTTP connection ended with an error");
                }
                break;
            }
            _ = changed => {}
            seen = stage.changed() => {
                let now = match seen {
                    Ok(()) => *stage.borrow_and_update(),
                    // The server is gone: nothing will answer.
                    Err(_) => Stage::Close,
                };
                match now {
                    Stage::Serving => {}
                    Stage::Drain => {
                        if !graceful {
                            conn.as_mut().graceful_shutdown();
                            graceful = true;
                        }
                    }
                    Stage::Close => {
                        closed_at_bound.fetch_add(1, Ordering::Relaxed);
                        app.metrics().dropped(DropReason::Shutdown);
                        break;
                    }
                }
            }
            () = tokio::time::sleep_until(deadline) => {
                // The phase may have moved on while the timer fired.
                if state.deadline(limits).0 <= Instant::now() {
                    tracing::debug!(reason = reason.label(), "closing an HTTP connection");
                    app.metrics().dropped(reason);
                    break;
                }
            }
        }
    }
    drop(slot);
}

/// What ends an accept phase.
type Stop = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Accept connections until `stop` completes, holding one permit of `cap` per connection (so
/// over the cap new connections wait in the listen backlog until one closes).
#[allow(clippy::too_many_arguments)]
async fn accept_until(
    listener: &TcpListener,
    stop: Stop,
    cap: &Arc<Semaphore>,
    app: &App,
    router: &axum::Router,
    limits: Limits,
    stage: &watch::Receiver<Stage>,
    tracker: &TaskTracker,
    closed_at_bound: &Arc<AtomicUsize>,
) {
    let mut stop = stop;
    loop {
        let permit = tokio::select! {
            () = &mut stop => return,
            permit = Arc::clone(cap).acquire_owned() => match permit {
                Ok(permit) => permit,
                // Never closed; if it were, nothing more could be accepted.
                Err(_) => return,
            },
        };
        let tcp = tokio::select! {
            () = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _peer)) => tcp,
                Err(error) => {
                    accept_error(&error).await;
                    continue;
                }
            },
        };
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "setting TCP_NODELAY");
        }
        app.metrics().connections.inc();
        let slot = Slot {
            app: app.clone(),
            _permit: permit,
        };
        tracker.spawn(connection(
            tcp,
            app.clone(),
            router.clone(),
            limits,
            stage.clone(),
            slot,
            Arc::clone(closed_at_bound),
        ));
    }
}

/// After a failed accept: a per-connection error (the peer reset before we accepted) is
/// skipped; anything else (out of file descriptors, ...) is logged and retried after a pause.
async fn accept_error(error: &std::io::Error) {
    use std::io::ErrorKind;
    if matches!(
        error.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(%error, "accepting an HTTP connection; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// The server loop behind [`serve`](super::serve): accept until `shutdown`, then the drain
/// delay (still accepting, `/ready` 503), then drain up to the shutdown bound, then close.
pub(super) async fn run(
    listener: TcpListener,
    app: App,
    router: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> ServeSummary {
    let config: HttpConfig = app.config().clone();
    let limits = Limits {
        header: config.header_timeout,
        idle: config.idle_timeout,
        request: config.request_timeout,
    };
    let cap = Arc::new(Semaphore::new(config.max_connections.max(1)));
    let (stage_tx, stage_rx) = watch::channel(Stage::Serving);
    let tracker = TaskTracker::new();
    let closed_at_bound = Arc::new(AtomicUsize::new(0));
    let accept = |stop: Stop| {
        accept_until(
            &listener,
            stop,
            &cap,
            &app,
            &router,
            limits,
            &stage_rx,
            &tracker,
            &closed_at_bound,
        )
    };
    accept(Box::pin(shutdown)).await;
    app.start_draining();
    tracing::info!(
        drain_delay_ms = config.drain_delay.as_millis() as u64,
        "shutting down: /ready answers 503; still serving during the drain delay"
    );
    accept(Box::pin(tokio::time::sleep(config.drain_delay))).await;
    drop(listener);
    let _ = stage_tx.send(Stage::Drain);
    tracker.close();
    tracing::info!(
        connections = tracker.len(),
        bound_ms = config.shutdown_timeout.as_millis() as u64,
        "stopped accepting; draining in-flight requests"
    );
    if tokio::time::timeout(config.shutdown_timeout, tracker.wait())
        .await
        .is_err()
    {
        let open = tracker.len();
        app.start_closing();
        let _ = stage_tx.send(Stage::Close);
        // Each connection closes at its next poll; bounded all the same.
        if tokio::time::timeout(Duration::from_secs(1), tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!("connections still closing after the shutdown bound; leaving them");
        }
        tracing::warn!(
            connections = open,
            bound_ms = config.shutdown_timeout.as_millis() as u64,
            "shutdown bound passed: closed the connections still open (their requests were cut off)"
        );
    }
    ServeSummary {
        closed_at_bound: closed_at_bound.load(Ordering::Relaxed),
    }
}

#[cfg(test)]
mod tests;
