//! A bounded LRU set of KV block hashes.

use std::collections::{BTreeMap, HashMap};

/// The KV blocks one mock worker holds: at most `capacity` block hashes, least recently used
/// evicted first. Memory is bounded by the capacity whatever the traffic.
#[derive(Debug)]
pub struct BlockCache {
    capacity: usize,
    /// Block hash -> stamp of its last use.
    stamps: HashMap<u64, u64>,
    /// Stamp -> block hash, oldest first: the eviction order.
    order: BTreeMap<u64, u64>,
    clock: u64,
}

impl BlockCache {
    /// An empty cache of `capacity` blocks (0 caches nothing).
    pub fn new(capacity: usize) -> Self {
        BlockCache {
            capacity,
            stamps: HashMap::new(),
            order: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.stamps.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.stamps.is_empty()
    }

    /// Prefill a chain of block hashes: returns how many *leading* blocks were already cached
    /// (a KV cache reuses a prefix only, so a hit after a miss does not count), then holds all
    /// of them as most recently used.
    pub fn prefill(&mut self, hashes: &[u64]) -> usize {
        let hits = hashes
            .iter()
            .take_while(|h| self.stamps.contains_key(h))
            .count();
        for &h in hashes {
            self.touch(h);
        }
        hits
    }

    /// How many leading blocks of `hashes` are cached, without touching anything (what a
    /// router fed by the worker's KV events would know).
    pub fn leading_hits(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.stamps.contains_key(h))
            .count()
    }

    fn touch(&mut self, hash: u64) {
        if self.capacity == 0 {
            return;
        }
        self.clock += 1;
        if let Some(old) = self.stamps.insert(hash, self.clock) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, hash);
        while self.stamps.len() > self.capacity {
            match self.order.pop_first() {
                Some((_, evicted)) => {
                    self.stamps.remove(&evicted);
                }
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_leading_cached_run_counts_as_hits() {
        let mut cache = BlockCache::new(16);
        assert_eq!(cache.prefill(&[1, 2, 3]), 0);
        assert_eq!(cache.prefill(&[1, 2, 3, 4]), 3);
        assert_eq!(cache.prefill(&[9, 2, 3]), 0);
    }

    #[test]
    fn cache_never_exceeds_its_capacity_and_evicts_least_recent() {
        let mut cache = BlockCache::new(3);
        cache.prefill(&[1, 2, 3]);
        cache.prefill(&[1]); // 1 is now the most recent
        cache.prefill(&[4]); // evicts 2
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.prefill(&[1]), 1);
        assert_eq!(cache.prefill(&[2]), 0);
        assert!(cache.len() <= 3);
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut cache = BlockCache::new(0);
        cache.prefill(&[1, 2]);
        assert_eq!(cache.prefill(&[1, 2]), 0);
        assert!(cache.is_empty());
    }
}
