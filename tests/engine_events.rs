//! Engine KV events end to end against a fake engine in the test (loopback, bounded waits): its
//! `GET /kv_event_sources`, a ZMQ PUB socket sending vLLM's frames `[topic, seq, msgpack]`, and
//! a ZMQ ROUTER replaying its buffer in vLLM's replay protocol. The hop's subscriber learns
//! the (empty) history on subscribe, follows live batches, replays a lost batch (a removal),
//! and notices a restart (numbers going back). Real vLLM runs in `.ci/vllm.sh`'s stage.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use prefill_router::advert::{EngineCard, EngineProtocol, ModelCard, RouterConfig, SelectionMode};
use prefill_router::discovery::{
    Discovery, EndpointId, Instance, MemoryConfig, MemoryDiscovery, Registration,
};
use prefill_router::engine::FeedState;
use prefill_router::kv_events::{
    encode_engine_batch, EngineBatch, EngineEncoding, EngineEvent, Picture, Skipped, StoredBlocks,
};
use prefill_router::{PrefillHop, PrefillHopConfig};
use zeromq::{Socket, SocketRecv, SocketSend};

#[path = "support/fake_http.rs"]
mod fake_http;

const BS: u32 = 16;
const PREFILL_ANSWER: &str = r#"{"choices":[{"index":0,"text":"p","token_ids":[9],"finish_reason":"length"}],"usage":{"prompt_tokens":64,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}},"kv_transfer_params":null}"#;
const TOPIC: &str = "kv-events";

/// The fake engine's event side: its numbered batches and the replay buffer.
#[derive(Default)]
struct Stream {
    next: u64,
    buffer: VecDeque<(u64, Bytes)>,
}

/// The fake engine's clock: batch timestamps differ across its restarts, as wall time does.
static CLOCK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

struct FakeEngine {
    http: SocketAddr,
    publisher: tokio::sync::Mutex<zeromq::PubSocket>,
    stream: Arc<Mutex<Stream>>,
}

impl FakeEngine {
    async fn start() -> FakeEngine {
        let mut publisher = zeromq::PubSocket::new();
        let pub_ep = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
        let mut router = zeromq::RouterSocket::new();
        let replay_ep = router.bind("tcp://127.0.0.1:0").await.unwrap();
        let stream: Arc<Mutex<Stream>> = Arc::default();
        // The replay endpoint: `[id, "", start]` in, every buffered batch from `start` on as
        // `[id, "", topic, seq, payload]`, then the end marker.
        let buffered = Arc::clone(&stream);
        tokio::spawn(async move {
            while let Ok(request) = router.recv().await {
                let frames = request.into_vec();
                let (Some(id), Some(start)) = (frames.first(), frames.get(2)) else {
                    continue;
                };
                let start = u64::from_be_bytes(start[..].try_into().unwrap());
                let batches: Vec<(u64, Bytes)> = buffered
                    .lock()
                    .buffer
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                for (seq, payload) in batches {
                    let reply = vec![
                        id.clone(),
                        Bytes::new(),
                        Bytes::from(TOPIC),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload,
                    ];
                    let _ = router.send(reply.try_into().unwrap()).await;
                }
                let end = vec![
                    id.clone(),
                    Bytes::new(),
                    Bytes::new(),
                    Bytes::from_static(&[0xff; 8]),
                    Bytes::new(),
                ];
                let _ = router.send(end.try_into().unwrap()).await;
            }
        });
        let sources = format!(
            r#"{{"0":{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"{pub_ep}","replay_endpoint":"{replay_ep}","topic":"{TOPIC}"}}}}"#
        );
        let http = fake_http::serve(move |head| {
            if head.starts_with("get /kv_event_sources") {
                ("200 OK", sources.clone())
            } else if head.starts_with("post /v1/completions") {
                // A prefill that found nothing cached (and publishes nothing by itself: the
                // test says what the engine publishes).
                ("200 OK", PREFILL_ANSWER.to_owned())
            } else {
                ("404 Not Found", "{}".to_owned())
            }
        })
        .await;
        FakeEngine {
            http,
            publisher: tokio::sync::Mutex::new(publisher),
            stream,
        }
    }

    /// Number and buffer one batch; send it live unless `lose`.
    async fn publish(&self, events: Vec<EngineEvent>, lose: bool) -> u64 {
        let (seq, payload) = {
            let mut stream = self.stream.lock();
            let seq = stream.next;
            stream.next += 1;
            let batch = EngineBatch {
                ts: 1000.0 + CLOCK.fetch_add(1, std::sync::atomic::Ordering::Relaxed) as f64,
                events,
                dp_rank: Some(0),
                skipped: Skipped::default(),
            };
            let payload = Bytes::from(encode_engine_batch(&batch, EngineEncoding::Tagged));
            stream.buffer.push_back((seq, payload.clone()));
            (seq, payload)
        };
        if !lose {
            let message = vec![
                Bytes::from(TOPIC),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            self.publisher
                .lock()
                .await
                .send(message.try_into().unwrap())
                .await
                .unwrap();
        }
        seq
    }

    /// A new process: numbers from 0 again, an empty buffer.
    fn restart(&self) {
        *self.stream.lock() = Stream::default();
    }
}

/// Prompt `p`: `blocks` blocks of `BS` tokens.
fn prompt(p: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BS).map(|i| 1 + p * 1000 + i).collect()
}

