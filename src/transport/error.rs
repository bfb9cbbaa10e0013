//! Typed errors of the request plane.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// A frame that could not be accepted. The connection that carried it is closed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The length prefix announced more than the configured maximum.
    #[error("frame exceeds the maximum frame length of {max} bytes")]
    Oversized {
        /// The configured maximum, in bytes.
        max: usize,
    },
    /// The payload is not a valid frame.
    #[error("malformed frame: {reason}")]
    Malformed {
        /// What the decoder rejected.
        reason: String,
    },
    /// A valid frame that the receiving side must never get (e.g. a `Data` frame sent to a
    /// worker, or a duplicate request id).
    #[error("protocol violation: {reason}")]
    Unexpected {
        /// What was wrong.
        reason: String,
    },
}

/// A failure the worker reported for one request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// The engine failed.
    #[error("engine error: {message}")]
    Engine {
        /// The engine's message.
        message: String,
    },
    /// The worker has too many requests in flight on this connection.
    #[error("worker overloaded")]
    Overloaded,
    /// The worker stopped the request because its deadline passed.
    #[error("deadline exceeded at the worker")]
    DeadlineExceeded,
    /// A response was too large to frame.
    #[error("response exceeds the maximum frame length")]
    ResponseTooLarge,
    /// The worker is draining (stopping) and took no new request on this connection: the
    /// request was not started, so it may go to another worker. Appended: the encoding of the
    /// earlier variants is unchanged.
    #[error("worker draining: request not started")]
    Draining,
}

/// Why a request on a connection failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// Connecting to the worker failed.
    #[error("cannot connect to {addr}: {reason}")]
    Connect {
        /// The worker's address.
        addr: SocketAddr,
        /// The OS error, as text (errors fan out to many streams, so they are cloned).
        reason: String,
    },
    /// Connecting did not finish within the connect timeout.
    #[error("connecting to {addr} timed out")]
    ConnectTimeout {
        /// The worker's address.
        addr: SocketAddr,
    },
    /// The connection dropped while the request was pending (worker died or closed it).
    #[error("connection lost: {reason}")]
    Disconnected {
        /// What ended the connection.
        reason: String,
    },
    /// The peer sent a frame that could not be accepted; the connection was closed.
    #[error("bad frame from peer: {0}")]
    Frame(#[from] FrameError),
    /// The request itself is larger than the maximum frame length (the connection stays up).
    #[error("request exceeds the maximum frame length of {max} bytes")]
    RequestTooLarge {
        /// The configured maximum, in bytes.
        max: usize,
    },
    /// The worker reported a failure for this request.
    #[error("worker error: {0}")]
    Remote(#[from] RemoteError),
    /// The request's deadline passed before its stream finished.
    #[error("request deadline exceeded")]
    Timeout,
    /// The worker announced it is draining ([`Frame::Draining`](super::Frame::Draining)): this
    /// connection takes no new request (the request was not sent; send it to another worker).
    /// Its requests already in flight continue to their end.
    #[error("worker draining: connection takes no new requests")]
    Draining,
    /// TLS failed with the worker: the handshake (a certificate that does not chain to the
    /// configured CA, an expired one, a name mismatch, a worker that does not speak TLS, the
    /// handshake timeout) or a TLS alert later (with TLS 1.3, a worker refusing the client's
    /// certificate says so after the client's side of the handshake ended). Routers treat it
    /// like a refused connection. Appended, like [`Draining`](Self::Draining).
    #[error("TLS with {addr} failed: {reason}")]
    Tls {
        /// The worker's address.
        addr: SocketAddr,
        /// rustls' reason, as text.
        reason: String,
    },
}
