//! Engine KV event ingestion, side by side in one run: vLLM's msgpack batches (decoded, mirrored
//! into our content hashes, applied to the index) against our own workers' v1 wire batches of
//! the same blocks (decoded, applied), and the decoder alone on the five real vLLM payloads.
//!
//! `cargo bench --features engine --bench engine_events -- --warm-up-time 1 --measurement-time 3`
//!
//! Workload: an engine at block size 32 storing one 8-block prompt per batch (256 tokens, as the
//! captured sample 03) and, at its capacity of 4,096 blocks, removing the 8 oldest blocks in
//! the same batch: 16 block events a batch, an LRU at capacity.

use std::collections::VecDeque;
use std::hint::black_box;

use criterion::{Criterion, Throughput};
use prefill_router::kv_events::{
    decode_engine_batch, decode_events, encode_engine_batch, encode_events, EngineBatch,
    EngineEncoding, EngineEvent, EngineMirror, EventBatch, KvEvent, KvIndex, MirrorAction, Skipped,
    StoredBlocks,
};

const BS: u32 = 32;
const BLOCKS: u64 = 8;
const CAPACITY: usize = 4096;
const BATCHES: u64 = 1024;

/// `BATCHES` engine payloads and our wire's equivalent payloads.
fn workload() -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let mut held: VecDeque<u64> = VecDeque::new();
    let (mut engine, mut ours) = (Vec::new(), Vec::new());
    for b in 0..BATCHES {
        let hashes: Vec<u64> = (0..BLOCKS).map(|i| b << 8 | i).collect();
        let tokens: Vec<u32> = (0..BLOCKS as u32 * BS)
            .map(|t| 1 + (b as u32 * 7 + t) % 30_000)
            .collect();
        let mut removed = Vec::new();
        while held.len() + hashes.len() > CAPACITY {
            removed.extend(held.pop_front());
        }
        held.extend(&hashes);
        let mut events = vec![EngineEvent::Stored(StoredBlocks {
            hashes: hashes.clone(),
            parent: None,
            token_ids: tokens,
            block_size: BS,
            lora_id: None,
            medium: Some("GPU".into()),
            group_idx: 0,
            spec_kind: Some("full_attention".into()),
        })];
        let mut wire = vec![KvEvent::Stored {
            parent: None,
            blocks: hashes,
        }];
        if !removed.is_empty() {
            events.push(EngineEvent::Removed {
                hashes: removed.clone(),
                group_idx: 0,
                medium: Some("GPU".into()),
            });
            wire.push(KvEvent::Removed { blocks: removed });
        }
        let batch = EngineBatch {
            ts: b as f64,
            events,
            dp_rank: Some(0),
            skipped: Skipped::default(),
        };
        engine.push(encode_engine_batch(&batch, EngineEncoding::Tagged));
        let batch = EventBatch {
            epoch: 1,
            seq: b,
            events: wire,
        };
        ours.push(encode_events(&batch).expect("within the wire bounds"));
    }
    (engine, ours)
}

fn ingest(c: &mut Criterion) {
    let (engine, ours) = workload();
    let mut group = c.benchmark_group("ingest");
    group.throughput(Throughput::Elements(BATCHES));
    group.bench_function("engine-msgpack-mirrored", |b| {
        b.iter(|| {
            let mut mirror = EngineMirror::new(BS, 1);
            let mut index = KvIndex::default();
            for (seq, payload) in engine.iter().enumerate() {
                let batch = decode_engine_batch(payload).expect("valid");
                for action in mirror.handle_live(0, seq as u64, batch) {
                    if let MirrorAction::Apply(batch) = action {
                        index.apply(1, &batch);
                    }
                }
            }
            black_box(index.len())
        });
    });
    group.bench_function("own-wire", |b| {
        b.iter(|| {
            let mut index = KvIndex::default();
            for payload in &ours {
                let batch = decode_events(payload).expect("valid");
                index.apply(1, &batch);
            }
            black_box(index.len())
        });
    });
    group.finish();

    let mut group = c.benchmark_group("decode-real-vllm");
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/vllm_kv_events");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("fixtures")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .collect();
    files.sort();
    for path in files {
        let bytes = std::fs::read(&path).expect("fixture");
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("?")
            .to_owned();
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function(name.get(..2).unwrap_or(&name), |b| {
            b.iter(|| black_box(decode_engine_batch(black_box(&bytes)).expect("valid")));
        });
    }
    group.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    ingest(&mut c);
    c.final_summary();
}
