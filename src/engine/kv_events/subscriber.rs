//! One engine's event feed: the driver loop around its [`EngineMirror`]. Reader tasks (one per
//! data-parallel rank, ZMQ SUB) and replay tasks (ZMQ DEALER) send what arrives into one
//! channel; the loop hands it to the mirror and carries out the mirror's actions (batches to
//! the dispatcher's KV index through a [`KvEventSink`], replays to spawn). It decides nothing
//! itself.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend};

use super::board::{EngineKvBoard, FeedState};
use super::sources::{parse_sources, KvEventSource};
use crate::discovery::Instance;
use crate::kv_events::engine_wire::decode_engine_batch;
use crate::kv_events::{EngineBatch, EngineEvent, EngineMirror, MirrorAction, MirrorError};
use crate::transport::KvEventSink;

use super::super::client::HttpClient;

/// Inputs waiting for the loop, at most (a full channel holds the readers back; the engine's
/// publisher then drops at its high-water mark, which the mirror sees as a gap and replays).
const INPUTS: usize = 1024;
/// How long a replay may go quiet before it is given up.
const REPLAY_IDLE: Duration = Duration::from_secs(5);
/// Replayed batches taken from one request, at most (vLLM buffers 10,000 by default).
const MAX_REPLAY: usize = 100_000;
/// Backoff between attempts to read the engine's event sources.
const SOURCES_BACKOFF: (Duration, Duration) = (Duration::from_millis(250), Duration::from_secs(10));

/// What reaches the loop.
enum Input {
    Live {
        rank: u32,
        seq: u64,
        payload: Bytes,
    },
    Replayed {
        rank: u32,
        seq: u64,
        payload: Bytes,
    },
    ReplayEnd {
        rank: u32,
    },
    ReplayFailed {
        rank: u32,
        reason: String,
    },
    /// The live stream is subscribed (its first connect).
    Subscribed {
        rank: u32,
    },
    Connected {
        rank: u32,
    },
    Disconnected {
        rank: u32,
    },
    /// A message that is not `[topic, seq (8 bytes), payload]`.
    BadFrame {
        rank: u32,
    },
}

/// The block size a batch's last stored chain of the main attention group says (what
/// `serve --check-events` reports).
fn block_size_of(batch: &EngineBatch) -> Option<u32> {
    batch.events.iter().rev().find_map(|event| match event {
        EngineEvent::Stored(stored) if stored.group_idx == 0 => Some(stored.block_size),
        _ => None,
    })
}

/// Everything one engine's feed needs.
pub(crate) struct Feed {
    pub(crate) instance: Arc<Instance>,
    pub(crate) block_size: u32,
    pub(crate) epoch: u64,
    pub(crate) sink: Arc<dyn KvEventSink>,
    pub(crate) board: Arc<EngineKvBoard>,
    pub(crate) client: Arc<HttpClient>,
}

