//! A worker listener's limits and planes.

use std::time::Duration;

use crate::transport::wire::DEFAULT_MAX_FRAME_LEN;

/// Worker-side limits.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Largest frame accepted or sent, in bytes (payload, without the 4-byte prefix).
    pub max_frame_len: usize,
    /// Requests in flight per connection; beyond it a request is refused with
    /// [`RemoteError::Overloaded`](crate::transport::RemoteError::Overloaded).
    pub max_in_flight: usize,
    /// Open connections; beyond it new connections are closed at once.
    pub max_connections: usize,
    /// With [`serve_with_kv_events`](crate::transport::serve_with_kv_events): how long the worker waits after a request start before
    /// it takes the KV events, so that requests starting meanwhile share one batch (default
    /// [`KV_COALESCE`](crate::transport::KV_COALESCE), 1 ms; zero: a batch per request start, lowest
    /// latency, highest cost per request).
    pub kv_coalesce: Duration,
    /// Publish load reports ([`Frame::LoadReport`]) to the connections that ask for them
    /// ([`Frame::LoadSubscribe`]; default true). Off, the worker keeps no ledger and ignores
    /// the subscription: its frontends count their own bookings only.
    ///
    /// [`Frame::LoadReport`]: crate::transport::Frame::LoadReport
    /// [`Frame::LoadSubscribe`]: crate::transport::Frame::LoadSubscribe
    pub load_reports: bool,
    /// Least time between two load reports on one connection (default
    /// [`LOAD_REPORT_INTERVAL`](crate::transport::LOAD_REPORT_INTERVAL), 2 ms): the changes meanwhile
    /// are sent as one report.
    pub load_report_interval: Duration,
    /// How often an unchanged load report is sent again (default
    /// [`LOAD_REPORT_REFRESH`](crate::transport::LOAD_REPORT_REFRESH), 1 s), so that a report the
    /// frontend lost or refused is healed within it.
    pub load_report_refresh: Duration,
    /// TLS for every connection (`None`, the default: plain TCP). The handshake runs on the
    /// connection's own task, bounded by [`ServerTls::handshake_timeout`], so a client that
    /// stalls in it delays no one else; a connection that fails it is closed before any frame
    /// is read, logged, and counted ([`ServerHandle::tls_handshake_failures`](crate::transport::ServerHandle::tls_handshake_failures)).
    ///
    /// [`ServerTls::handshake_timeout`]: crate::transport::ServerTls::handshake_timeout
    #[cfg(feature = "tls")]
    pub tls: Option<crate::transport::tls::ServerTls>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            max_in_flight: 1024,
            max_connections: 4096,
            kv_coalesce: crate::transport::events::KV_COALESCE,
            load_reports: true,
            load_report_interval: crate::transport::reports::LOAD_REPORT_INTERVAL,
            load_report_refresh: crate::transport::reports::LOAD_REPORT_REFRESH,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}
