//! The router side of one connection's KV event stream: the reader offers payloads without
//! waiting, one task decodes them and feeds the sink, and (for a sink that wants them) asks the
//! worker for snapshots and reassembles them.
//!
//! **Snapshot rule** (per connection): a snapshot is wanted once the connection's owner arms
//! it ([`Connection::request_kv_snapshot`](super::Connection::request_kv_snapshot), the
//! dispatcher does when it adopts a new connection, right after the subscribe) and after every
//! lost batch from then on (a sequence gap, a refused or dropped batch). A request goes out when one is wanted,
//! none is outstanding, and [`KV_SNAPSHOT_RETRY`] has passed since the previous request (no
//! storm, whatever the stream does). While it streams, live batches are delivered as before
//! and also kept (at most [`KV_SNAPSHOT_BUFFER_BATCHES`]); when its last chunk is in, the sink
//! gets the snapshot, then the kept batches again, which the index's sequence rule applies
//! after it or ignores as covered. A lost batch, a full buffer, a bad chunk or
//! [`KV_SNAPSHOT_TIMEOUT`] fails it: the sink keeps what live batches give (today's
//! behaviour: a gap drops the worker's entries), the rest of its chunks are discarded, and a
//! new request follows at the next allowed time. A worker that answers
//! [`Frame::KvSnapshotUnavailable`] is not asked again on this connection.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use super::events::{decode_kv_payload, KvEventSink, KvStreamError, KV_SINK_BATCHES};
use super::wire::{self, Frame};
use super::writer::Writer;
use crate::kv_events::{
    EventBatch, SnapshotAssembler, SnapshotError, DEFAULT_MAX_BLOCKS_PER_WORKER,
};
use crate::load_report::LoadReport;

/// The least time between two snapshot requests on one connection.
pub const KV_SNAPSHOT_RETRY: Duration = Duration::from_secs(1);

/// How long a router waits for a requested snapshot to complete before it gives up on it.
pub const KV_SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(10);

/// Live batches a router keeps while a snapshot streams (beyond it the snapshot fails).
pub const KV_SNAPSHOT_BUFFER_BATCHES: usize = KV_SINK_BATCHES;

/// What the reader hands the feed task.
enum Incoming {
    Batch(Vec<u8>),
    Chunk {
        seq: Option<u64>,
        last: bool,
        payload: Vec<u8>,
    },
    Unavailable,
}

/// The router side of one connection's event stream. Dropping it ends the stream (the task
/// drains what is buffered, then calls [`KvEventSink::closed`]).
pub(crate) struct Feed {
    tx: mpsc::Sender<Incoming>,
    dropped: Arc<AtomicU64>,
    /// The sink, for load reports: applied on the reader task, not queued (see
    /// [`KvEventSink::load_report`]).
    sink: Arc<dyn KvEventSink>,
}

impl Feed {
    /// Start the feeding task on the current runtime; with a `writer`, and a sink that
    /// [`wants_snapshots`](KvEventSink::wants_snapshots), it asks for snapshots on it.
    /// Requests wait for `trigger` (the first request, and the arming of later ones).
    pub(crate) fn spawn(
        sink: Arc<dyn KvEventSink>,
        writer: Option<Writer>,
        trigger: Arc<Notify>,
    ) -> Feed {
        let (tx, rx) = mpsc::channel(KV_SINK_BATCHES);
        let dropped = Arc::new(AtomicU64::new(0));
        let reports = Arc::clone(&sink);
        let task = Task {
            writer: writer.filter(|_| sink.wants_snapshots()),
            trigger,
            armed: false,
            want: false,
            sink,
            lagged: Arc::clone(&dropped),
            last: None,
            not_before: Instant::now(),
            inflight: None,
        };
        tokio::spawn(task.run(rx));
        Feed {
            tx,
            dropped,
            sink: reports,
        }
    }