impl Feed {
    /// Run until `cancel`: find the engine's publishers, subscribe, mirror.
    pub(crate) async fn run(self, cancel: CancellationToken) {
        let id = self.instance.instance_id;
        let sources = tokio::select! {
            () = cancel.cancelled() => return,
            s = self.sources() => s,
        };
        let (tx, mut rx) = mpsc::channel(INPUTS);
        for source in &sources {
            tokio::spawn(read(source.clone(), tx.clone(), cancel.clone()));
        }
        let mut mirror = EngineMirror::new(self.block_size, self.epoch);
        self.board.update(id, |s| {
            s.state = FeedState::Subscribed;
            s.connected = true;
        });
        let mut reported: Option<MirrorError> = None;
        let stale_after = self.client.config().events_stale_after;
        self.board.update(id, |s| s.stale_after = Some(stale_after));
        // Checks whether a batch owed after a prefill is overdue (see `EngineKvStatus::owed_for`).
        let mut check = tokio::time::interval((stale_after / 4).max(Duration::from_millis(10)));
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let input = tokio::select! {
                () = cancel.cancelled() => break,
                _ = check.tick() => {
                    if let Some(waited) = self.board.owed_for(id) {
                        self.stale(waited);
                        return;
                    }
                    continue;
                }
                input = rx.recv() => match input {
                    Some(input) => input,
                    None => break,
                },
            };
            // The engine's timestamp of a live batch, for its freshness once applied.
            let mut published = None;
            // The block size its stored blocks say, shown with the mirror's verdict on it.
            let mut seen_size = None;
            let actions = match input {
                Input::Live { rank, seq, payload } => match decode_engine_batch(&payload) {
                    Ok(batch) => {
                        published = Some(batch.ts);
                        seen_size = block_size_of(&batch);
                        self.board
                            .update(id, |s| s.live(tokio::time::Instant::now()));
                        mirror.handle_live(rank, seq, batch)
                    }
                    Err(error) => {
                        // Lost: the next batch shows the gap, and the replay sends it again
                        // (undecodable again, it is rebuilt around).
                        tracing::warn!(engine = id, rank, seq, %error, "KV event batch undecodable");
                        self.board.update(id, |s| s.undecodable += 1);
                        Vec::new()
                    }
                },
                Input::Replayed { rank, seq, payload } => match decode_engine_batch(&payload) {
                    Ok(batch) => {
                        seen_size = block_size_of(&batch);
                        mirror.handle_replayed(rank, seq, batch)
                    }
                    Err(error) => {
                        tracing::warn!(engine = id, rank, seq, %error, "replayed KV event batch undecodable");
                        self.board.update(id, |s| s.undecodable += 1);
                        Vec::new()
                    }
                },
                Input::ReplayEnd { rank } => mirror.handle_replay_end(rank),
                Input::ReplayFailed { rank, reason } => {
                    tracing::warn!(engine = id, rank, %reason, "KV event replay failed: the engine's entries are rebuilt");
                    mirror.handle_replay_failed(rank)
                }
                Input::Subscribed { rank } => mirror.handle_subscribed(rank),
                Input::Connected { rank } => {
                    self.board.update(id, |s| s.connected = true);
                    mirror.handle_reconnected(rank)
                }
                Input::Disconnected { rank } => {
                    tracing::info!(engine = id, rank, "KV event stream lost; reconnecting");
                    self.board.update(id, |s| {
                        s.disconnects += 1;
                        s.connected = false;
                    });
                    Vec::new()
                }
                Input::BadFrame { rank } => {
                    tracing::debug!(
                        engine = id,
                        rank,
                        "KV event message is not [topic, seq, payload]"
                    );
                    self.board.update(id, |s| s.undecodable += 1);
                    Vec::new()
                }
            };
            for action in actions {
                match action {
                    MirrorAction::Apply(batch) => self.sink.batch(batch),
                    MirrorAction::Withdraw => self.sink.closed(),
                    MirrorAction::Replay { rank, from } => {
                        let endpoint = sources
                            .iter()
                            .find(|s| s.rank == rank)
                            .and_then(|s| s.replay.clone());
                        tokio::spawn(replay(rank, endpoint, from, tx.clone(), cancel.clone()));
                    }
                }
            }
            if let Some(ts) = published {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                let ms = (now - ts) * 1000.0;
                if ms.is_finite() {
                    self.board.update(id, |s| s.freshness.record(ms));
                }
            }
            let (picture, counts, error) = (
                mirror.picture(),
                mirror.counts(),
                mirror.last_error().cloned(),
            );
            // Said once per new reason, not per batch.
            if error.is_some() && error != reported {
                if let Some(e) = &error {
                    tracing::warn!(engine = id, error = %e, "engine KV events cannot all be indexed");
                }
                reported.clone_from(&error);
            }
            self.board.update(id, |s| {
                s.picture = picture;
                s.counts = counts;
                s.engine_block_size = seen_size.or(s.engine_block_size);
                if let Some(error) = error {
                    s.last_error = Some(error);
                }
            });
        }
        // Also after a withdrawal: a second close of the same sink changes nothing.
        self.sink.closed();
    }

    /// The engine's publishers, asked until it answers (backoff); an engine that publishes
    /// nothing is said so once, then asked again slowly.
    /// The engine stored blocks `waited` ago and no batch said so: whatever the index holds of
    /// it may be wrong. Its entries go (it is scored by prediction and load meanwhile) and the
    /// feed ends; the dispatcher's side starts a fresh one (a new subscription, the whole
    /// history replayed).
    fn stale(&self, waited: Duration) {
        let id = self.instance.instance_id;
        tracing::warn!(
            engine = id,
            waited_ms = waited.as_millis() as u64,
            "no KV event after a prefill that stored blocks: the engine's events are stale; its entries are dropped and its feed starts afresh"
        );
        self.sink.closed();
        self.board.update(id, |s| {
            s.stale_restarts += 1;
            s.awaiting_event_since = None;
            s.picture = crate::kv_events::Picture::Unknown;
            s.state = FeedState::Starting;
            s.connected = false;
        });
    }

    async fn sources(&self) -> Vec<KvEventSource> {
        let addr = self.instance.address;
        let id = self.instance.instance_id;
        let mut backoff = SOURCES_BACKOFF.0;
        let mut warned = false;
        loop {
            let answer = self.client.get(addr, "/kv_event_sources").await;
            let parsed = answer
                .map_err(|e| e.to_string())
                .and_then(|body| parse_sources(&body, addr.ip()).map_err(|e| e.to_string()));
            match parsed {
                Ok(sources) => {
                    tracing::info!(engine = id, %addr, ?sources, "subscribing to the engine's KV events");
                    return sources;
                }
                Err(reason) => {
                    if !warned {
                        tracing::warn!(engine = id, %addr, %reason, "no KV events from the engine yet: it is scored by load");
                        warned = true;
                    }
                    self.board.update(id, |s| {
                        s.state = FeedState::NoSources(reason.clone());
                    });
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(SOURCES_BACKOFF.1);
        }
    }
}

/// One rank's live stream: SUB, subscribed to its topic; the socket reconnects by itself, and
/// its monitor tells the loop when the stream broke and came back.
async fn read(source: KvEventSource, tx: mpsc::Sender<Input>, cancel: CancellationToken) {
    let rank = source.rank;
    let mut sub = zeromq::SubSocket::new();
    let mut monitor = sub.monitor();
    loop {
        let connected = tokio::select! {
            () = cancel.cancelled() => return,
            c = sub.connect(&source.endpoint) => c,
        };
        match connected {
            Ok(()) => break,
            Err(error) => {
                tracing::debug!(rank, endpoint = source.endpoint, %error, "KV event connect failed");
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        }
    }
    if let Err(error) = sub.subscribe(&source.topic).await {
        tracing::warn!(rank, %error, "KV event subscribe failed");
        return;
    }
    // Subscribed first, then the history: whatever is published in between is either in the
    // replay or live (or lost, and then the next batch shows the gap).
    if tx.send(Input::Subscribed { rank }).await.is_err() {
        return;
    }
    // The first Connected event is this connect's; later ones are reconnects.
    let mut lost = false;
    loop {
        let input = tokio::select! {
            () = cancel.cancelled() => return,
            event = futures_util::StreamExt::next(&mut monitor) => match event {
                Some(SocketEvent::Disconnected(_)) => {
                    lost = true;
                    Input::Disconnected { rank }
                }
                Some(SocketEvent::Connected(..)) if lost => {
                    lost = false;
                    Input::Connected { rank }
                }
                Some(_) => continue,
                None => return,
            },
            message = sub.recv() => match message {
                Ok(message) => parse_frames(rank, message.into_vec(), false),
                Err(error) => {
                    tracing::debug!(rank, %error, "KV event receive failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        if tx.send(input).await.is_err() {
            return;
        }
    }
}

/// `[topic, seq, payload]` (live) or `["", topic, seq, payload]` (replayed).
fn parse_frames(rank: u32, mut frames: Vec<Bytes>, replayed: bool) -> Input {
    if replayed && !frames.is_empty() && frames[0].is_empty() {
        frames.remove(0);
    }
    if frames.len() != 3 {
        return Input::BadFrame { rank };
    }
    let Ok(seq) = <[u8; 8]>::try_from(&frames[1][..]) else {
        return Input::BadFrame { rank };
    };
    let seq = u64::from_be_bytes(seq);
    let payload = frames.pop().unwrap_or_default();
    if replayed {
        Input::Replayed { rank, seq, payload }
    } else {
        Input::Live { rank, seq, payload }
    }
}

/// Ask `endpoint` (ROUTER) for the batches from `from` on: `["", from (8 bytes BE)]`; it
/// answers each as `["", topic, seq, payload]` and ends with `["", "", 0xff x 8, ""]`.
async fn replay(
    rank: u32,
    endpoint: Option<String>,
    from: u64,
    tx: mpsc::Sender<Input>,
    cancel: CancellationToken,
) {
    let outcome = tokio::select! {
        () = cancel.cancelled() => return,
        outcome = replay_from(rank, endpoint, from, &tx) => outcome,
    };
    let input = match outcome {
        Ok(()) => Input::ReplayEnd { rank },
        Err(reason) => Input::ReplayFailed { rank, reason },
    };
    let _ = tx.send(input).await;
}

async fn replay_from(
    rank: u32,
    endpoint: Option<String>,
    from: u64,
    tx: &mpsc::Sender<Input>,
) -> Result<(), String> {
    let endpoint = endpoint.ok_or("the engine has no replay endpoint")?;
    let mut options = zeromq::SocketOptions::default();
    options.connect_timeout(REPLAY_IDLE);
    let mut dealer = zeromq::DealerSocket::with_options(options);
    dealer
        .connect(&endpoint)
        .await
        .map_err(|e| format!("connect {endpoint}: {e}"))?;
    let request = zeromq::ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from.to_be_bytes()),
    ])
    .map_err(|e| e.to_string())?;
    dealer.send(request).await.map_err(|e| e.to_string())?;
    for _ in 0..MAX_REPLAY {
        let message = tokio::time::timeout(REPLAY_IDLE, dealer.recv())
            .await
            .map_err(|_| format!("no replay answer for {}s", REPLAY_IDLE.as_secs()))?
            .map_err(|e| e.to_string())?;
        let frames = message.into_vec();
        // The end marker: an empty topic and seq -1.
        if frames.len() == 4 && frames[1].is_empty() && frames[2][..] == [0xff; 8] {
            return Ok(());
        }
        let input = parse_frames(rank, frames, true);
        if tx.send(input).await.is_err() {
            return Ok(());
        }
    }
    Err(format!("more than {MAX_REPLAY} replayed batches"))
}