/// The engine stored prompt `p`'s blocks `from..to` (its own hashes: `p * 100 + i`).
fn stored(p: u32, from: u32, to: u32) -> EngineEvent {
    let tokens = prompt(p, to);
    EngineEvent::Stored(StoredBlocks {
        hashes: (from..to).map(|i| u64::from(p * 100 + i)).collect(),
        parent: from.checked_sub(1).map(|i| u64::from(p * 100 + i)),
        token_ids: tokens[(from * BS) as usize..].to_vec(),
        block_size: BS,
        lora_id: None,
        medium: Some("GPU".into()),
        group_idx: 0,
        spec_kind: Some("full_attention".into()),
    })
}

fn removed(p: u32, from: u32, to: u32) -> EngineEvent {
    EngineEvent::Removed {
        hashes: (from..to).map(|i| u64::from(p * 100 + i)).collect(),
        group_idx: 0,
        medium: Some("GPU".into()),
    }
}

async fn until(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..300 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

/// A hop whose prefill set is the fake engine, its card in KV mode at `block_size` tokens per
/// block; the registrations live as long as the hop.
async fn hop_over(engine: &FakeEngine, block_size: u32) -> (PrefillHop, [Registration; 2]) {
    hop_with(engine, block_size, PrefillHopConfig::default()).await
}

/// [`hop_over`] with `config`.
async fn hop_with(
    engine: &FakeEngine,
    block_size: u32,
    config: PrefillHopConfig,
) -> (PrefillHop, [Registration; 2]) {
    let discovery = MemoryDiscovery::new(MemoryConfig::with_ttl(Duration::from_secs(30)));
    let card = ModelCard {
        kv_cache_block_size: block_size,
        router_config: Some(RouterConfig {
            router_mode: SelectionMode::KV,
            ..RouterConfig::default()
        }),
        engine: Some(EngineCard {
            protocol: EngineProtocol::Vllm,
        }),
        ..ModelCard::named("tiny")
    };
    let instance = |component: &str, id| Instance {
        endpoint: EndpointId::new("engines", component, "generate"),
        instance_id: id,
        address: engine.http,
    };
    // The topology needs a decode set to name a prefill one; nothing is sent to it.
    let keep = [
        discovery
            .register(instance("prefill", 1), card.clone())
            .await
            .unwrap(),
        discovery
            .register(instance("decode", 100), card)
            .await
            .unwrap(),
    ];
    let discovery: Arc<dyn Discovery> = Arc::new(discovery);
    let hop = PrefillHop::start(discovery, "engines", config)
        .await
        .unwrap();
    hop.router()
        .wait_active(Duration::from_secs(10))
        .await
        .unwrap();
    (hop, keep)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_events_follow_replay_gaps_and_notice_restarts() {
    let engine = FakeEngine::start().await;
    let (hop, _keep) = hop_over(&engine, BS).await;
    let binding = hop.router().route().binding().cloned().unwrap();
    let board = Arc::clone(&hop.binding_stats().engine_kv);
    let overlap = |p: u32, blocks: u32| {
        binding
            .dispatcher()
            .kv_indexed_overlap(&prompt(p, blocks), 1)
    };

    // Subscribed: the empty history is replayed, so the engine is known empty at once.
    until("the subscriber's first picture", || {
        board
            .status(1)
            .is_some_and(|s| s.state == FeedState::Subscribed && s.picture == Picture::Exact)
    })
    .await;
    assert_eq!(overlap(1, 4), Some(0));

    // Live batches, once the subscription reaches the publisher (until then they are lost,
    // and the next one's gap replays them): prompt 1's four blocks, then batches until one
    // arrives live.
    engine.publish(vec![stored(1, 0, 4)], false).await;
    let mut filler = 10;
    while board.status(1).is_none_or(|s| s.received == 0) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        engine.publish(vec![stored(filler, 0, 1)], false).await;
        filler += 1;
        assert!(filler < 200, "no live batch ever arrived");
    }
    until("prompt 1 indexed", || overlap(1, 4) == Some(4)).await;

    // A removal lost in transit: the next batch shows the gap, the replay brings it back.
    engine.publish(vec![removed(1, 2, 4)], true).await;
    engine.publish(vec![stored(2, 0, 3)], false).await;
    until("the lost removal replayed", || {
        overlap(1, 4) == Some(2) && overlap(2, 3) == Some(3)
    })
    .await;
    let status = board.status(1).unwrap();
    assert!(status.counts.gaps >= 1, "{status:?}");
    assert!(status.counts.replayed >= 1, "{status:?}");
    assert_eq!(status.picture, Picture::Exact, "{status:?}");

    // A restart: numbers from 0 again. The old process's blocks go; the new one's come.
    engine.restart();
    engine.publish(vec![stored(3, 0, 2)], false).await;
    until("the restart noticed", || {
        overlap(1, 4) == Some(0) && overlap(2, 3) == Some(0) && overlap(3, 2) == Some(2)
    })
    .await;
    let status = board.status(1).unwrap();
    assert_eq!(status.counts.restarts, 1, "{status:?}");
    assert_eq!(status.picture, Picture::Exact, "{status:?}");
    assert_eq!(hop.warnings(), Vec::<String>::new());
    hop.shutdown().await;
}

/// A card whose block size is not the engine's: every stored chain is refused and counted, the
/// operator is warned, and the engine is scored by prediction (not indexed), as an engine
/// without events: never an index entry that silently matches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_at_another_block_size_is_reported_and_not_indexed() {
    let engine = FakeEngine::start().await;
    // History at the engine's block size (BS), before anyone subscribes.
    engine.publish(vec![stored(1, 0, 2)], true).await;
    let (hop, _keep) = hop_over(&engine, BS * 2).await;
    let binding = hop.router().route().binding().cloned().unwrap();
    let board = Arc::clone(&hop.binding_stats().engine_kv);
    until("the mismatch reported", || {
        board
            .status(1)
            .is_some_and(|s| s.counts.block_size_mismatches >= 1)
    })
    .await;
    let warnings = hop.warnings();
    assert!(
        warnings.iter().any(|w| w.contains("the card says 32")),
        "{warnings:?}"
    );
    // Not indexed: scored by prediction (no entry), not by an empty picture.
    until("the engine's index entry dropped", || {
        binding
            .dispatcher()
            .kv_indexed_overlap(&prompt(1, 2), 1)
            .is_none()
    })
    .await;
    hop.shutdown().await;
}

