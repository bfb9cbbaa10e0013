//! The worker-health adapter: classifies request failures for the pure
//! [`health::Machine`](crate::health::Machine) and carries out its timers and probes on tokio.
//!
//! Thin on purpose, like the lifecycle's driver: every decision (when to open, how long to
//! wait, when to close) is the machine's; this file only turns its actions into sleeps, TCP
//! connects and log lines, and feeds their outcomes back.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::discovery::InstanceId;
use crate::health::{Action, FailureClass, Input, ProbeId, TimerId};
use crate::transport::{HttpError, RemoteError, TransportError};

/// How long a probe's TCP connect may take; a timeout is a failed probe. Bounded so a probe of
/// a black-holed address ends and the backoff continues.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// How the view checks an instance whose breaker is open: given its id and current address,
/// resolve to whether it answered. The default ([`Prober::tcp`]) is a TCP connect bounded by
/// [`PROBE_TIMEOUT`]; a custom one (a request-plane ping, or the simulator's world) may do
/// anything, but should end in bounded time: the breaker waits for it.
#[derive(Clone)]
pub struct Prober(Arc<ProbeFn>);

type ProbeFn =
    dyn Fn(InstanceId, SocketAddr) -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync;

impl Prober {
    /// A prober from a function returning the probe's future.
    pub fn new<F, Fut>(probe: F) -> Self
    where
        F: Fn(InstanceId, SocketAddr) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = bool> + Send + 'static,
    {
        Prober(Arc::new(move |id, addr| Box::pin(probe(id, addr))))
    }

    /// A TCP connect to the instance's address; a refusal or a timeout of [`PROBE_TIMEOUT`]
    /// is a failed probe.
    pub fn tcp() -> Self {
        Prober::new(|_, addr| async move {
            matches!(
                tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(addr)).await,
                Ok(Ok(_))
            )
        })
    }
}

impl Default for Prober {
    fn default() -> Self {
        Prober::tcp()
    }
}

impl std::fmt::Debug for Prober {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Prober")
    }
}

/// What a request-plane failure says about the worker's health: connection-level failures
/// (refused, reset, a dead stream, garbage on the wire) count against it; a request the worker
/// rejected, a deadline and overload do not, so a poisoned request or a load spike cannot empty
/// the routable set.
pub fn failure_class(error: &TransportError) -> FailureClass {
    match error {
        // A worker whose certificate the frontend cannot trust (or that refuses the frontend's)
        // is unreachable to this frontend, as if it refused the connection.
        TransportError::Connect { .. }
        | TransportError::ConnectTimeout { .. }
        | TransportError::Tls { .. } => FailureClass::ConnectionRefused,
        TransportError::Disconnected { .. } => FailureClass::ConnectionReset,
        // The peer broke the framing: the connection is closed and the worker is not speaking
        // the protocol, which is as dead as a dropped stream for routing purposes.
        TransportError::Frame(_) => FailureClass::StreamDead,
        TransportError::RequestTooLarge { .. } => FailureClass::Rejected,
        TransportError::Timeout => FailureClass::Deadline,
        // A draining worker is alive and finishing its work; the request was not started, so
        // it goes elsewhere like an overloaded worker's, and no breaker opens. (Dispatchers
        // avoid draining workers: this is the rare request that raced the announcement.)
        TransportError::Draining => FailureClass::Overloaded,
        TransportError::Http { error, .. } => match error {
            // Busy or going away: alive, another engine may take it.
            HttpError::Status {
                status: 429 | 503, ..
            } => FailureClass::Overloaded,
            // The engine answered: it is alive, the request is what failed (a 400, or a 500
            // such as vLLM's failed KV pull, after which the engine stays healthy).
            HttpError::Status { .. } => FailureClass::Rejected,
            // Not speaking the protocol, cut off or stalled: as dead as a dropped stream.
            HttpError::Malformed { .. }
            | HttpError::Truncated { .. }
            | HttpError::FirstByteTimeout { .. }
            | HttpError::IdleTimeout { .. } => FailureClass::StreamDead,
        },
        TransportError::Remote(remote) => match remote {
            RemoteError::Overloaded | RemoteError::Draining => FailureClass::Overloaded,
            RemoteError::DeadlineExceeded => FailureClass::Deadline,
            // The worker answered: it is alive, the request is what failed.
            RemoteError::Engine { .. } | RemoteError::ResponseTooLarge => FailureClass::Rejected,
        },
    }
}

/// Where the adapter sends the outcome of a timer or a probe: the view, if it still exists.
pub(super) trait Feed: Send + Sync + 'static {
    /// Feed one input to the machine and carry out its actions.
    fn feed(&self, input: Input<InstanceId>);
}

/// The I/O side of the machine: one cancellation token per instance with pending timers or
/// probes, all children of the view's token, so dropping the view or a `Removed` stops them.
#[derive(Debug)]
pub(super) struct Tasks {
    root: CancellationToken,
    per_instance: HashMap<InstanceId, CancellationToken>,
    prober: Prober,
}

impl Tasks {
    pub(super) fn new(root: CancellationToken, prober: Prober) -> Self {
        Tasks {
            root,
            per_instance: HashMap::new(),
            prober,
        }
    }

