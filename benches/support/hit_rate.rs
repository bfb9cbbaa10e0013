//! The KV selector's hit rate against round robin and random on a synthetic multi-turn
//! workload, each worker with a real LRU cache (`benches/push.rs` prints the table).

use std::collections::{HashMap, VecDeque};

use prefill_router::advert::KvRouterConfig;
use prefill_router::discovery::InstanceId;
use prefill_router::push::select::Choice;
use prefill_router::push::{block_hashes, KvSelector};

/// A worker's real cache in the simulation: LRU of block hashes, `capacity` blocks.
struct SimCache {
    capacity: usize,
    tick: u64,
    blocks: HashMap<u64, u64>,
}

impl SimCache {
    /// Leading blocks already cached; then insert the whole prompt.
    fn prefill(&mut self, hashes: &[u64]) -> usize {
        let hit = hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        for h in hashes {
            self.tick += 1;
            self.blocks.insert(*h, self.tick);
        }
        if self.blocks.len() > self.capacity {
            let mut by_age: Vec<(u64, u64)> = self.blocks.iter().map(|(h, t)| (*t, *h)).collect();
            by_age.sort_unstable();
            let excess = self.blocks.len() - self.capacity;
            for (_, h) in by_age.into_iter().take(excess) {
                self.blocks.remove(&h);
            }
        }
        hit
    }
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Sessions of a multi-turn workload: each turn's prompt is the system prompt plus the whole
/// history so far.
pub fn workload(sessions: u32, turns: u32, systems: u32, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = XorShift(seed);
    let mut history: Vec<Vec<u32>> = (0..sessions)
        .map(|s| (0..256).map(|i| (s % systems) * 10_000 + i).collect())
        .collect();
    let mut remaining: Vec<u32> = vec![turns; sessions as usize];
    let mut out = Vec::new();
    let mut live: Vec<u32> = (0..sessions).collect();
    while !live.is_empty() {
        let k = (rng.next() % live.len() as u64) as usize;
        let s = live[k] as usize;
        // A user message, then the assistant's answer joins the history for the next turn.
        history[s].extend((0..48).map(|_| 100_000 + (rng.next() % 30_000) as u32));
        out.push(history[s].clone());
        history[s].extend((0..48).map(|_| 200_000 + (rng.next() % 30_000) as u32));
        remaining[s] -= 1;
        if remaining[s] == 0 {
            live.swap_remove(k);
        }
    }
    out
}

#[derive(Clone, Copy)]
enum Policy {
    Kv,
    RoundRobin,
    Random,
}

fn simulate(
    policy: Policy,
    prompts: &[Vec<u32>],
    workers: u64,
    block: u32,
    cache_blocks: usize,
) -> (f64, f64) {
    let mut caches: Vec<SimCache> = (0..workers)
        .map(|_| SimCache {
            capacity: cache_blocks,
            tick: 0,
            blocks: HashMap::new(),
        })
        .collect();
    let mut kv = KvSelector::new(block, &KvRouterConfig::default(), 1 << 20);
    let mut rng = XorShift(0x1234_5678);
    // Load: the picks of the last `2 * workers` requests are still in flight.
    let mut in_flight: VecDeque<u64> = VecDeque::new();
    let mut served = vec![0u64; workers as usize];
    let (mut hit, mut total) = (0usize, 0usize);
    for (n, prompt) in prompts.iter().enumerate() {
        let hashes = block_hashes(prompt, block);
        let pick = match policy {
            Policy::RoundRobin => n as u64 % workers,
            Policy::Random => rng.next() % workers,
            Policy::Kv => {
                let cands: Vec<(InstanceId, u64)> = (0..workers)
                    .map(|w| {
                        (
                            w,
                            in_flight.iter().filter(|&&x| x == w).count() as u64 * 2048,
                        )
                    })
                    .collect();
                let tokens = prompt.len() as u64;
                let Choice::Picked { candidate, .. } =
                    kv.select(&hashes, tokens, &cands, None, rng.next())
                else {
                    panic!("candidates");
                };
                let w = candidate.id;
                kv.record(&hashes, w);
                w
            }
        };
        hit += caches[pick as usize].prefill(&hashes);
        total += hashes.len();
        served[pick as usize] += 1;
        in_flight.push_back(pick);
        if in_flight.len() > 2 * workers as usize {
            in_flight.pop_front();
        }
    }
    let max_share = *served.iter().max().unwrap_or(&0) as f64 / prompts.len() as f64;
    (hit as f64 / total as f64, max_share)
}

pub fn hit_rate_table() {
    let (workers, block, cache_blocks) = (8u64, 16u32, 2048usize);
    let prompts = workload(400, 8, 8, 42);
    println!(
        "\n### KV selector prefix hit rate: {} requests (400 sessions x 8 turns, 8 shared 256-token system prompts), {workers} workers, block {block}, worker cache {cache_blocks} blocks",
        prompts.len()
    );
    println!("| policy | prefix hit rate (cached blocks / prompt blocks) | busiest worker's share |\n|---|---|---|");
    for (name, policy) in [
        ("KV", Policy::Kv),
        ("RoundRobin", Policy::RoundRobin),
        ("Random", Policy::Random),
    ] {
        let (rate, share) = simulate(policy, &prompts, workers, block, cache_blocks);
        println!(
            "| {name} | {:.1} % | {:.1} % |",
            rate * 100.0,
            share * 100.0
        );
    }
}
