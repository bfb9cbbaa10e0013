//! KV cache events on the request plane: a worker's event batches travel to the router on
//! the same connection as its requests, as [`Frame::KvEvents`] frames.
//!
//! - Worker side: [`serve_with_kv_events`](super::serve_with_kv_events) takes batches from a
//!   [`KvEventSource`] and fans them out to every connection that sent [`Frame::KvSubscribe`]
//!   (a bounded broadcast: a connection that falls behind skips batches, and the router sees
//!   the sequence gap).
//! - Router side: [`Connection::connect_with_kv_events`](super::Connection::connect_with_kv_events)
//!   subscribes and hands each batch, decoded off the connection's reader task, to a
//!   [`KvEventSink`]. A batch that is oversize or undecodable is a [`KvStreamError`] for the
//!   sink (which drops the worker's entries), never a closed connection.
//! - Snapshots: a sink that [`wants_snapshots`](KvEventSink::wants_snapshots) gets the
//!   worker's whole cache ([`KvEventSource::kv_snapshot`], chunked as
//!   [`Frame::KvSnapshotChunk`]s) on subscribe and after a lost batch; the router side's state
//!   machine is `transport/feed.rs`.
//!
//! Why the same connection rather than a stream next to it: one socket per worker keeps one
//! lifetime for both (a reconnect of the request plane is a reconnect of the event stream, so
//! the router's "reconnect drops the entries" rule needs no second state machine), costs no
//! second port or handshake, and frames interleave under the existing length prefix.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{broadcast, Notify};
use tokio_util::sync::CancellationToken;

use super::wire::{self, Frame};
use super::writer::Writer;
use crate::kv_events::{
    decode_events, encode_events, EventBatch, EventDecodeError, KvSnapshot, SnapshotError,
    MAX_BLOCKS_PER_BATCH, MAX_EVENTS_PER_BATCH,
};
use crate::load_report::{LoadReport, LoadReportError};

/// The largest encoded v1 batch within the wire bounds: header, every event's tag, parent and
/// count, every hash. A payload longer than this is refused before decoding.
pub const MAX_KV_BATCH_BYTES: usize = 19 + MAX_EVENTS_PER_BATCH * 12 + MAX_BLOCKS_PER_BATCH * 8;

/// Encoded batches a worker keeps for its slowest subscriber; a subscriber further behind
/// skips the oldest (a sequence gap at the router).
pub const KV_BROADCAST_BATCHES: usize = 256;

/// Batches a router-side connection buffers between its reader and the sink; beyond it a
/// batch is dropped (counted as [`KvStreamError::Lagged`]) instead of stalling responses.
pub const KV_SINK_BATCHES: usize = 256;

/// How often a worker looks for events that no request start announced.
const PUMP_TICK: Duration = Duration::from_millis(5);

/// The default [`ServerConfig::kv_coalesce`](super::ServerConfig::kv_coalesce): after a
/// request start the worker waits this long before it takes the events, so that the requests
/// starting meanwhile share one batch (one frame, one wake-up on each side). It trades about
/// 2 ms of delivery latency (the timer's granularity) for a lower cost per request
/// (docs/performance.md, "KV events").
pub const KV_COALESCE: Duration = Duration::from_millis(1);

/// Where a worker's server takes its KV cache event batches from (the engine's cache, e.g.
/// `prefill_router_tools::mock::MockPrefill` built with events).
pub trait KvEventSource: Send + Sync + 'static {
    /// The batches since the last call, in order (empty when nothing changed).
    fn take_kv_events(&self) -> Vec<EventBatch>;

    /// The whole cache now, consistent with the batches handed out so far (taken under the
    /// same lock as [`take_kv_events`](Self::take_kv_events); see [`KvSnapshot`]). `None`
    /// (the default): this source takes no snapshots, and routers rely on live events alone.
    fn kv_snapshot(&self) -> Option<KvSnapshot> {
        None
    }
}

/// Why a worker's event stream lost a batch on the router side.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KvStreamError {
    /// The payload is longer than any valid batch.
    #[error("KV event batch of {len} bytes exceeds {max}")]
    Oversize {
        /// The payload's length.
        len: usize,
        /// The largest valid batch, [`MAX_KV_BATCH_BYTES`].
        max: usize,
    },
    /// The payload is not a valid v1 batch.
    #[error("undecodable KV event batch: {0}")]
    Malformed(#[from] EventDecodeError),
    /// The router fell behind: `dropped` batches were dropped before reaching the sink.
    #[error("{dropped} KV event batches dropped: the router fell behind")]
    Lagged {
        /// Batches dropped.
        dropped: u64,
    },
}

