//! A bounded LRU set of KV block hashes, optionally publishing its changes as KV events.

use std::collections::{BTreeMap, HashMap, HashSet};

use prefill_router::kv_events::{EventBatch, EventPublisher, KvEvent, KvSnapshot};

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
    /// Where stores and evictions are reported, for a cache that publishes KV events.
    events: Option<EventPublisher>,
    /// Held block -> the block it extends, kept only by a cache that publishes (its
    /// snapshots carry the chains).
    parents: HashMap<u64, Option<u64>>,
}

impl BlockCache {
    /// An empty cache of `capacity` blocks (0 caches nothing).
    pub fn new(capacity: usize) -> Self {
        BlockCache {
            capacity,
            stamps: HashMap::new(),
            order: BTreeMap::new(),
            clock: 0,
            events: None,
            parents: HashMap::new(),
        }
    }

    /// An empty cache of `capacity` blocks that publishes its changes (blocks stored or reused
    /// by a prefill, blocks evicted) as KV events of incarnation `epoch`; take them with
    /// [`take_event_batches`](Self::take_event_batches).
    pub fn with_events(capacity: usize, epoch: u64) -> Self {
        BlockCache {
            events: Some(EventPublisher::new(epoch)),
            ..BlockCache::new(capacity)
        }
    }

    /// The changes since the last call, as numbered batches (empty for a cache that does not
    /// publish, or when nothing changed).
    pub fn take_event_batches(&mut self) -> Vec<EventBatch> {
        self.events
            .as_mut()
            .map(EventPublisher::take_batches)
            .unwrap_or_default()
    }

    /// The whole cache as chains, consistent with the batches taken so far (see
    /// [`KvSnapshot`]); `None` for a cache that does not publish. Every held block appears
    /// once, after its parent when the parent is held; least recently used chains first.
    pub fn snapshot(&self) -> Option<KvSnapshot> {
        self.snapshot_copy().map(SnapshotCopy::into_snapshot)
    }

    /// What [`snapshot`](Self::snapshot) needs, copied in one sequential pass: take it under
    /// the lock the event batches are taken under (the consistency point), and build the
    /// chains with [`SnapshotCopy::into_snapshot`] after releasing it, so a large cache stalls
    /// the worker's prefills for a copy, not for the chain building.
    pub fn snapshot_copy(&self) -> Option<SnapshotCopy> {
        let events = self.events.as_ref()?;
        Some(SnapshotCopy {
            epoch: events.epoch(),
            seq: events.snapshot_seq(),
            blocks: self
                .order
                .values()
                .map(|&b| (b, self.parents.get(&b).copied().flatten()))
                .collect(),
        })
    }

    /// Whether `hash` is held (no touch).
    pub fn contains(&self, hash: u64) -> bool {
        self.stamps.contains_key(&hash)
    }

