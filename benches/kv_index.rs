//! KV selection and event ingestion at 8, 64, 512 and 4,096 workers, side by side in one run:
//! the selector scoring from the index of the workers' events, and today's prediction (the
//! selector with no events, its remembered routing).
//!
//! `cargo bench --bench kv_index -- --warm-up-time 1 --measurement-time 3`
//!
//! Workload per pool of N workers: 4 chains of 32 blocks per worker (conversations), each
//! chain held by its worker and one neighbour. `select/.../conversation` asks for one of
//! those chains (2 holders); `select/.../shared-prefix` asks for a chain whose first 4 blocks
//! (a system prompt) every worker holds, then 28 blocks one worker holds. `ingest` applies a
//! worker's batches of 64 block events (32 stored, 32 removed: an LRU at capacity) and counts
//! block events. Each selection runs two ways: `scan` scores every candidate of a slice (the
//! selector before the load board), `board` scores the holders plus one least-loaded worker
//! from the dispatcher's `LoadBoard` (what the dispatcher runs now).

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput};
use prefill_router::advert::KvRouterConfig;
use prefill_router::discovery::InstanceId;
use prefill_router::discovery::{EndpointId, Instance};
use prefill_router::kv_events::{EventBatch, KvEvent, KvIndex};
use prefill_router::push::{KvSelector, LoadBoard};

const POOLS: [u64; 4] = [8, 64, 512, 4096];
const BLOCKS: u64 = 32;
const CHAINS_PER_WORKER: u64 = 4;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Block `i` of conversation chain `c` (chained: distinct per chain and position).
fn chain(c: u64) -> Vec<u64> {
    (0..BLOCKS).map(|i| mix(c << 8 | i)).collect()
}

/// A chain whose first 4 blocks are the shared system prompt.
fn shared_chain(c: u64) -> Vec<u64> {
    (0..BLOCKS)
        .map(|i| {
            if i < 4 {
                mix(0xface_0000 | i)
            } else {
                mix(c << 8 | i)
            }
        })
        .collect()
}

fn stored(seq: u64, blocks: Vec<u64>) -> EventBatch {
    EventBatch {
        epoch: 1,
        seq,
        events: vec![KvEvent::Stored {
            parent: None,
            blocks,
        }],
    }
}

/// The selector with every worker publishing its chains (events), or with the same chains
/// recorded as routed to the same workers (prediction).
fn pool(n: u64, events: bool) -> KvSelector {
    pool_with(n, events, &KvRouterConfig::default())
}

/// [`pool`] under the KV terms of `config`; each chain was picked once for its first holder
/// (its own work there), and the shared system prompt was credited by recent picks since (it
/// is hot), the conversations were not.
fn pool_with(n: u64, events: bool, config: &KvRouterConfig) -> KvSelector {
    let mut kv = KvSelector::new(16, config, 1 << 22);
    for w in 0..n {
        let mut seq = 0;
        for k in 0..CHAINS_PER_WORKER {
            for holder in [w, (w + 1) % n] {
                let c = w * CHAINS_PER_WORKER + k;
                let blocks = if k == 0 { shared_chain(c) } else { chain(c) };
                if holder == w {
                    // Its conversation's own work there (the own-work rule reads it).
                    kv.record_pick(&blocks, 0, w, BOOKING);
                }
                if events {
                    kv.apply_events(holder, &stored(seq, blocks));
                } else {
                    kv.record(&blocks, holder);
                }
            }
            seq += 1;
        }
        if events {
            // The shared system prompt on every worker.
            kv.apply_events(w, &stored(seq, shared_chain(u64::MAX)[..4].to_vec()));
        }
    }
    let system = shared_chain(u64::MAX);
    for _ in 0..64 {
        kv.record_credit(&system, 4);
    }
    kv
}

/// Tokens one request in flight books (a 4-block request plus the default overhead).
const BOOKING: u64 = 4 * 16 + 2048;

/// Prompt tokens of a benchmark request (32 blocks of 16).
const TOKENS: u64 = 32 * 16;

/// The load board the dispatcher keeps: workers `0..n`, worker `w` with `w % 3` requests in
/// flight (the same loads as the candidate slice).
fn board(n: u64) -> LoadBoard {
    let members: std::sync::Arc<[std::sync::Arc<Instance>]> = (0..n)
        .map(|w| {
            std::sync::Arc::new(Instance {
                endpoint: EndpointId::new("bench", "prefill", "generate"),
                instance_id: w,
                address: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
            })
        })
        .collect();
    let mut board = LoadBoard::default();
    board.set_members(members);
    for w in 0..n {
        for _ in 0..w % 3 {
            board.acquire(w, BOOKING);
        }
        // Recent work: every worker was picked, some more than others.
        for _ in 0..1 + w % 5 {
            board.note_work(w, BOOKING);
        }
    }
    board
}

