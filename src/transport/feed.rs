//! The router side of one connection's KV event stream: the reader offers payloads without
//! waiting, one task decodes them and feeds the sink, and (for a sink that wants them) asks the
//! worker for snapshots and reassembles them.
//!
//! **Snapshot rule** (per connection): a snapshot is wanted once the connection's owner arms
//! it ([`Connection::request_kv_snapshot`](super::Connection::request_kv_snapshot), the
//! dispatcher does when it adopts a new connection, right after the subscribe) and after every
//! lost batch from then on (a sequence gap, a refused or dropped batch). A request goes out when one is wanted,
//! none is outstanding, and [`KV_SNAPSHOT_RETRY`] has passed since the previous request (no
//! storm, whatever the stream does). A gap is judged as the sink's index judges it: from the
//! newest live batch delivered or the last snapshot's `(epoch, seq)`, whichever came later.
//! While a snapshot streams, live batches are delivered as before
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
            position: None,
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
    /// Where the sink's index stands on this stream, by its sequence rule: `(epoch, seq)` of
    /// the newest live batch delivered, or of the last snapshot delivered if that came later
    /// (`seq` `None`: a snapshot taken before the epoch's first batch). A batch past the next
    /// in sequence is a gap.
    position: Option<(u64, Option<u64>)>,
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
        if self.advance(batch.epoch, batch.seq) {
            self.lost();
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

    /// Move the position past a batch of `(epoch, seq)`; whether the batch skipped some (a
    /// gap, for which the index drops the worker's entries).
    fn advance(&mut self, epoch: u64, seq: u64) -> bool {
        let gap = match self.position {
            Some((at, last)) if at == epoch => seq > last.map_or(0, |last| last.saturating_add(1)),
            _ => false,
        };
        if self
            .position
            .is_none_or(|position| (epoch, Some(seq)) > position)
        {
            self.position = Some((epoch, Some(seq)));
        }
        gap
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
                // The index moves to the snapshot's position (unless its epoch is older) and
                // applies the kept batches after it: judge the next batch from there, as the
                // index does. Judged from the live batches alone, a batch lost right after a
                // snapshot that no live batch preceded went unseen: the index dropped the
                // worker's entries at the next batch, and no snapshot was asked for to bring
                // them back.
                if self
                    .position
                    .is_none_or(|(epoch, _)| snapshot.epoch >= epoch)
                {
                    self.position = Some((snapshot.epoch, snapshot.seq));
                }
                let mut gap = false;
                for batch in &kept {
                    gap |= self.advance(batch.epoch, batch.seq);
                }
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
                if gap {
                    self.lost();
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
    use crate::kv_events::{encode_events, KvEvent, KvSnapshot};

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
        fn snapshot_requested(&self) {
            self.0.lock().push("requested".into());
        }
        fn snapshot(&self, snapshot: KvSnapshot) {
            self.0.lock().push(format!("snapshot {:?}", snapshot.seq));
        }
    }

    impl Recorder {
        fn requests(&self) -> usize {
            self.0.lock().iter().filter(|e| *e == "requested").count()
        }
    }

    /// A task armed for snapshots, driven by hand (no `run` loop); its requests go to a
    /// loopback peer, returned to keep the connection open.
    async fn armed_task(sink: Arc<Recorder>) -> (Task, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("address");
        let (ours, theirs) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let (_, wr) = super::super::stream::split_tcp(ours.expect("connect"));
        let writer = Writer::new(
            wr,
            wire::DEFAULT_MAX_FRAME_LEN,
            tokio_util::sync::CancellationToken::new(),
        );
        let task = Task {
            sink,
            writer: Some(writer),
            trigger: Arc::default(),
            armed: true,
            want: true,
            lagged: Arc::default(),
            position: None,
            not_before: Instant::now(),
            inflight: None,
        };
        (task, theirs.expect("accept").0)
    }

    fn batch(epoch: u64, seq: u64) -> Vec<u8> {
        encode_events(&EventBatch {
            epoch,
            seq,
            events: vec![KvEvent::Stored {
                parent: None,
                blocks: vec![seq + 1],
            }],
        })
        .expect("encodable")
    }

    /// Deliver `snapshot` to `task` as the worker sends it, chunk by chunk.
    fn answer(task: &mut Task, snapshot: &KvSnapshot) {
        let chunks = snapshot.chunks();
        let count = chunks.len();
        for (i, chunk) in chunks.iter().enumerate() {
            let payload = encode_events(chunk).expect("encodable");
            task.on_chunk(snapshot.seq, i + 1 == count, &payload);
        }
    }

    fn snapshot(epoch: u64, seq: Option<u64>) -> KvSnapshot {
        KvSnapshot {
            epoch,
            seq,
            chains: vec![KvEvent::Stored {
                parent: None,
                blocks: vec![100, 101],
            }],
        }
    }

    /// Snapshot requests made once the retry interval has passed (the clock is paused).
    async fn requests_after_the_retry(task: &mut Task, sink: &Recorder) -> usize {
        tokio::time::advance(KV_SNAPSHOT_RETRY).await;
        task.request_if_due().await;
        sink.requests()
    }

    /// The flake of `tools/tests/kv_snapshot.rs`: the worker's snapshot is taken before its
    /// batch 0 is handed out (the snapshot already holds the blocks), batch 0 is lost, and
    /// batch 1 is the first live batch this connection sees. The index, at the snapshot's
    /// position, drops the worker's entries at batch 1: the feed must ask for a snapshot
    /// again once the retry interval allows.
    #[tokio::test(flavor = "current_thread")]
    async fn a_batch_that_skips_past_a_snapshots_position_asks_for_another_snapshot() {
        let sink = Arc::new(Recorder::default());
        let (mut task, _peer) = armed_task(Arc::clone(&sink)).await;
        tokio::time::pause();
        task.request_if_due().await;
        assert_eq!(sink.requests(), 1);
        answer(&mut task, &snapshot(1, None));
        task.on_batch(&batch(1, 1));
        assert_eq!(
            requests_after_the_retry(&mut task, &sink).await,
            2,
            "batch 1 after a snapshot at no batch yet is a gap: {:?}",
            sink.0.lock()
        );

        // The same after a snapshot at a batch: the next but one is a gap.
        answer(&mut task, &snapshot(1, Some(4)));
        task.on_batch(&batch(1, 6));
        let requests = requests_after_the_retry(&mut task, &sink).await;
        assert_eq!(requests, 3, "{:?}", sink.0.lock());
    }

    /// A batch kept while the snapshot streamed that does not follow the snapshot's position
    /// is a gap once the snapshot is in (the index applies the kept batches after it).
    #[tokio::test(flavor = "current_thread")]
    async fn a_kept_batch_that_skips_past_the_snapshots_position_asks_for_another_snapshot() {
        let sink = Arc::new(Recorder::default());
        let (mut task, _peer) = armed_task(Arc::clone(&sink)).await;
        tokio::time::pause();
        task.request_if_due().await;
        // The first live batch, while the snapshot streams: nothing to judge it by yet.
        task.on_batch(&batch(1, 3));
        answer(&mut task, &snapshot(1, Some(1)));
        let requests = requests_after_the_retry(&mut task, &sink).await;
        assert_eq!(requests, 2, "{:?}", sink.0.lock());
    }

    /// The batches that follow a snapshot in sequence (or that it covers) ask for nothing.
    #[tokio::test(flavor = "current_thread")]
    async fn batches_in_sequence_after_a_snapshot_ask_for_nothing() {
        let sink = Arc::new(Recorder::default());
        let (mut task, _peer) = armed_task(Arc::clone(&sink)).await;
        tokio::time::pause();
        task.request_if_due().await;
        task.on_batch(&batch(1, 2));
        answer(&mut task, &snapshot(1, Some(2)));
        for seq in [1, 2, 3, 4] {
            task.on_batch(&batch(1, seq));
        }
        let requests = requests_after_the_retry(&mut task, &sink).await;
        assert_eq!(requests, 1, "{:?}", sink.0.lock());
        // A snapshot at no batch yet is followed in sequence by batch 0.
        let (mut task, _peer) = armed_task(Arc::clone(&sink)).await;
        task.request_if_due().await;
        answer(&mut task, &snapshot(2, None));
        task.on_batch(&batch(2, 0));
        task.on_batch(&batch(2, 1));
        let requests = requests_after_the_retry(&mut task, &sink).await;
        assert_eq!(requests, 2, "{:?}", sink.0.lock());
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
