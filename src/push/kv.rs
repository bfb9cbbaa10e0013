//! Approximate prefix-aware worker selection.
//!
//! The router does not see the workers' caches. It remembers, in a bounded LRU, which workers it
//! sent which block chains to, and assumes they still hold them: a worker's overlap with a
//! request is the number of leading blocks of the request that were last routed to it.

use std::collections::{HashMap, VecDeque};

use crate::advert::KvRouterConfig;
use crate::discovery::InstanceId;

/// A block chain is remembered for at most this many workers (the most recent ones); a shared
/// system prompt routed everywhere would otherwise grow one entry without bound.
const MAX_WORKERS_PER_BLOCK: usize = 8;

pub(crate) use crate::kv_events::mix;

/// Chained hashes of the full `block_size`-token blocks of `token_ids`: hash *i* covers tokens
/// `0 .. (i + 1) * block_size`, so equal hashes mean equal prefixes (up to collisions). A
/// trailing partial block is not hashed (workers cache whole blocks only). `block_size` 0 yields
/// no blocks.
pub fn block_hashes(token_ids: &[u32], block_size: u32) -> Vec<u64> {
    let Ok(size) = usize::try_from(block_size) else {
        return Vec::new();
    };
    if size == 0 {
        return Vec::new();
    }
    let mut hashes = Vec::with_capacity(token_ids.len() / size);
    let mut parent = 0x9e37_79b9_7f4a_7c15_u64;
    for block in token_ids.chunks_exact(size) {
        let mut h = parent;
        for &t in block {
            h = mix(h ^ u64::from(t));
        }
        hashes.push(h);
        parent = h;
    }
    hashes
}

pub(crate) use crate::kv_events::MixState;

struct Entry {
    workers: Vec<InstanceId>,
    tick: u64,
}

/// The KV selector: a bounded LRU of block chains per worker, and the scoring rule.
pub struct KvSelector {
    block_size: u32,
    overlap_weight: f64,
    temperature: f64,
    capacity: usize,
    entries: HashMap<u64, Entry, MixState>,
    /// `(tick, block hash)` in the order of use, oldest first. An entry whose tick no longer
    /// matches its block's is stale (the block was used again later) and is skipped: O(1)
    /// per use instead of an ordered-map update; compacted when stale entries dominate.
    order: VecDeque<(u64, u64)>,
    tick: u64,
}