    /// The held block hashes, in no particular order.
    pub fn blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.stamps.keys().copied()
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
        let mut parent = None;
        for &h in hashes {
            self.touch(parent, h);
            parent = Some(h);
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

    fn touch(&mut self, parent: Option<u64>, hash: u64) {
        if self.capacity == 0 {
            return;
        }
        self.clock += 1;
        if let Some(old) = self.stamps.insert(hash, self.clock) {
            self.order.remove(&old);
        }
        // Every block a prefill uses is announced, new or reused: a Stored event for a block
        // the index already credits is a no-op, and after a gap (the index dropped this
        // worker's entries) the hot prefixes come back at their next use, with no snapshot.
        if let Some(events) = &mut self.events {
            events.stored(parent, hash);
            self.parents.insert(hash, parent);
        }
        self.order.insert(self.clock, hash);
        while self.stamps.len() > self.capacity {
            match self.order.pop_first() {
                Some((_, evicted)) => {
                    self.stamps.remove(&evicted);
                    if let Some(events) = &mut self.events {
                        events.removed(evicted);
                        self.parents.remove(&evicted);
                    }
                }
                None => break,
            }
        }
    }
}

/// A cache's blocks at one point of its event stream (see [`BlockCache::snapshot_copy`]).
#[derive(Debug)]
pub struct SnapshotCopy {
    epoch: u64,
    seq: Option<u64>,
    /// Held blocks with their parents, least recently used first.
    blocks: Vec<(u64, Option<u64>)>,
}

impl SnapshotCopy {
    /// The copy as a snapshot: every block once, after its parent when the parent is held.
    pub fn into_snapshot(self) -> KvSnapshot {
        let parents: HashMap<u64, Option<u64>> = self.blocks.iter().copied().collect();
        let mut emitted: HashSet<u64> = HashSet::with_capacity(parents.len());
        let mut chains: Vec<KvEvent> = Vec::new();
        let mut path = Vec::new();
        for &(hash, _) in &self.blocks {
            // The block and its held ancestors not yet emitted, emitted root first (bounded:
            // a cycle of colliding hashes cannot loop).
            path.clear();
            let mut at = Some(hash);
            while let Some(b) = at {
                let Some(&parent) = parents.get(&b) else {
                    break;
                };
                if emitted.contains(&b) || path.len() > parents.len() {
                    break;
                }
                path.push((b, parent));
                at = parent;
            }
            for &(b, parent) in path.iter().rev() {
                if !emitted.insert(b) {
                    continue;
                }
                match chains.last_mut() {
                    Some(KvEvent::Stored { blocks, .. })
                        if parent.is_some() && blocks.last() == parent.as_ref() =>
                    {
                        blocks.push(b);
                    }
                    _ => chains.push(KvEvent::Stored {
                        parent,
                        blocks: vec![b],
                    }),
                }
            }
        }
        KvSnapshot {
            epoch: self.epoch,
            seq: self.seq,
            chains,
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
    fn an_index_fed_the_caches_events_holds_exactly_the_cache() {
        use prefill_router::kv_events::KvIndex;
        let mut cache = BlockCache::with_events(5, 1);
        let mut index = KvIndex::default();
        for request in [&[1, 2, 3][..], &[1, 2, 4, 5], &[6, 7, 8], &[1, 2, 3, 9]] {
            cache.prefill(request);
            for batch in cache.take_event_batches() {
                index.apply(3, &batch);
            }
            let mut held: Vec<u64> = cache.blocks().collect();
            let mut credited: Vec<u64> = index.blocks_of(3).collect();
            held.sort_unstable();
            credited.sort_unstable();
            assert_eq!(held, credited, "after {request:?}");
        }
    }

    #[test]
    fn a_snapshot_holds_every_block_once_after_its_held_parent() {
        let mut cache = BlockCache::with_events(6, 1);
        for request in [&[1, 2, 3][..], &[1, 2, 4], &[5, 6], &[1]] {
            cache.prefill(request);
        }
        cache.take_event_batches();
        let snapshot = cache.snapshot().expect("a publishing cache");
        assert_eq!((snapshot.epoch, snapshot.seq), (1, Some(0)));
        let mut order = Vec::new();
        for chain in &snapshot.chains {
            let KvEvent::Stored { parent, blocks } = chain else {
                panic!("Stored only: {chain:?}");
            };
            if let Some(p) = parent.filter(|p| cache.contains(*p)) {
                assert!(order.contains(&p), "parent {p} before {blocks:?}");
            }
            order.extend(blocks);
        }
        let mut held: Vec<u64> = cache.blocks().collect();
        held.sort_unstable();
        order.sort_unstable();
        assert_eq!(order, held);
        assert!(BlockCache::new(4).snapshot().is_none());
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut cache = BlockCache::new(0);
        cache.prefill(&[1, 2]);
        assert_eq!(cache.prefill(&[1, 2]), 0);
        assert!(cache.is_empty());
    }
}