/// Where a router-side connection delivers its worker's KV event batches, in order, from one
/// task (never from the connection's reader).
pub trait KvEventSink: Send + Sync + 'static {
    /// A decoded batch.
    fn batch(&self, batch: EventBatch);
    /// A batch was lost (oversize, undecodable, or dropped for backpressure): the worker's
    /// index entries can no longer be trusted.
    fn error(&self, error: KvStreamError);
    /// The connection ended: no more batches (nor load reports) from it.
    fn closed(&self);

    /// Whether the connection should ask the worker for snapshots of its cache (on subscribe
    /// and after a lost batch) and deliver them to [`snapshot`](Self::snapshot). Default: no.
    fn wants_snapshots(&self) -> bool {
        false
    }

    /// The connection asked the worker for a snapshot.
    fn snapshot_requested(&self) {}

    /// A complete snapshot: replace the worker's entries with it. The batches that arrived
    /// while it streamed follow, delivered again through [`batch`](Self::batch) (the ones the
    /// snapshot covers are stale by the sequence rule).
    fn snapshot(&self, snapshot: KvSnapshot) {
        drop(snapshot);
    }

    /// A requested snapshot will not come (unsupported, bad chunk, lost batch, timeout):
    /// live batches alone keep feeding the worker's entries.
    fn snapshot_failed(&self, error: SnapshotError) {
        drop(error);
    }

    /// A load report from the worker (the connection subscribed with
    /// [`ClientConfig::load_reports`](super::ClientConfig::load_reports)), or why its payload
    /// was refused. Called on the connection's reader task, in order with the responses and
    /// before [`closed`](Self::closed): keep it short and non-blocking (a report is 24 bytes
    /// and absolute, so no task or queue is worth placing between). Ignored by default.
    fn load_report(&self, report: Result<LoadReport, LoadReportError>) {
        let _ = report;
    }
}

/// Check and decode one [`Frame::KvEvents`] payload (pure: the fuzz target's harness).
///
/// # Errors
/// [`KvStreamError::Oversize`] above [`MAX_KV_BATCH_BYTES`], [`KvStreamError::Malformed`] when
/// the payload is not a v1 batch.
pub fn decode_kv_payload(payload: &[u8]) -> Result<EventBatch, KvStreamError> {
    if payload.len() > MAX_KV_BATCH_BYTES {
        return Err(KvStreamError::Oversize {
            len: payload.len(),
            max: MAX_KV_BATCH_BYTES,
        });
    }
    Ok(decode_events(payload)?)
}

/// The worker side: one pump task takes batches from the source and broadcasts them encoded;
/// one task per subscribed connection writes them.
pub(crate) struct Hub {
    tx: broadcast::Sender<Bytes>,
    wake: Notify,
    source: Arc<dyn KvEventSource>,
    max_frame_len: usize,
}

