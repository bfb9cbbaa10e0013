//! KV events as vLLM 0.32 publishes them (`kv_events_samples/README.md`): a ZMQ PUB socket
//! sending `[topic, seq (8 bytes big-endian), payload]`, the payload the msgpack array
//! `[ts, [events...], 0]` with each event a map tagged by `"type"`, keys in vLLM's order and
//! every required field present; and a ROUTER replay endpoint that answers a DEALER's
//! `["", start_seq]` with every buffered batch from `start_seq` on as `["", topic, seq,
//! payload]`, then `["", "", 0xff x 8, ""]`.
//!
//! The mock publishes one batch per cache change (a finished prefill, a decode that filled
//! blocks, a reset). Unlike vLLM, whose `AllBlocksCleared` waits for the next engine step, a
//! reset is published at once.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend};

use super::cache::CacheEvent;

/// Batches the replay endpoint keeps (vLLM's `buffer_steps` default).
pub const BUFFER_STEPS: usize = 10_000;

/// A minimal msgpack writer: the types a vLLM batch uses.
struct Writer(Vec<u8>);

impl Writer {
    fn len_head(&mut self, fix: u8, m16: u8, m32: u8, n: usize) {
        if n < 16 {
            self.0.push(fix | n as u8);
        } else if let Ok(n) = u16::try_from(n) {
            self.0.push(m16);
            self.0.extend(n.to_be_bytes());
        } else {
            self.0.push(m32);
            self.0.extend((n as u32).to_be_bytes());
        }
    }
    fn array(&mut self, n: usize) {
        self.len_head(0x90, 0xdc, 0xdd, n);
    }
    fn map(&mut self, n: usize) {
        self.len_head(0x80, 0xde, 0xdf, n);
    }
    fn nil(&mut self) {
        self.0.push(0xc0);
    }
    fn uint(&mut self, v: u64) {
        match v {
            0..=0x7f => self.0.push(v as u8),
            0x80..=0xff => self.0.extend([0xcc, v as u8]),
            0x100..=0xffff => {
                self.0.push(0xcd);
                self.0.extend((v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.0.push(0xce);
                self.0.extend((v as u32).to_be_bytes());
            }
            _ => {
                self.0.push(0xcf);
                self.0.extend(v.to_be_bytes());
            }
        }
    }
    fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend(v.to_be_bytes());
    }
    fn str(&mut self, s: &str) {
        let n = s.len();
        if n < 32 {
            self.0.push(0xa0 | n as u8);
        } else if n < 256 {
            self.0.extend([0xd9, n as u8]);
        } else {
            self.0.push(0xda);
            self.0.extend((n as u16).to_be_bytes());
        }
        self.0.extend_from_slice(s.as_bytes());
    }
}

/// One batch's payload, as vLLM 0.32 writes it: `BlockStored` with its 11 keys (`type`,
/// `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`,
/// `lora_name`, `extra_keys`, `group_idx`, `kv_cache_spec_kind`), `BlockRemoved` with 4,
/// `AllBlocksCleared` with its tag alone; data-parallel rank 0.
pub fn encode_batch(ts: f64, events: &[CacheEvent], block_size: usize) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64 + events.len() * 64));
    w.array(3);
    w.f64(ts);
    w.array(events.len());
    for event in events {
        match event {
            CacheEvent::Stored {
                hashes,
                parent,
                token_ids,
            } => {
                w.map(11);
                w.str("type");
                w.str("BlockStored");
                w.str("block_hashes");
                w.array(hashes.len());
                hashes.iter().for_each(|&h| w.uint(h));
                w.str("parent_block_hash");
                match parent {
                    Some(p) => w.uint(*p),
                    None => w.nil(),
                }
                w.str("token_ids");
                w.array(token_ids.len());
                token_ids.iter().for_each(|&t| w.uint(u64::from(t)));
                w.str("block_size");
                w.uint(block_size as u64);
                w.str("lora_id");
                w.nil();
                w.str("medium");
                w.str("GPU");
                w.str("lora_name");
                w.nil();
                w.str("extra_keys");
                w.array(hashes.len());
                hashes.iter().for_each(|_| w.nil());
                w.str("group_idx");
                w.uint(0);
                w.str("kv_cache_spec_kind");
                w.str("full_attention");
            }
            CacheEvent::Removed { hash } => {
                w.map(4);
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.array(1);
                w.uint(*hash);
                w.str("medium");
                w.str("GPU");
                w.str("group_idx");
                w.uint(0);
            }
            CacheEvent::Cleared => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
        }
    }
    w.uint(0);
    w.0
}

/// The numbered batches: the next seq and the replay buffer.
#[derive(Debug, Default)]
struct Log {
    next: u64,
    buffer: VecDeque<(u64, Bytes)>,
}

/// The engine's event publisher: numbers batches, keeps the last [`BUFFER_STEPS`] for replay,
/// and hands them to the PUB task in order.
#[derive(Debug)]
pub struct Publisher {
    topic: String,
    block_size: usize,
    log: Arc<Mutex<Log>>,
    live: mpsc::UnboundedSender<(u64, Bytes)>,
}

/// Where the sockets listen (the ports actually bound).
#[derive(Clone, Debug)]
pub struct EventPorts {
    /// The PUB port.
    pub events: u16,
    /// The ROUTER (replay) port, if any.
    pub replay: Option<u16>,
}

/// Why the event sockets could not start.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// A ZMQ bind failed.
    #[error("cannot bind {endpoint}: {error}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// ZMQ's reason.
        error: zeromq::ZmqError,
    },
}

fn port_of(endpoint: &zeromq::Endpoint) -> u16 {
    match endpoint {
        zeromq::Endpoint::Tcp(_, port) => *port,
        _ => 0,
    }
}