    /// Stop every timer and probe of `instance` (it left discovery).
    pub(super) fn forget(&mut self, instance: InstanceId) {
        if let Some(token) = self.per_instance.remove(&instance) {
            token.cancel();
        }
    }

    fn token(&mut self, instance: InstanceId) -> CancellationToken {
        self.per_instance
            .entry(instance)
            .or_insert_with(|| self.root.child_token())
            .clone()
    }

    /// Carry out one action. `address` is the instance's current address (for probes);
    /// `feed` receives timer firings and probe results. Must run within a tokio runtime when
    /// the action is a timer or a probe.
    pub(super) fn run<F: Feed>(
        &mut self,
        action: Action<InstanceId>,
        address: Option<SocketAddr>,
        feed: F,
    ) {
        match action {
            Action::Open { instance } => {
                tracing::warn!(instance, "worker breaker opened after a connection failure");
            }
            Action::Close { instance } => {
                tracing::info!(instance, "worker breaker closed: the probe connected");
            }
            Action::ArmTimer {
                instance,
                timer,
                delay,
                attempt,
            } => {
                tracing::debug!(instance, %timer, ?delay, attempt, "probe scheduled");
                let token = self.token(instance);
                tokio::spawn(fire(token, instance, timer, delay, feed));
            }
            // The machine only cancels a timer when the instance leaves discovery.
            Action::CancelTimer { instance, .. } => self.forget(instance),
            Action::StartProbe { instance, probe } => {
                let token = self.token(instance);
                let check = address.map(|addr| (self.prober.0)(instance, addr));
                tokio::spawn(probe_task(token, instance, probe, check, feed));
            }
        }
    }
}

async fn fire<F: Feed>(
    token: CancellationToken,
    instance: InstanceId,
    timer: TimerId,
    delay: Duration,
    feed: F,
) {
    tokio::select! {
        _ = token.cancelled() => {}
        _ = tokio::time::sleep(delay) => feed.feed(Input::TimerFired { instance, timer }),
    }
}

async fn probe_task<F: Feed>(
    token: CancellationToken,
    instance: InstanceId,
    probe: ProbeId,
    check: Option<Pin<Box<dyn Future<Output = bool> + Send>>>,
    feed: F,
) {
    let ok = match check {
        None => false,
        Some(check) => {
            tokio::select! {
                // Cancelled: the instance left discovery, the machine ignores its probe.
                _ = token.cancelled() => return,
                ok = check => ok,
            }
        }
    };
    feed.feed(Input::ProbeResult {
        instance,
        probe,
        ok,
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::FrameError;

    fn addr() -> SocketAddr {
        "127.0.0.1:1".parse().expect("addr")
    }

    #[test]
    fn a_refused_connect_counts() {
        let e = TransportError::Connect {
            addr: addr(),
            reason: "refused".into(),
        };
        assert_eq!(failure_class(&e), FailureClass::ConnectionRefused);
        let e = TransportError::ConnectTimeout { addr: addr() };
        assert_eq!(failure_class(&e), FailureClass::ConnectionRefused);
        assert!(failure_class(&e).counts_against_health());
        // A worker this frontend cannot do TLS with is as unreachable as one refusing TCP.
        let e = TransportError::Tls {
            addr: addr(),
            reason: "invalid peer certificate: UnknownIssuer".into(),
        };
        assert_eq!(failure_class(&e), FailureClass::ConnectionRefused);
    }

    #[test]
    fn a_reset_connection_counts() {
        let e = TransportError::Disconnected {
            reason: "reset".into(),
        };
        assert_eq!(failure_class(&e), FailureClass::ConnectionReset);
        assert!(failure_class(&e).counts_against_health());
    }

    #[test]
    fn a_broken_stream_counts() {
        let e = TransportError::Frame(FrameError::Malformed {
            reason: "garbage".into(),
        });
        assert_eq!(failure_class(&e), FailureClass::StreamDead);
        assert!(failure_class(&e).counts_against_health());
    }

    #[test]
    fn a_rejected_request_does_not_count() {
        for e in [
            TransportError::RequestTooLarge { max: 1 },
            TransportError::Remote(RemoteError::Engine {
                message: "bad prompt".into(),
            }),
            TransportError::Remote(RemoteError::ResponseTooLarge),
        ] {
            assert_eq!(failure_class(&e), FailureClass::Rejected, "{e}");
            assert!(!failure_class(&e).counts_against_health());
        }
    }

    #[test]
    fn a_deadline_does_not_count() {
        for e in [
            TransportError::Timeout,
            TransportError::Remote(RemoteError::DeadlineExceeded),
        ] {
            assert_eq!(failure_class(&e), FailureClass::Deadline, "{e}");
            assert!(!failure_class(&e).counts_against_health());
        }
    }

    #[test]
    fn overload_does_not_count() {
        let e = TransportError::Remote(RemoteError::Overloaded);
        assert_eq!(failure_class(&e), FailureClass::Overloaded);
        assert!(!failure_class(&e).counts_against_health());
    }
}