fn select(c: &mut Criterion) {
    let mut group = c.benchmark_group("select");
    for n in POOLS {
        let candidates: Vec<(InstanceId, u64)> = (0..n).map(|w| (w, w % 3 * BOOKING)).collect();
        let board = board(n);
        for (name, events) in [("events", true), ("prediction", false)] {
            let kv = pool(n, events);
            let kv_before = pool_with(n, events, &KvRouterConfig::load_only());
            // The board listing every holder one by one (no load-order walk for a widely held
            // prefix): what `select_on` did before the deep limit.
            let listing = events.then(|| pool(n, events).with_deep_limit(usize::MAX));
            let conversation = chain((n / 2) * CHAINS_PER_WORKER + 1);
            let shared = shared_chain((n / 2) * CHAINS_PER_WORKER);
            for (shape, hashes) in [("conversation", &conversation), ("shared-prefix", &shared)] {
                // The pass over every candidate (the selector before the load board)...
                let mut r = 0u64;
                group.bench_function(BenchmarkId::new(format!("{name}/{shape}/scan"), n), |b| {
                    b.iter(|| {
                        r = r.wrapping_add(1);
                        black_box(kv.select(black_box(hashes), TOKENS, &candidates, None, r))
                    })
                });
                if let Some(listing) = &listing {
                    let id = BenchmarkId::new(format!("{name}/{shape}/every-holder"), n);
                    group.bench_function(id, |b| {
                        b.iter(|| {
                            r = r.wrapping_add(1);
                            black_box(listing.select_on(
                                black_box(hashes),
                                TOKENS,
                                &board,
                                &[],
                                None,
                                r,
                            ))
                        })
                    });
                }
                // The same walk under the cost before keep credit and recent work...
                group.bench_function(
                    BenchmarkId::new(format!("{name}/{shape}/board-before"), n),
                    |b| {
                        b.iter(|| {
                            r = r.wrapping_add(1);
                            black_box(kv_before.select_on(
                                black_box(hashes),
                                TOKENS,
                                &board,
                                &[],
                                None,
                                r,
                            ))
                        })
                    },
                );
                // ...and the deep holders plus the load-order walk (what the dispatcher runs).
                group.bench_function(BenchmarkId::new(format!("{name}/{shape}/board"), n), |b| {
                    b.iter(|| {
                        r = r.wrapping_add(1);
                        black_box(kv.select_on(black_box(hashes), TOKENS, &board, &[], None, r))
                    })
                });
            }
        }
    }
    group.finish();
}

fn ingest(c: &mut Criterion) {
    let mut group = c.benchmark_group("ingest");
    for n in POOLS {
        // A pool already holding its chains, then one worker's LRU churn: each batch stores a
        // fresh 32-block chain and removes the 32 blocks stored two batches earlier.
        let mut index = KvIndex::default();
        for w in 0..n {
            for k in 0..CHAINS_PER_WORKER {
                index.apply(w, &stored(k, chain(w * CHAINS_PER_WORKER + k)));
            }
        }
        let worker = n / 2;
        let mut seq = CHAINS_PER_WORKER;
        let mut next = 1u64 << 40;
        let mut live: std::collections::VecDeque<Vec<u64>> = std::collections::VecDeque::new();
        group.throughput(Throughput::Elements(2 * BLOCKS));
        group.bench_function(BenchmarkId::new("block-events", n), |b| {
            b.iter(|| {
                next += 1;
                let fresh = chain(next);
                let mut events = vec![KvEvent::Stored {
                    parent: None,
                    blocks: fresh.clone(),
                }];
                live.push_back(fresh);
                let old = if live.len() > 2 {
                    live.pop_front().unwrap_or_default()
                } else {
                    chain(next ^ (1 << 50)) // not held: a removal the index skips
                };
                events.push(KvEvent::Removed { blocks: old });
                let batch = EventBatch {
                    epoch: 1,
                    seq,
                    events,
                };
                seq += 1;
                black_box(index.apply(worker, &batch))
            })
        });
    }
    group.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    select(&mut c);
    ingest(&mut c);
    c.final_summary();
}
