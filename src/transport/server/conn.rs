//! One accepted connection on the worker side: the handshake, the frame loop, the drain
//! handshake and the requests it runs.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use super::super::engine::{Engine, EngineError, EngineStream};
use super::super::error::{FrameError, RemoteError};
use super::super::events::Hub;
use super::super::reports::{PrefillWork, Reports};
use super::super::stream::{self, ReadHalf, WriteHalf};
use super::super::wire::{self, Frame};
use super::super::writer::Writer;
use super::config::ServerConfig;
use super::open::OpenCount;
use crate::request::{GenerateRequest, GenerateResponse};

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

/// The request's prefill work for the load ledger; a panicking engine counts its whole prompt.
fn prefill_work(engine: &dyn Engine, request: &GenerateRequest) -> u64 {
    std::panic::catch_unwind(AssertUnwindSafe(|| engine.prefill_work(request))).unwrap_or_else(
        |_| {
            tracing::error!("engine panicked computing a request's prefill work");
            request.token_ids.len() as u64
        },
    )
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
pub(super) async fn establish(
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
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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

pub(super) async fn serve_connection(
    (rd, wr): (ReadHalf, WriteHalf),
    peer: SocketAddr,
    engine: Arc<dyn Engine>,
    config: ServerConfig,
    (hub, reports): (Option<Arc<Hub>>, Option<Arc<Reports>>),
    (token, drain): (CancellationToken, CancellationToken),
) {
    let max = config.max_frame_len;
    // This connection's id in the load ledger (every connection's work is reported to the
    // others, subscribed or not).
    let ledger = reports.as_ref().map(|r| (Arc::clone(r), r.open()));
    let mut load_subscribed = false;
    let writer = Writer::new(wr, max, token.clone());
    let active: Arc<Mutex<HashMap<u64, CancellationToken>>> = Arc::default();
    let mut frames = FramedRead::new(rd, wire::codec(max));
    let mut subscribed = false;
    // One snapshot streams at a time per connection (a client asks for one at a time).
    let snapshotting = Arc::new(std::sync::atomic::AtomicBool::new(false));
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
                // Asked before `generate`: an engine with a cache answers what it lacks now.
                let work = ledger
                    .as_ref()
                    .map(|_| prefill_work(engine.as_ref(), &request));
                let mut stream = start(engine.as_ref(), request);
                // The prefill's cache changes are in the source now.
                if let Some(hub) = &hub {
                    hub.poke();
                }
                // Poll once here: an engine with its answer ready (a cached or one-token
                // reply) is served from this task, without spawning one per request.
                let ready = next_item(&mut stream).now_or_never();
                let first_ready = ready.is_some();
                if let Some(item) = ready {
                    let (frame, last) = to_frame(id, item);
                    if !send(&writer, frame, max).await {
                        break Closed::Shutdown;
                    }
                    if last {
                        continue;
                    }
                }
                // An answer ready at once had its prefill done: only a pending one holds work.
                let prefill = match (&ledger, work, first_ready) {
                    (Some((reports, conn)), Some(work), false) => {
                        Some(reports.start(*conn, id, work))
                    }
                    _ => None,
                };
                let request_token = token.child_token();
                active.lock().insert(id, request_token.clone());
                tokio::spawn(run_request(
                    (id, prefill),
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
            Ok(Frame::KvSnapshotRequest) => match &hub {
                Some(hub) => hub.snapshot(writer.clone(), Arc::clone(&snapshotting)),
                None => writer.send_detached(bytes::Bytes::from(wire::encode_frame(
                    &Frame::KvSnapshotUnavailable,
                ))),
            },
            Ok(Frame::LoadSubscribe) => {
                // A worker with reports off has nothing to send; a second subscribe is a no-op.
                if let Some((reports, conn)) = &ledger {
                    if !load_subscribed {
                        load_subscribed = true;
                        reports.subscribe(*conn, writer.clone(), token.clone(), max);
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
                | Frame::KvSnapshotChunk { .. }
                | Frame::KvSnapshotUnavailable
                | Frame::Draining
                | Frame::LoadReport { .. },
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
    // Its requests' work leaves the other connections' reports now, not when each task ends.
    if let Some((reports, conn)) = &ledger {
        reports.close(*conn);
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
/// `prefill` holds the request's work in the load ledger until its first item (or its end).
async fn run_request(
    (id, mut prefill): (u64, Option<PrefillWork>),
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
        // The first response, end or error: the prefill is done (before the send, so the
        // report leaves as early as the response).
        drop(prefill.take());
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
    drop(prefill);
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
