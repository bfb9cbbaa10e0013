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
//!
//! Why the same connection rather than a stream next to it: one socket per worker keeps one
//! lifetime for both (a reconnect of the request plane is a reconnect of the event stream, so
//! the router's "reconnect drops the entries" rule needs no second state machine), costs no
//! second port or handshake, and frames interleave under the existing length prefix.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{broadcast, mpsc, Notify};
use tokio_util::sync::CancellationToken;

use super::wire::{self, Frame};
use super::writer::Writer;
use crate::kv_events::{
    decode_events, encode_events, EventBatch, EventDecodeError, MAX_BLOCKS_PER_BATCH,
    MAX_EVENTS_PER_BATCH,
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

/// The router side of one connection's event stream: the reader offers payloads without
/// waiting, a task decodes them and feeds the sink. Dropping it ends the stream (the task
/// drains what is buffered, then calls [`KvEventSink::closed`]).
pub(crate) struct Feed {
    tx: mpsc::Sender<Vec<u8>>,
    dropped: Arc<std::sync::atomic::AtomicU64>,
    sink: Arc<dyn KvEventSink>,
}

impl Feed {
    /// Start the feeding task on the current runtime.
    pub(crate) fn spawn(sink: Arc<dyn KvEventSink>) -> Feed {
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(KV_SINK_BATCHES);
        let dropped = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let lagged = Arc::clone(&dropped);
        let reports = Arc::clone(&sink);
        tokio::spawn(async move {
            let report_lag = |sink: &dyn KvEventSink| {
                let n = lagged.swap(0, std::sync::atomic::Ordering::Relaxed);
                if n > 0 {
                    sink.error(KvStreamError::Lagged { dropped: n });
                }
            };
            while let Some(payload) = rx.recv().await {
                // Drops are reported no later than the next batch delivered (possibly earlier
                // than their place in the stream: an early reset is safe, a late one is not).
                report_lag(sink.as_ref());
                match decode_kv_payload(&payload) {
                    Ok(batch) => sink.batch(batch),
                    Err(e) => {
                        tracing::warn!(error = %e, "KV event batch refused");
                        sink.error(e);
                    }
                }
            }
            report_lag(sink.as_ref());
            sink.closed();
        });
        Feed {
            tx,
            dropped,
            sink: reports,
        }
    }

    /// Decode a [`Frame::LoadReport`] payload and hand it (or why it was refused) to the sink.
    pub(crate) fn report(&self, payload: &[u8]) {
        let report = LoadReport::decode(payload);
        if let Err(e) = &report {
            tracing::debug!(error = %e, "load report refused");
        }
        self.sink.load_report(report);
    }

    /// Hand a payload to the task; if its buffer is full the payload is dropped and counted.
    pub(crate) fn offer(&self, payload: Vec<u8>) {
        if self.tx.try_send(payload).is_err() {
            self.dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The worker side: one pump task takes batches from the source and broadcasts them encoded;
/// one task per subscribed connection writes them.
pub(crate) struct Hub {
    tx: broadcast::Sender<Bytes>,
    wake: Notify,
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

    /// Records what a feed delivers.
    #[derive(Default)]
    struct Recorder(parking_lot::Mutex<Vec<String>>);

    impl KvEventSink for Recorder {
        fn batch(&self, batch: EventBatch) {
            self.0.lock().push(format!("batch {}", batch.seq));
        }
        fn error(&self, error: KvStreamError) {
            self.0.lock().push(format!("error {error:?}"));
        }
        fn closed(&self) {
            self.0.lock().push("closed".into());
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_router_that_falls_behind_drops_counted_batches_and_never_blocks_the_reader() {
        let sink = Arc::new(Recorder::default());
        let feed = Feed::spawn(sink.clone());
        // The feed task cannot run before this loop yields: the queue fills, the rest drop.
        let sent = KV_SINK_BATCHES + 44;
        for seq in 0..sent as u64 {
            let batch = EventBatch {
                epoch: 1,
                seq,
                events: vec![KvEvent::Cleared],
            };
            feed.offer(encode_events(&batch).unwrap());
        }
        drop(feed);
        tokio::time::timeout(Duration::from_secs(10), async {
            while sink.0.lock().last().map(String::as_str) != Some("closed") {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the feed ends");
        let seen = sink.0.lock().clone();
        let lagged: Vec<&String> = seen.iter().filter(|e| e.starts_with("error")).collect();
        assert_eq!(lagged, vec!["error Lagged { dropped: 44 }"]);
        let batches = seen.iter().filter(|e| e.starts_with("batch")).count();
        assert_eq!(batches, KV_SINK_BATCHES);
        // The lag is reported before any batch that follows it is applied.
        assert!(seen[0].starts_with("error"), "{:?}", &seen[..2]);
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
