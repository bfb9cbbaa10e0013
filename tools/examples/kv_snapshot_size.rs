//! KV snapshots on the wire: bytes per cached block and frames per snapshot for a mock
//! worker's cache of 10k and 100k blocks, in two shapes (conversation prompts of 32-block
//! chains; a fragmented cache of 2-block chains), with the time to take, encode, decode and
//! apply one. The frames are exactly what a worker writes for a snapshot request
//! (`Frame::KvSnapshotChunk`, postcard-encoded, plus the 4-byte length prefix).
//!
//! `cargo run --release -p prefill-router-tools --example kv_snapshot_size`

use std::time::Instant;

use prefill_router::kv_events::{
    decode_events, encode_events, KvEvent, KvIndex, SnapshotAssembler,
    DEFAULT_MAX_BLOCKS_PER_WORKER,
};
use prefill_router::transport::{decode_frame, encode_frame, Frame};
use prefill_router_tools::mock::BlockCache;

/// A cache of `blocks` blocks filled by chains of `chain` blocks (distinct hashes).
fn cache(blocks: usize, chain: usize) -> BlockCache {
    let mut cache = BlockCache::with_events(blocks, 1);
    let mut next = 1u64;
    while cache.len() < blocks {
        let hashes: Vec<u64> = (0..chain as u64).map(|i| next + i).collect();
        next += chain as u64;
        cache.prefill(&hashes);
        // Drain as a worker's pump would (keeps the publisher's pending changes bounded).
        cache.take_event_batches();
    }
    cache
}

fn main() {
    println!("| cached blocks | chain length | frames | bytes on the wire | bytes / block | copy ms (under the cache lock) | chains + chunk + encode ms | decode + apply ms |");
    println!("|---|---|---|---|---|---|---|---|");
    for blocks in [10_000usize, 100_000] {
        for chain in [32usize, 2] {
            let cache = cache(blocks, chain);
            let started = Instant::now();
            let copy = cache.snapshot_copy().expect("a publishing cache");
            let taken = started.elapsed();
            let started = Instant::now();
            let snapshot = copy.into_snapshot();
            let chunks = snapshot.chunks();
            let count = chunks.len();
            let frames: Vec<Vec<u8>> = chunks
                .iter()
                .enumerate()
                .map(|(i, chunk)| {
                    encode_frame(&Frame::KvSnapshotChunk {
                        seq: snapshot.seq,
                        last: i + 1 == count,
                        payload: encode_events(chunk).expect("within the batch bounds"),
                    })
                })
                .collect();
            let encoded = started.elapsed();
            let bytes: usize = frames.iter().map(|f| f.len() + 4).sum();

            let started = Instant::now();
            let mut assembler = SnapshotAssembler::new(DEFAULT_MAX_BLOCKS_PER_WORKER);
            let mut done = None;
            for frame in &frames {
                let Ok(Frame::KvSnapshotChunk { seq, last, payload }) = decode_frame(frame) else {
                    panic!("a chunk frame");
                };
                let chunk = decode_events(&payload).expect("a valid chunk");
                done = assembler.push(seq, last, chunk).expect("in order");
            }
            let back = done.expect("complete");
            let mut index = KvIndex::default();
            index.apply_snapshot(1, &back);
            let applied = started.elapsed();
            assert_eq!(index.blocks_of(1).count(), blocks);
            assert!(back
                .chains
                .iter()
                .all(|c| matches!(c, KvEvent::Stored { .. })));

            println!(
                "| {blocks} | {chain} | {count} | {bytes} | {:.2} | {:.2} | {:.2} | {:.2} |",
                bytes as f64 / blocks as f64,
                taken.as_secs_f64() * 1e3,
                encoded.as_secs_f64() * 1e3,
                applied.as_secs_f64() * 1e3,
            );
        }
    }
}
