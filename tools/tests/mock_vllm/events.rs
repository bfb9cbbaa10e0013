//! KV events: byte for byte vLLM's payloads, what the cache did, the replay from a seq.

use std::time::Duration;

use bytes::Bytes;
use prefill_router::kv_events::{decode_engine_batch, EngineBatch, EngineEvent};
use prefill_router_tools::vllm_mock::cache::CacheEvent;
use prefill_router_tools::vllm_mock::events::encode_batch;
use prefill_router_tools::vllm_mock::hash::block_hashes;
use serde_json::{json, Value};
use zeromq::{Socket, SocketRecv, SocketSend};

use super::{engine, post};

const SAMPLES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/vllm_kv_events"
);

fn sample(name: &str) -> (Vec<u8>, Value) {
    let bin = std::fs::read(format!("{SAMPLES}/{name}.bin")).unwrap();
    let json = std::fs::read_to_string(format!("{SAMPLES}/{name}.json")).unwrap();
    (bin, serde_json::from_str(&json).unwrap())
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// A captured batch's events as the mock's cache events.
fn cache_events(batch: &Value) -> Vec<CacheEvent> {
    batch[1]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|e| match e["type"].as_str().unwrap() {
            "BlockStored" => vec![CacheEvent::Stored {
                hashes: u64s(&e["block_hashes"]),
                parent: e["parent_block_hash"].as_u64(),
                token_ids: u64s(&e["token_ids"])
                    .into_iter()
                    .map(|t| t as u32)
                    .collect(),
            }],
            "BlockRemoved" => u64s(&e["block_hashes"])
                .into_iter()
                .map(|hash| CacheEvent::Removed { hash })
                .collect(),
            _ => vec![CacheEvent::Cleared],
        })
        .collect()
}

#[test]
fn payloads_are_byte_for_byte_real_vllms() {
    for name in [
        "01_BlockStored_3blocks_first_prompt_sha256.seq000000",
        "02_BlockStored_decode_filled_block_with_parent.seq000001",
        "03_BlockRemoved_x5_then_BlockStored_eviction.seq000013",
        "04_AllBlocksCleared_then_BlockStored.seq000014",
        "05_BlockStored_P_instance_sha256_cbor.seq000000",
    ] {
        let (bin, batch) = sample(name);
        let ts = batch[0].as_f64().unwrap();
        assert_eq!(encode_batch(ts, &cache_events(&batch), 32), bin, "{name}");
    }
}

#[test]
fn block_hashes_are_real_vllms_sha256_cbor() {
    let (_, batch) = sample("05_BlockStored_P_instance_sha256_cbor.seq000000");
    let event = &batch[1][0];
    let tokens: Vec<u32> = u64s(&event["token_ids"])
        .into_iter()
        .map(|t| t as u32)
        .collect();
    assert_eq!(block_hashes(&tokens, 32), u64s(&event["block_hashes"]));
}

async fn next_batch(sub: &mut zeromq::SubSocket) -> (u64, EngineBatch) {
    let message = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("a batch in time")
        .unwrap();
    let frames = message.into_vec();
    assert_eq!(frames.len(), 3, "[topic, seq, payload]");
    assert_eq!(&frames[0][..], b"kv-events");
    let seq = u64::from_be_bytes(frames[1][..].try_into().unwrap());
    (seq, decode_engine_batch(&frames[2]).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_say_what_the_cache_did_and_replay_from_a_seq() {
    let e = engine(|c| {
        c.kv_events_port = Some(0);
        c.kv_replay_port = Some(0);
        c.num_gpu_blocks = 4;
    })
    .await;
    let ports = e.events().unwrap().clone();
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&format!("tcp://127.0.0.1:{}", ports.events))
        .await
        .unwrap();
    sub.subscribe("").await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await; // the subscription reaches PUB
    let a: Vec<u32> = (100..170).collect(); // 2 full blocks
    let b: Vec<u32> = (500..600).collect(); // 3 full blocks: the cache of 4 evicts 1
    post(
        e.addr,
        "/v1/completions",
        json!({"prompt": a, "max_tokens": 1}),
    )
    .await;
    let (seq0, first) = next_batch(&mut sub).await;
    assert_eq!(seq0, 0);
    let EngineEvent::Stored(stored) = &first.events[0] else {
        panic!("{first:?}")
    };
    assert_eq!(stored.hashes, block_hashes(&a, 32));
    assert_eq!(
        (stored.parent, stored.block_size, stored.token_ids.len()),
        (None, 32, 64)
    );
    assert_eq!(stored.token_ids[..], a[..64]);
    post(
        e.addr,
        "/v1/completions",
        json!({"prompt": b, "max_tokens": 1}),
    )
    .await;
    let (seq1, second) = next_batch(&mut sub).await;
    assert_eq!(seq1, 1);
    let a_hashes = block_hashes(&a, 32);
    // The old chain's tail goes first.
    assert!(
        matches!(&second.events[0], EngineEvent::Removed { hashes, .. } if hashes == &[a_hashes[1]])
    );
    assert!(
        matches!(&second.events[1], EngineEvent::Stored(s) if s.hashes == block_hashes(&b, 32))
    );
    assert!(e.engine().cached(a_hashes[0]) && !e.engine().cached(a_hashes[1]));
    post(e.addr, "/reset_prefix_cache", json!({})).await;
    let (_, cleared) = next_batch(&mut sub).await;
    assert_eq!(cleared.events, vec![EngineEvent::Cleared]);

    // The replay from seq 1: batches 1 and 2, then the end marker.
    let mut dealer = zeromq::DealerSocket::new();
    dealer
        .connect(&format!("tcp://127.0.0.1:{}", ports.replay.unwrap()))
        .await
        .unwrap();
    let ask: zeromq::ZmqMessage = vec![Bytes::new(), Bytes::copy_from_slice(&1u64.to_be_bytes())]
        .try_into()
        .unwrap();
    dealer.send(ask).await.unwrap();
    let mut seqs = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
            .await
            .unwrap()
            .unwrap();
        let f = m.into_vec();
        if f.len() == 4 && f[1].is_empty() && f[2][..] == [0xff; 8] {
            break;
        }
        assert_eq!(f.len(), 4, "[\"\", topic, seq, payload]");
        seqs.push(u64::from_be_bytes(f[2][..].try_into().unwrap()));
        decode_engine_batch(&f[3]).unwrap();
    }
    assert_eq!(seqs, [1, 2]);
}
