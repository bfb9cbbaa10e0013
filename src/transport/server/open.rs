//! The open connections of a listener: counted while open (also when a connection's task
//! panics), with a wake-up for a drain waiting for them to close.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// The open connections, and a wake-up for a drain waiting for them to close.
#[derive(Debug, Default)]
pub(super) struct OpenCount {
    pub(super) count: AtomicUsize,
    pub(super) closed: Notify,
    /// Connections closed because their TLS handshake failed or timed out.
    #[cfg(feature = "tls")]
    pub(super) handshake_failures: std::sync::atomic::AtomicU64,
}

/// Counts an open connection until dropped (also when its task panics).
pub(super) struct OpenConnection(pub(super) Arc<OpenCount>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::AcqRel);
        self.0.closed.notify_waiters();
    }
}