impl Hub {
    /// Start the pump; it stops with `shutdown`.
    pub(crate) fn spawn(
        source: Arc<dyn KvEventSource>,
        max_frame_len: usize,
        coalesce: Duration,
        shutdown: CancellationToken,
    ) -> Arc<Hub> {
        let (tx, _) = broadcast::channel(KV_BROADCAST_BATCHES);
        let hub = Arc::new(Hub {
            tx,
            wake: Notify::new(),
            source: Arc::clone(&source),
            max_frame_len,
        });
        let pump = Arc::clone(&hub);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = pump.wake.notified() => {
                        if !coalesce.is_zero() {
                            tokio::select! {
                                _ = shutdown.cancelled() => break,
                                _ = tokio::time::sleep(coalesce) => {}
                            }
                        }
                    }
                    _ = tokio::time::sleep(PUMP_TICK) => {}
                }
                for batch in source.take_kv_events() {
                    pump.publish(&batch, max_frame_len);
                }
            }
        });
        hub
    }

    fn publish(&self, batch: &EventBatch, max_frame_len: usize) {
        let payload = match encode_events(batch) {
            Ok(payload) => payload,
            Err(e) => {
                // The next batch's sequence number shows the router the gap.
                tracing::warn!(error = %e, seq = batch.seq, "KV event batch not encodable; skipped");
                return;
            }
        };
        match wire::encode_bounded(&Frame::KvEvents { payload }, max_frame_len) {
            // No subscriber is not an error: nobody routes by this worker's events yet.
            Some(bytes) => drop(self.tx.send(bytes)),
            None => tracing::warn!(
                seq = batch.seq,
                "KV event frame over the frame limit; skipped"
            ),
        }
    }

    /// Look at the source now (a request just changed the cache).
    pub(crate) fn poke(&self) {
        self.wake.notify_one();
    }

    /// Take a snapshot of the source and send it to `writer` as chunks (or
    /// [`Frame::KvSnapshotUnavailable`]), unless one is already streaming on the connection
    /// (`busy`, one flag per connection): then the request is ignored and the client's bounded
    /// wait ends it. Call it after [`subscribe`](Self::subscribe), so every batch handed out
    /// after the snapshot reaches the connection.
    pub(crate) fn snapshot(&self, writer: Writer, busy: Arc<AtomicBool>) {
        if busy.swap(true, Ordering::AcqRel) {
            tracing::debug!("KV snapshot already streaming; request ignored");
            return;
        }
        let source = Arc::clone(&self.source);
        let max_frame_len = self.max_frame_len;
        tokio::spawn(async move {
            // Off the runtime's workers: a large cache takes milliseconds to copy and encode.
            let frames = tokio::task::spawn_blocking(move || {
                snapshot_frames(source.kv_snapshot(), max_frame_len)
            })
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "KV snapshot failed on the worker");
                snapshot_frames(None, max_frame_len)
            });
            for frame in frames {
                if !writer.send(frame).await {
                    break;
                }
            }
            busy.store(false, Ordering::Release);
        });
    }

    /// Send the batches published from now on to `writer` until `closed`.
    pub(crate) fn subscribe(&self, writer: Writer, closed: CancellationToken) {
        let mut rx = self.tx.subscribe();
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    _ = closed.cancelled() => break,
                    next = rx.recv() => next,
                };
                match next {
                    Ok(bytes) => {
                        if !writer.send(bytes).await {
                            break;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::debug!(
                            skipped = n,
                            "KV event subscriber lagged; the router sees a gap"
                        );
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                }
            }
        });
    }
}

/// The frames answering a snapshot request: the chunks of `snapshot`, or
/// [`Frame::KvSnapshotUnavailable`] without one (or if a chunk exceeds the connection's frame
/// limit, which only a limit below [`MAX_KV_BATCH_BYTES`] makes possible).
pub(crate) fn snapshot_frames(snapshot: Option<KvSnapshot>, max_frame_len: usize) -> Vec<Bytes> {
    let unavailable = || {
        wire::encode_bounded(&Frame::KvSnapshotUnavailable, max_frame_len)
            .into_iter()
            .collect()
    };
    let Some(snapshot) = snapshot else {
        return unavailable();
    };
    let chunks = snapshot.chunks();
    let count = chunks.len();
    let mut frames = Vec::with_capacity(count);
    for (i, chunk) in chunks.iter().enumerate() {
        let frame = encode_events(chunk).ok().and_then(|payload| {
            let frame = Frame::KvSnapshotChunk {
                seq: snapshot.seq,
                last: i + 1 == count,
                payload,
            };
            wire::encode_bounded(&frame, max_frame_len)
        });
        match frame {
            Some(bytes) => frames.push(bytes),
            None => {
                tracing::warn!(
                    max_frame_len,
                    "KV snapshot chunk over the frame limit; none sent"
                );
                return unavailable();
            }
        }
    }
    frames
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::KvEvent;

    #[test]
    fn the_largest_valid_batch_fits_the_payload_bound() {
        // Every event but one Stored with a parent, and all blocks in one of them.
        let mut events = vec![
            KvEvent::Stored {
                parent: Some(1),
                blocks: vec![7; 1],
            };
            MAX_EVENTS_PER_BATCH - 1
        ];
        events.push(KvEvent::Stored {
            parent: Some(2),
            blocks: vec![9; MAX_BLOCKS_PER_BATCH - (MAX_EVENTS_PER_BATCH - 1)],
        });
        let batch = EventBatch {
            epoch: u64::MAX,
            seq: u64::MAX,
            events,
        };
        let bytes = encode_events(&batch).unwrap();
        assert!(bytes.len() <= MAX_KV_BATCH_BYTES);
        assert_eq!(decode_kv_payload(&bytes), Ok(batch));
    }

    #[test]
    fn an_oversize_or_garbage_payload_is_a_typed_error() {
        let big = vec![1u8; MAX_KV_BATCH_BYTES + 1];
        assert_eq!(
            decode_kv_payload(&big),
            Err(KvStreamError::Oversize {
                len: MAX_KV_BATCH_BYTES + 1,
                max: MAX_KV_BATCH_BYTES
            })
        );
        assert!(matches!(
            decode_kv_payload(&[0xff; 40]),
            Err(KvStreamError::Malformed(_))
        ));
    }
}
