//! A connection's shared write half.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::SinkExt;
use tokio::sync::Mutex;
use tokio_util::codec::{FramedWrite, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

use super::stream::WriteHalf;
use super::wire;

/// The write half of a connection, shared by every task that sends on it. Senders take turns
/// and write their own frame: no writer task (and no extra wake-up) sits between a request and
/// the socket, which is most of the cost of a small round trip on loopback.
#[derive(Clone)]
pub(crate) struct Writer {
    sink: Arc<Mutex<FramedWrite<WriteHalf, LengthDelimitedCodec>>>,
    closed: CancellationToken,
}

impl Writer {
    pub(crate) fn new(wr: WriteHalf, max_frame_len: usize, closed: CancellationToken) -> Self {
        Writer {
            sink: Arc::new(Mutex::new(FramedWrite::new(wr, wire::codec(max_frame_len)))),
            closed,
        }
    }

    /// Write and flush one frame payload. False if the connection is closed; a failed write
    /// closes it. If this future is dropped mid-write, the bytes stay in the sink's buffer and
    /// the next sender's flush completes them, so the byte stream never tears.
    pub(crate) async fn send(&self, bytes: Bytes) -> bool {
        let write = async {
            let mut sink = self.sink.lock().await;
            sink.send(bytes).await
        };
        tokio::select! {
            _ = self.closed.cancelled() => false,
            written = write => match written {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!(error = %e, "write failed; closing connection");
                    self.closed.cancel();
                    false
                }
            },
        }
    }

    /// [`send`](Self::send), unless `refuse` holds once the write lock is taken: then
    /// nothing is written. `Some(true)` when written, `Some(false)` when refused, `None` when
    /// the connection is closed.
    pub(crate) async fn send_unless(
        &self,
        bytes: Bytes,
        refuse: impl FnOnce() -> bool,
    ) -> Option<bool> {
        let write = async {
            let mut sink = self.sink.lock().await;
            if refuse() {
                return Ok(false);
            }
            sink.send(bytes).await.map(|()| true)
        };
        tokio::select! {
            _ = self.closed.cancelled() => None,
            written = write => match written {
                Ok(sent) => Some(sent),
                Err(e) => {
                    tracing::debug!(error = %e, "write failed; closing connection");
                    self.closed.cancel();
                    None
                }
            },
        }
    }

    /// Send from a context that cannot wait (a `Drop`): on a spawned task, if a runtime is
    /// there to run it.
    pub(crate) fn send_detached(&self, bytes: Bytes) {
        if self.closed.is_cancelled() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let writer = self.clone();
                runtime.spawn(async move {
                    writer.send(bytes).await;
                });
            }
            Err(_) => tracing::debug!("no runtime to send a frame from drop; dropped"),
        }
    }
}