impl Publisher {
    /// Bind PUB on `host:events` and, if given, ROUTER on `host:replay` (0: any free port),
    /// and run them until `cancel`.
    pub async fn start(
        host: &str,
        events: u16,
        replay: Option<u16>,
        topic: String,
        block_size: usize,
        cancel: CancellationToken,
    ) -> Result<(Publisher, EventPorts), EventsError> {
        let bind = |port: u16| format!("tcp://{host}:{port}");
        let mut publisher = zeromq::PubSocket::new();
        let endpoint = bind(events);
        let bound = publisher
            .bind(&endpoint)
            .await
            .map_err(|error| EventsError::Bind { endpoint, error })?;
        let mut ports = EventPorts {
            events: port_of(&bound),
            replay: None,
        };
        let log: Arc<Mutex<Log>> = Arc::default();
        if let Some(port) = replay {
            let mut router = zeromq::RouterSocket::new();
            let endpoint = bind(port);
            let bound = router
                .bind(&endpoint)
                .await
                .map_err(|error| EventsError::Bind { endpoint, error })?;
            ports.replay = Some(port_of(&bound));
            tokio::spawn(serve_replay(
                router,
                Arc::clone(&log),
                topic.clone(),
                cancel.clone(),
            ));
        }
        let (live, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_live(publisher, rx, topic.clone(), cancel));
        Ok((
            Publisher {
                topic,
                block_size,
                log,
                live,
            },
            ports,
        ))
    }

    /// The topic batches carry.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Publish one batch (nothing for no events): numbered, buffered, sent.
    pub fn publish(&self, events: &[CacheEvent]) {
        if events.is_empty() {
            return;
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = Bytes::from(encode_batch(ts, events, self.block_size));
        let mut log = self.log.lock();
        let seq = log.next;
        log.next += 1;
        log.buffer.push_back((seq, payload.clone()));
        if log.buffer.len() > BUFFER_STEPS {
            log.buffer.pop_front();
        }
        // Under the lock: the PUB task gets the batches in seq order.
        let _ = self.live.send((seq, payload));
    }
}

async fn send_live(
    mut socket: zeromq::PubSocket,
    mut rx: mpsc::UnboundedReceiver<(u64, Bytes)>,
    topic: String,
    cancel: CancellationToken,
) {
    loop {
        let (seq, payload) = tokio::select! {
            () = cancel.cancelled() => return,
            next = rx.recv() => match next {
                Some(next) => next,
                None => return,
            },
        };
        let frames = vec![
            Bytes::from(topic.clone()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        if let Ok(message) = zeromq::ZmqMessage::try_from(frames) {
            if let Err(error) = socket.send(message).await {
                tracing::debug!(%error, seq, "KV event batch not sent");
            }
        }
    }
}

async fn serve_replay(
    mut router: zeromq::RouterSocket,
    log: Arc<Mutex<Log>>,
    topic: String,
    cancel: CancellationToken,
) {
    loop {
        let request = tokio::select! {
            () = cancel.cancelled() => return,
            r = router.recv() => match r {
                Ok(r) => r,
                Err(error) => {
                    tracing::debug!(%error, "replay receive failed");
                    continue;
                }
            },
        };
        let frames = request.into_vec();
        // Exactly `[identity, "", start (8 bytes)]`, as vLLM requires; anything else is dropped.
        let start = match frames.as_slice() {
            [_, empty, start] if empty.is_empty() => {
                <[u8; 8]>::try_from(&start[..]).ok().map(u64::from_be_bytes)
            }
            _ => None,
        };
        let Some(start) = start else {
            tracing::debug!(frames = frames.len(), "malformed replay request dropped");
            continue;
        };
        let id = frames[0].clone();
        let batches: Vec<(u64, Bytes)> = log
            .lock()
            .buffer
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let replies = batches
            .into_iter()
            .map(|(seq, payload)| {
                vec![
                    id.clone(),
                    Bytes::new(),
                    Bytes::from(topic.clone()),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ]
            })
            .chain(std::iter::once(vec![
                id.clone(),
                Bytes::new(),
                Bytes::new(),
                Bytes::from_static(&[0xff; 8]),
                Bytes::new(),
            ]));
        for frames in replies {
            let Ok(message) = zeromq::ZmqMessage::try_from(frames) else {
                continue;
            };
            if let Err(error) = router.send(message).await {
                tracing::debug!(%error, "replay answer not sent");
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prefill_router::kv_events::{decode_engine_batch, EngineEvent};

    #[test]
    fn a_batch_decodes_with_our_decoder_and_nothing_is_skipped() {
        let events = [
            CacheEvent::Removed { hash: u64::MAX },
            CacheEvent::Stored {
                hashes: vec![1, 2],
                parent: Some(9),
                token_ids: (0..64).collect(),
            },
            CacheEvent::Cleared,
        ];
        let batch = decode_engine_batch(&encode_batch(12.5, &events, 32)).unwrap();
        assert_eq!(batch.ts, 12.5);
        assert_eq!(batch.dp_rank, Some(0));
        assert_eq!(batch.skipped.unknown_fields, 0);
        assert_eq!(batch.skipped.unknown_events, 0);
        assert!(
            matches!(&batch.events[0], EngineEvent::Removed { hashes, .. } if hashes == &[u64::MAX])
        );
        let EngineEvent::Stored(s) = &batch.events[1] else {
            panic!("{:?}", batch.events[1]);
        };
        assert_eq!(
            (s.parent, s.block_size, s.token_ids.len()),
            (Some(9), 32, 64)
        );
        assert_eq!(s.spec_kind.as_deref(), Some("full_attention"));
        assert_eq!(batch.events[2], EngineEvent::Cleared);
    }
}