/// Events that stop while prefills store blocks: the batch a prefill owes never comes, so the
/// engine's events are called stale (a warning), its entries dropped, and its feed started
/// afresh, which rebuilds the picture from the engine's replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_owed_after_a_prefill_and_never_sent_are_stale_and_the_feed_restarts() {
    use prefill_router::binding::Binding;
    let engine = FakeEngine::start().await;
    engine.publish(vec![stored(1, 0, 4)], true).await;
    let mut config = PrefillHopConfig::default();
    config.engine.events_stale_after = Duration::from_millis(300);
    let (hop, _keep) = hop_with(&engine, BS, config).await;
    let binding = hop.router().route().binding().cloned().unwrap();
    let board = Arc::clone(&hop.binding_stats().engine_kv);
    until("the history replayed", || {
        binding.dispatcher().kv_indexed_overlap(&prompt(1, 4), 1) == Some(4)
    })
    .await;

    // A prefill of four new blocks, and the engine publishes nothing.
    binding
        .prefill(prefill_router::request::GenerateRequest::new(
            prompt(2, 4),
            1,
        ))
        .await
        .unwrap();
    until("the events called stale", || {
        board.status(1).is_some_and(|s| s.stale_restarts >= 1)
    })
    .await;
    let warned = (0..100).any(|_| {
        let w = hop.warnings();
        std::thread::sleep(Duration::from_millis(2));
        w.iter()
            .any(|w| w.contains("stale") || w.contains("not started"))
    });
    assert!(warned, "the operator hears of it");

    // The fresh feed replays the engine's history: the picture is back, nothing owed.
    until("the feed subscribed afresh", || {
        board.status(1).is_some_and(|s| {
            s.state == FeedState::Subscribed
                && s.picture == Picture::Exact
                && s.awaiting_event_since.is_none()
        })
    })
    .await;
    assert_eq!(
        binding.dispatcher().kv_indexed_overlap(&prompt(1, 4), 1),
        Some(4)
    );
    // A prefill whose batch does come owes nothing for long.
    binding
        .prefill(prefill_router::request::GenerateRequest::new(
            prompt(3, 4),
            1,
        ))
        .await
        .unwrap();
    engine.publish(vec![stored(3, 0, 4)], false).await;
    let restarts = board.status(1).unwrap().stale_restarts;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let status = board.status(1).unwrap();
    assert_eq!(status.stale_restarts, restarts, "{status:?}");
    hop.shutdown().await;
}
