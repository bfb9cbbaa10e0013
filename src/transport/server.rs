//! The worker side: serve an [`Engine`] on a TCP listener.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::engine::Engine;
use super::events::{Hub, KvEventSource};
use super::reports::Reports;

mod config;
mod conn;
mod open;

pub use config::ServerConfig;
use conn::{establish, serve_connection};
use open::{OpenConnection, OpenCount};

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

    /// Stop gracefully: tell every connection the worker is draining (`Frame::Draining`),
    /// serve the requests its client sent before acknowledging (`Frame::DrainAck`) to their
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
/// subscribes (`Frame::KvSubscribe`, sent by
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
    let reports = config
        .load_reports
        .then(|| Reports::new(config.load_report_interval, config.load_report_refresh));
    let task = tokio::spawn(accept_loop(
        listener,
        engine,
        config,
        (hub, reports),
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
    (hub, reports): (Option<Arc<Hub>>, Option<Arc<Reports>>),
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
                let planes = (hub.clone(), reports.clone());
                let drain = drain.clone();
                tokio::spawn(async move {
                    let _open = OpenConnection(Arc::clone(&connections));
                    if let Some((rd, wr)) =
                        establish(stream, peer, &config, &token, &connections).await
                    {
                        serve_connection((rd, wr), peer, engine, config, planes, (token, drain))
                            .await;
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