    /// Decode a [`Frame::LoadReport`](super::wire::Frame::LoadReport) payload and hand it (or
    /// why it was refused) to the sink.
    pub(crate) fn report(&self, payload: &[u8]) {
        let report = LoadReport::decode(payload);
        if let Err(e) = &report {
            tracing::debug!(error = %e, "load report refused");
        }
        self.sink.load_report(report);
    }

    /// Hand an event batch payload to the task; if its buffer is full the payload is dropped
    /// and counted.
    pub(crate) fn offer(&self, payload: Vec<u8>) {
        self.push(Incoming::Batch(payload));
    }

    /// Hand a snapshot chunk to the task (dropped and counted like a batch when full).
    pub(crate) fn offer_chunk(&self, seq: Option<u64>, last: bool, payload: Vec<u8>) {
        self.push(Incoming::Chunk { seq, last, payload });
    }

    /// The worker takes no snapshots.
    pub(crate) fn offer_unavailable(&self) {
        self.push(Incoming::Unavailable);
    }

    fn push(&self, item: Incoming) {
        if self.tx.try_send(item).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A requested snapshot.
struct InFlight {
    /// `None` once failed: its remaining chunks are discarded.
    assembler: Option<SnapshotAssembler>,
    /// Live batches since the request.
    kept: Vec<EventBatch>,
    deadline: Instant,
}

struct Task {
    sink: Arc<dyn KvEventSink>,
    /// Where requests go; `None` when snapshots are not wanted or not supported.
    writer: Option<Writer>,
    trigger: Arc<Notify>,
    /// Whether the owner asked for snapshots: none is requested before.
    armed: bool,
    lagged: Arc<AtomicU64>,
    /// `(epoch, seq)` of the newest live batch delivered, to see gaps.
    last: Option<(u64, u64)>,
    want: bool,
    not_before: Instant,
    inflight: Option<InFlight>,
}

impl Task {
    async fn run(mut self, mut rx: mpsc::Receiver<Incoming>) {
        loop {
            self.request_if_due().await;
            let wake = match &self.inflight {
                Some(inflight) => Some(inflight.deadline),
                None if self.armed && self.want && self.writer.is_some() => Some(self.not_before),
                None => None,
            };
            let wake = wake.unwrap_or_else(|| Instant::now() + KV_SNAPSHOT_TIMEOUT);
            let item = tokio::select! {
                item = rx.recv() => item,
                () = tokio::time::sleep_until(wake) => {
                    self.on_timer();
                    continue;
                }
                () = self.trigger.notified(), if !self.armed && self.writer.is_some() => {
                    self.armed = true;
                    self.want = true;
                    continue;
                }
            };
            let Some(item) = item else { break };
            // Drops are reported no later than the next item handled (possibly earlier than
            // their place in the stream: an early reset is safe, a late one is not).
            self.report_lag();
            match item {
                Incoming::Batch(payload) => self.on_batch(&payload),
                Incoming::Chunk { seq, last, payload } => self.on_chunk(seq, last, &payload),
                Incoming::Unavailable => {
                    tracing::debug!("worker takes no KV snapshots; live events only");
                    self.writer = None;
                    if self.inflight.take().is_some() {
                        self.sink.snapshot_failed(SnapshotError::Unsupported);
                    }
                }
            }
        }
        self.report_lag();
        self.sink.closed();
    }

    async fn request_if_due(&mut self) {
        if !self.armed || !self.want || self.inflight.is_some() || Instant::now() < self.not_before
        {
            return;
        }
        let Some(writer) = &self.writer else {
            return;
        };
        let request = bytes::Bytes::from(wire::encode_frame(&Frame::KvSnapshotRequest));
        if !writer.send(request).await {
            // The connection closed: the reader ends the feed.
            self.writer = None;
            return;
        }
        let now = Instant::now();
        self.want = false;
        self.not_before = now + KV_SNAPSHOT_RETRY;
        self.inflight = Some(InFlight {
            assembler: Some(SnapshotAssembler::new(DEFAULT_MAX_BLOCKS_PER_WORKER)),
            kept: Vec::new(),
            deadline: now + KV_SNAPSHOT_TIMEOUT,
        });
        self.sink.snapshot_requested();
    }

    fn on_timer(&mut self) {
        if self
            .inflight
            .as_ref()
            .is_some_and(|i| Instant::now() >= i.deadline)
        {
            let inflight = self.inflight.take();
            if inflight.is_some_and(|i| i.assembler.is_some()) {
                self.fail(SnapshotError::Timeout);
            }
            self.want = true;
        }
    }

    fn report_lag(&mut self) {
        let n = self.lagged.swap(0, Ordering::Relaxed);
        if n > 0 {
            self.sink.error(KvStreamError::Lagged { dropped: n });
            self.lost();
        }
    }

    /// A batch (or chunk) was lost: the stream needs a snapshot, and one streaming now fails.
    fn lost(&mut self) {
        self.want = true;
        if self
            .inflight
            .as_ref()
            .is_some_and(|i| i.assembler.is_some())
        {
            self.fail(SnapshotError::Gap);
        }
    }

    /// Fail the streaming snapshot: its remaining chunks are discarded, a new one is wanted.
    fn fail(&mut self, error: SnapshotError) {
        tracing::debug!(%error, "KV snapshot failed; live events only until the next one");
        if let Some(inflight) = &mut self.inflight {
            inflight.assembler = None;
            inflight.kept = Vec::new();
        }
        self.want = true;
        self.sink.snapshot_failed(error);
    }

    fn on_batch(&mut self, payload: &[u8]) {
        let batch = match decode_kv_payload(payload) {
            Ok(batch) => batch,
            Err(e) => {
                tracing::warn!(error = %e, "KV event batch refused");
                self.sink.error(e);
                self.lost();
                return;
            }
        };
        match self.last {
            Some((epoch, seq)) if epoch == batch.epoch && batch.seq > seq.saturating_add(1) => {
                self.lost();
            }
            _ => {}
        }
        if self.last.is_none_or(|last| (batch.epoch, batch.seq) > last) {
            self.last = Some((batch.epoch, batch.seq));
        }
        let full = match self.inflight.as_mut() {
            Some(inflight) if inflight.assembler.is_some() => {
                if inflight.kept.len() >= KV_SNAPSHOT_BUFFER_BATCHES {
                    true
                } else {
                    inflight.kept.push(batch.clone());
                    false
                }
            }
            _ => false,
        };
        if full {
            self.fail(SnapshotError::BufferFull {
                max: KV_SNAPSHOT_BUFFER_BATCHES,
            });
        }
        self.sink.batch(batch);
    }

    fn on_chunk(&mut self, seq: Option<u64>, last: bool, payload: &[u8]) {
        let Some(inflight) = self.inflight.as_mut() else {
            tracing::debug!("unrequested KV snapshot chunk ignored");
            return;
        };
        let Some(assembler) = inflight.assembler.as_mut() else {
            if last {
                self.inflight = None;
            }
            return;
        };
        let pushed = decode_kv_payload(payload)
            .map_err(|e| SnapshotError::Malformed(e.to_string()))
            .and_then(|chunk| assembler.push(seq, last, chunk));
        match pushed {
            Ok(None) => {}
            Ok(Some(snapshot)) => {
                let kept = self.inflight.take().map(|i| i.kept).unwrap_or_default();
                tracing::debug!(
                    blocks = snapshot.block_count(),
                    seq = ?snapshot.seq,
                    kept = kept.len(),
                    "KV snapshot complete"
                );
                self.sink.snapshot(snapshot);
                for batch in kept {
                    self.sink.batch(batch);
                }
            }
            Err(e) => {
                self.fail(e);
                if last {
                    self.inflight = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::{encode_events, KvEvent};

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
        let feed = Feed::spawn(sink.clone(), None, Arc::default());
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
}