impl std::fmt::Debug for KvSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvSelector")
            .field("block_size", &self.block_size)
            .field("overlap_weight", &self.overlap_weight)
            .field("temperature", &self.temperature)
            .field("entries", &self.entries.len())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl KvSelector {
    /// A selector hashing blocks of `block_size` tokens, remembering at most `capacity` block
    /// chains, scoring with `config.overlap_score_weight` and sampling with
    /// `config.router_temperature` (0 = always the best score).
    pub fn new(block_size: u32, config: &KvRouterConfig, capacity: usize) -> Self {
        KvSelector {
            block_size,
            overlap_weight: if config.overlap_score_weight.is_finite() {
                config.overlap_score_weight
            } else {
                1.0
            },
            temperature: if config.router_temperature.is_finite() {
                config.router_temperature.max(0.0)
            } else {
                0.0
            },
            capacity: capacity.max(1),
            entries: HashMap::default(),
            order: VecDeque::new(),
            tick: 0,
        }
    }

    /// The block size in tokens.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// How many block chains are remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Leading blocks of `hashes` remembered for `worker`.
    pub fn overlap(&self, hashes: &[u64], worker: InstanceId) -> usize {
        hashes
            .iter()
            .take_while(|h| {
                self.entries
                    .get(h)
                    .is_some_and(|e| e.workers.contains(&worker))
            })
            .count()
    }

    /// Pick among `candidates` (`(id, load)` with load = requests in flight): the best
    /// `overlap_weight * overlap - load`. With temperature 0, ties go to the candidate with the
    /// smallest `mix(first block hash ^ id)`: deterministic for a request, yet spreading
    /// unrelated requests across workers. With temperature > 0, samples with probability
    /// proportional to `exp((score - best) / temperature)` using `random`.
    /// Returns the pick and its overlap in blocks; `None` if there are no candidates.
    pub fn select(
        &self,
        hashes: &[u64],
        candidates: &[(InstanceId, u64)],
        random: u64,
    ) -> Option<(InstanceId, usize)> {
        if candidates.is_empty() {
            return None;
        }
        // Walk the chain once, advancing each worker that still matches contiguously.
        let mut matched: Vec<(InstanceId, usize)> = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            let Some(entry) = self.entries.get(h) else {
                break;
            };
            let mut advanced = false;
            for &w in &entry.workers {
                if i == 0 {
                    matched.push((w, 1));
                    advanced = true;
                } else if let Some(m) = matched.iter_mut().find(|m| m.0 == w && m.1 == i) {
                    m.1 += 1;
                    advanced = true;
                }
            }
            if !advanced {
                break;
            }
        }
        let overlap_of = |id: InstanceId| matched.iter().find(|m| m.0 == id).map_or(0, |m| m.1);
        let salt = hashes.first().copied().unwrap_or(0);
        let scored = candidates.iter().map(|&(id, load)| {
            let overlap = overlap_of(id);
            #[allow(clippy::cast_precision_loss)] // block and request counts are far below 2^52
            let score = self.overlap_weight * overlap as f64 - load as f64;
            (id, overlap, score)
        });
        if self.temperature <= 0.0 {
            return scored
                .max_by(|a, b| {
                    a.2.total_cmp(&b.2)
                        .then_with(|| mix(salt ^ b.0).cmp(&mix(salt ^ a.0)))
                })
                .map(|(id, overlap, _)| (id, overlap));
        }
        let scored: Vec<_> = scored.collect();
        let best = scored.iter().map(|s| s.2).fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scored
            .iter()
            .map(|s| ((s.2 - best) / self.temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        #[allow(clippy::cast_precision_loss)] // 53 random bits into [0, 1)
        let mut target = (random >> 11) as f64 / (1u64 << 53) as f64 * total;
        for (s, w) in scored.iter().zip(&weights) {
            if target < *w {
                return Some((s.0, s.1));
            }
            target -= w;
        }
        scored.last().map(|s| (s.0, s.1))
    }

    /// Remember that `worker` prefilled the chain `hashes` (marks them most recently used and
    /// evicts the least recently used chains beyond capacity).
    pub fn record(&mut self, hashes: &[u64], worker: InstanceId) {
        for &h in hashes {
            self.tick += 1;
            let tick = self.tick;
            match self.entries.get_mut(&h) {
                Some(entry) => {
                    entry.tick = tick;
                    if let Some(pos) = entry.workers.iter().position(|&w| w == worker) {
                        entry.workers.remove(pos);
                    } else if entry.workers.len() >= MAX_WORKERS_PER_BLOCK {
                        entry.workers.remove(0);
                    }
                    entry.workers.push(worker);
                }
                None => {
                    self.entries.insert(
                        h,
                        Entry {
                            workers: vec![worker],
                            tick,
                        },
                    );
                }
            }
            self.order.push_back((tick, h));
        }
        while self.entries.len() > self.capacity {
            let Some((tick, oldest)) = self.order.pop_front() else {
                break;
            };
            if self.entries.get(&oldest).is_some_and(|e| e.tick == tick) {
                self.entries.remove(&oldest);
            }
        }
        if self.order.len() > 2 * self.entries.len() + 64 {
            self.compact();
        }
    }

    /// Drop stale entries of the use order (keeps it within twice the index size).
    fn compact(&mut self) {
        let entries = &self.entries;
        self.order
            .retain(|(tick, h)| entries.get(h).is_some_and(|e| e.tick == *tick));
    }

    /// Forget a worker (it left discovery): its chains no longer attract requests.
    pub fn forget(&mut self, worker: InstanceId) {
        self.entries.retain(|_, e| {
            e.workers.retain(|&w| w != worker);
            !e.workers.is_empty()
        });
        self.compact();
    }
}
