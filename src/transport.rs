//! The request plane: a worker serves an [`Engine`] on a TCP listener; a frontend opens one
//! multiplexed connection per instance and streams responses back.
//!
//! Wire format (see `docs/transport.md`): each frame is a big-endian `u32` length followed by a
//! postcard-encoded [`Frame`]; frames longer than the configured maximum close the connection.
//! Requests carry a connection-local id; responses are routed back by that id, so one socket
//! carries many concurrent requests. Dropping a response stream sends [`Frame::Cancel`], and the
//! worker then drops its engine stream (generation stops).
//!
//! With feature `tls`, the connection can run over TLS (`ServerConfig::tls`,
//! `ClientConfig::tls`; see `ServerTls` and `ClientTls`), mutual TLS optionally; off (plain
//! TCP) unless configured.

mod client;
mod engine;
mod error;
mod events;
mod feed;
mod reports;
mod server;
mod stream;
#[cfg(feature = "tls")]
mod tls;
mod wire;
mod writer;

pub use client::{ClientConfig, Connection, ResponseStream};
pub use engine::{Engine, EngineError, EngineStream};
pub use error::{FrameError, HttpError, RemoteError, TransportError};
pub use events::{
    decode_kv_payload, KvEventSink, KvEventSource, KvStreamError, KV_BROADCAST_BATCHES,
    KV_COALESCE, KV_SINK_BATCHES, MAX_KV_BATCH_BYTES,
};
pub use feed::{KV_SNAPSHOT_BUFFER_BATCHES, KV_SNAPSHOT_RETRY, KV_SNAPSHOT_TIMEOUT};
pub use reports::{LOAD_REPORT_INTERVAL, LOAD_REPORT_REFRESH};
pub use server::{serve, serve_with_kv_events, DrainReport, ServerConfig, ServerHandle};
#[cfg(feature = "tls")]
pub use tls::{ClientTls, ServerTls, TlsError, TlsIdentity, TlsRoots, DEFAULT_HANDSHAKE_TIMEOUT};
/// The rustls crate the TLS types are built on (for [`ServerTls::from_rustls`] and
/// [`ClientTls::from_rustls`], and the DER types of [`TlsIdentity::from_der`]).
#[cfg(feature = "tls")]
pub use tokio_rustls::rustls;
pub use wire::{decode_frame, encode_frame, Frame, DEFAULT_MAX_FRAME_LEN};
