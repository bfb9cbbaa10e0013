//! The prefix cache: full blocks of `block_size` tokens, keyed by vLLM's chained block hash
//! ([`super::hash`]), at most `capacity` of them, least recently used evicted first. Every change
//! comes back as the KV events vLLM would publish for it.
//!
//! As in vLLM: only *leading* blocks hit (a prefix), the last prompt token is always computed
//! (a prompt of exactly k blocks hits at most k - 1 of them), a block reused is not stored
//! again, and when a request's blocks are freed its tail blocks go first in the eviction order
//! (vLLM frees a request's blocks in reverse), so a chain is evicted from its end.

use std::collections::{BTreeMap, HashMap};

/// One cache change, in vLLM's terms (encoded by [`super::events`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// `BlockStored`: a run of new blocks extending `parent`, with all their tokens.
    Stored {
        /// The new blocks' hashes, in chain order.
        hashes: Vec<u64>,
        /// The block the run extends (`None`: it starts a chain).
        parent: Option<u64>,
        /// `block_size * hashes.len()` tokens.
        token_ids: Vec<u32>,
    },
    /// `BlockRemoved`: one evicted block (vLLM sends one event per block).
    Removed {
        /// The evicted block's hash.
        hash: u64,
    },
    /// `AllBlocksCleared`.
    Cleared,
}

/// The mock engine's prefix cache.
#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    capacity: usize,
    /// Held block -> its stamp (higher: more recently used).
    stamps: HashMap<u64, u64>,
    /// Stamp -> block, oldest first: the eviction order.
    order: BTreeMap<u64, u64>,
    clock: u64,
}

impl PrefixCache {
    /// An empty cache of `capacity` blocks of `block_size` tokens (0 blocks: caches nothing).
    pub fn new(block_size: usize, capacity: usize) -> Self {
        PrefixCache {
            block_size: block_size.max(1),
            capacity,
            stamps: HashMap::new(),
            order: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.stamps.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.stamps.is_empty()
    }

    /// Whether `hash` is held (no touch).
    pub fn contains(&self, hash: u64) -> bool {
        self.stamps.contains_key(&hash)
    }

    /// The held blocks, in no particular order.
    pub fn blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.stamps.keys().copied()
    }

    /// How many leading blocks of a prompt of `prompt_len` tokens with block hashes `hashes`
    /// would hit, without touching anything: the held prefix, capped so that the last prompt
    /// token is computed.
    pub fn hits(&self, hashes: &[u64], prompt_len: usize) -> usize {
        let cap = prompt_len.saturating_sub(1) / self.block_size;
        hashes
            .iter()
            .take(cap)
            .take_while(|h| self.stamps.contains_key(h))
            .count()
    }

    /// Hold the full blocks `hashes` of `tokens` (what a finished prefill or decode computed):
    /// the ones not held are stored, all become the most recently used (the chain's head
    /// last in the eviction order), and the least recently used blocks beyond the capacity are
    /// evicted. The events in vLLM's order: evictions, then the stored runs.
    pub fn commit(&mut self, hashes: &[u64], tokens: &[u32]) -> Vec<CacheEvent> {
        let hashes = &hashes[..hashes.len().min(tokens.len() / self.block_size)];
        if self.capacity == 0 || hashes.is_empty() {
            return Vec::new();
        }
        // A chain longer than the cache keeps its head (what a later prompt can hit).
        let hashes = &hashes[..hashes.len().min(self.capacity)];
        let mut stored: Vec<CacheEvent> = Vec::new();
        let mut run_open = false;
        for (i, &h) in hashes.iter().enumerate() {
            if self.stamps.contains_key(&h) {
                run_open = false;
                continue;
            }
            let block = &tokens[i * self.block_size..(i + 1) * self.block_size];
            match stored.last_mut() {
                Some(CacheEvent::Stored {
                    hashes, token_ids, ..
                }) if run_open => {
                    hashes.push(h);
                    token_ids.extend_from_slice(block);
                }
                _ => stored.push(CacheEvent::Stored {
                    hashes: vec![h],
                    parent: i.checked_sub(1).map(|p| hashes[p]),
                    token_ids: block.to_vec(),
                }),
            }
            run_open = true;
        }
        // Tail first, so the head is the last of this chain to go.
        for &h in hashes.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.stamps.insert(h, self.clock) {
                self.order.remove(&old);
            }
            self.order.insert(self.clock, h);
        }
        let mut events = Vec::new();
        while self.stamps.len() > self.capacity {
            let Some((_, evicted)) = self.order.pop_first() else {
                break;
            };
            self.stamps.remove(&evicted);
            events.push(CacheEvent::Removed { hash: evicted });
        }
        events.extend(stored);
        events
    }

    /// Drop everything (`POST /reset_prefix_cache`): the blocks dropped.
    pub fn clear(&mut self) -> usize {
        let n = self.stamps.len();
        self.stamps.clear();
        self.order.clear();
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: u32, base: u32) -> Vec<u32> {
        (0..n).map(|i| base + i).collect()
    }

    #[test]
    fn the_last_prompt_token_is_always_computed() {
        let mut cache = PrefixCache::new(4, 16);
        let t = tokens(8, 10);
        let h = super::super::hash::block_hashes(&t, 4);
        assert_eq!(cache.hits(&h, 8), 0);
        cache.commit(&h, &t);
        assert_eq!(
            cache.hits(&h, 8),
            1,
            "8 tokens = 2 blocks: the second recomputed"
        );
        assert_eq!(cache.hits(&h, 9), 2);
    }

    #[test]
    fn a_store_is_the_new_run_with_its_parent_and_evictions_come_first() {
        let mut cache = PrefixCache::new(2, 3);
        let t = tokens(6, 1);
        let h = [11, 12, 13];
        let first = cache.commit(&h, &t);
        assert_eq!(
            first,
            vec![CacheEvent::Stored {
                hashes: vec![11, 12, 13],
                parent: None,
                token_ids: t.clone()
            }]
        );
        // Blocks 11 and 12 reused, 14 new: no store of the reused ones; the cache is full, so
        // the least recently used block goes first, and that is the old chain's tail (13).
        let next = cache.commit(&[11, 12, 14], &[1, 2, 3, 4, 9, 9]);
        assert_eq!(
            next,
            vec![
                CacheEvent::Removed { hash: 13 },
                CacheEvent::Stored {
                    hashes: vec![14],
                    parent: Some(12),
                    token_ids: vec![9, 9]
                }
            ]
        );
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.clear(), 3);
        assert!(cache.is_empty());
    }
}
