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
    /// An engine reached over HTTP (feature `engine`) failed this request after the connection
    /// was made. Appended, like [`Tls`](Self::Tls).
    #[error("engine at {addr}: {error}")]
    Http {
        /// The engine's address.
        addr: SocketAddr,
        /// What failed.
        error: HttpError,
    },
}

/// How a request to an engine over HTTP failed once it was connected (see
/// [`TransportError::Http`]). Nothing an engine sends makes the link panic: every answer it
/// cannot use is one of these.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The engine answered with a non-2xx status; `message` is its own (`error.message` of an
    /// OpenAI-style error body, else the body's start).
    #[error("HTTP {status}: {message}")]
    Status {
        /// The HTTP status code.
        status: u16,
        /// The engine's message.
        message: String,
    },
    /// The engine's answer could not be read as the protocol says (not JSON, a missing field,
    /// a wrong type, an oversized body).
    #[error("malformed answer: {reason}")]
    Malformed {
        /// What was wrong.
        reason: String,
    },
    /// The answer ended before it was complete (a body cut short, a stream without its end).
    #[error("answer cut short: {reason}")]
    Truncated {
        /// Where it ended.
        reason: String,
    },
    /// No response head arrived within the first-byte timeout.
    #[error("no answer within {millis} ms")]
    FirstByteTimeout {
        /// The timeout, in milliseconds.
        millis: u64,
    },
    /// A streaming answer stalled: nothing arrived for the idle timeout.
    #[error("stream idle for {millis} ms")]
    IdleTimeout {
        /// The timeout, in milliseconds.
        millis: u64,
    },
}
