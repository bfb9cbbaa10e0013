//! The index of the workers' real caches, built from their [`EventBatch`]es.
//!
//! **Shape: a hash-chain map**, block hash → the sorted workers holding it, plus each worker's
//! set of held blocks. Block hashes are chained (hash *i* covers the whole prefix up to block
//! *i*, see [`crate::kv_events::block_hashes`]), so "the worker holds the request's block *i*"
//! already means "holds that prefix": a prefix tree would store the same facts with pointer
//! chasing and parent bookkeeping, and a flat map answers a request of B blocks by walking its
//! B hashes and intersecting holder sets. The `parent` of a Stored event is therefore not
//! needed for scoring (it stays on the wire for engines and tools that want the tree).
//!
//! **Sequence rule** (per worker, batches carry `(epoch, seq)`):
//! - the first batch of a worker, or of a newer epoch, starts it afresh (entries of an older
//!   epoch are dropped: the worker restarted cold) and is applied;
//! - `seq == last + 1`: applied;
//! - `seq <= last`, or an older epoch: a duplicate or a late batch, ignored;
//! - `seq > last + 1`: a gap (batches were lost): the worker's entries are dropped, then this
//!   batch is applied. What the index holds for the worker afterwards is what it stored since
//!   the gap: a subset of its real cache, never a block it does not hold.
//!
//! **Snapshot rule**: [`KvIndex::apply_snapshot`] replaces the worker's entries with a
//! [`KvSnapshot`]'s blocks and sets its position to the snapshot's `(epoch, seq)` (a snapshot
//! of an older epoch is ignored); live batches then apply by the rule above, so a batch the
//! snapshot already covers (`seq <=` the snapshot's) is stale and the next one is in order.
//! The router asks for one on subscribe and after a gap (docs/kv_events.md); until it arrives
//! the index learns the worker's cache from its next events (under-credit for a while, never
//! stale credit).
//!
//! **Cost.** Applying a batch costs O(blocks in it × log holders); [`KvIndex::overlaps`] for a
//! request of B blocks costs O(B + holders of the walked blocks), independent of the pool size.

use std::collections::{HashMap, HashSet};

use super::{EventBatch, KvEvent, KvSnapshot, MixState};
use crate::discovery::InstanceId;
use crate::hooks::Seam;

/// Blocks one worker may hold in the index by default (a worker claiming more is dropped from
/// the index, so one misbehaving worker cannot grow it without bound).
pub const DEFAULT_MAX_BLOCKS_PER_WORKER: usize = 1 << 20;

/// What [`KvIndex::apply`] did with a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The next batch in sequence: applied.
    InOrder,
    /// The first batch of the worker or of a newer epoch: the worker starts afresh from it.
    Started,
    /// After a gap: the worker's entries were dropped, then the batch applied.
    Resynced,
    /// A duplicate, late or older-epoch batch: ignored.
    Stale,
    /// The worker claimed more than its block limit: its entries were dropped.
    Overflowed,
}

#[derive(Debug)]
struct WorkerEntry {
    epoch: u64,
    /// The last batch applied (`None`: a snapshot taken before the epoch's first batch).
    last_seq: Option<u64>,
    blocks: HashSet<u64, MixState>,
}

/// The index of real caches: which workers hold which blocks, per their events.
#[derive(Debug)]
pub struct KvIndex {
    holders: HashMap<u64, Vec<InstanceId>, MixState>,
    workers: HashMap<InstanceId, WorkerEntry, MixState>,
    max_blocks_per_worker: usize,
    /// Where the index's mutant breaks it (see [`IndexMutant`]); zero-sized in normal builds.
    mutant: Seam<IndexMutant>,
}

/// A deliberately broken variant of the index, caught by the property tests
/// (docs/properties.md, "Mutants"; see `crate::hooks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IndexMutant {
    /// Removals are not applied.
    IgnoresRemovals,
}

impl Default for KvIndex {
    fn default() -> Self {
        KvIndex::new(DEFAULT_MAX_BLOCKS_PER_WORKER)
    }
}

impl KvIndex {
    /// An empty index holding at most `max_blocks_per_worker` blocks per worker.
    pub fn new(max_blocks_per_worker: usize) -> Self {
        KvIndex {
            holders: HashMap::default(),
            workers: HashMap::default(),
            max_blocks_per_worker: max_blocks_per_worker.max(1),
            mutant: Seam::off(),
        }
    }

    /// The index running `mutant` (the property tests must catch it).
    #[cfg(test)]
    pub(crate) fn with_mutant(mut self, mutant: IndexMutant) -> Self {
        self.mutant = Seam::on(mutant);
        self
    }

    /// Whether `worker` has published events (it is scored by the index, not by prediction).
    pub fn publishes(&self, worker: InstanceId) -> bool {
        self.workers.contains_key(&worker)
    }

    /// Workers that published.
    pub fn workers(&self) -> impl Iterator<Item = InstanceId> + '_ {
        self.workers.keys().copied()
    }

    /// Distinct blocks held by some worker.
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    /// Whether no block is held by any worker.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// Whether the index credits `worker` with `block`.
    pub fn holds(&self, worker: InstanceId, block: u64) -> bool {
        self.workers
            .get(&worker)
            .is_some_and(|w| w.blocks.contains(&block))
    }

    /// The blocks the index credits `worker` with.
    pub fn blocks_of(&self, worker: InstanceId) -> impl Iterator<Item = u64> + '_ {
        self.workers
            .get(&worker)
            .into_iter()
            .flat_map(|w| w.blocks.iter().copied())
    }

    /// Apply one batch of `worker`'s events per the sequence rule (module docs).
    pub fn apply(&mut self, worker: InstanceId, batch: &EventBatch) -> Applied {
        let outcome = match self.workers.get_mut(&worker) {
            None => {
                self.workers.insert(
                    worker,
                    WorkerEntry {
                        epoch: batch.epoch,
                        last_seq: Some(batch.seq),
                        blocks: HashSet::default(),
                    },
                );
                Applied::Started
            }
            Some(entry) if batch.epoch < entry.epoch => return Applied::Stale,
            Some(entry) if batch.epoch > entry.epoch => {
                entry.epoch = batch.epoch;
                entry.last_seq = Some(batch.seq);
                self.drop_entries(worker);
                Applied::Started
            }
            Some(entry) if entry.last_seq.is_some_and(|last| batch.seq <= last) => {
                return Applied::Stale
            }
            Some(entry)
                if entry.last_seq.map_or(Some(0), |last| last.checked_add(1))
                    == Some(batch.seq) =>
            {
                entry.last_seq = Some(batch.seq);
                Applied::InOrder
            }
            Some(entry) => {
                entry.last_seq = Some(batch.seq);
                self.drop_entries(worker);
                Applied::Resynced
            }
        };
        for event in &batch.events {
            match event {
                KvEvent::Stored { blocks, .. } => {
                    for &h in blocks {
                        if !self.store(worker, h) {
                            self.drop_entries(worker);
                            return Applied::Overflowed;
                        }
                    }
                }
                KvEvent::Removed { blocks } => {
                    if self.mutant.is(IndexMutant::IgnoresRemovals) {
                        continue;
                    }
                    for &h in blocks {
                        self.remove(worker, h);
                    }
                }
                KvEvent::Cleared => self.drop_entries(worker),
            }
        }
        outcome
    }

    /// Replace `worker`'s entries with `snapshot`'s blocks and its position with the
    /// snapshot's `(epoch, seq)`, per the snapshot rule (module docs): [`Applied::Stale`] for a
    /// snapshot of an older epoch (ignored), [`Applied::Overflowed`] past the block limit (the
    /// entries dropped), else [`Applied::Started`].
    pub fn apply_snapshot(&mut self, worker: InstanceId, snapshot: &KvSnapshot) -> Applied {
        if self
            .workers
            .get(&worker)
            .is_some_and(|entry| snapshot.epoch < entry.epoch)
        {
            return Applied::Stale;
        }
        self.drop_entries(worker);
        let entry = self.workers.entry(worker).or_insert_with(|| WorkerEntry {
            epoch: snapshot.epoch,
            last_seq: None,
            blocks: HashSet::default(),
        });
        entry.epoch = snapshot.epoch;
        entry.last_seq = snapshot.seq;
        for chain in &snapshot.chains {
            if let KvEvent::Stored { blocks, .. } = chain {
                for &h in blocks {
                    if !self.store(worker, h) {
                        self.drop_entries(worker);
                        return Applied::Overflowed;
                    }
                }
            }
        }
        Applied::Started
    }

    /// Credit `worker` with `block`; false when that would exceed its limit.
    fn store(&mut self, worker: InstanceId, block: u64) -> bool {
        let Some(entry) = self.workers.get_mut(&worker) else {
            return true;
        };
        if entry.blocks.contains(&block) {
            return true;
        }
        if entry.blocks.len() >= self.max_blocks_per_worker {
            return false;
        }
        entry.blocks.insert(block);
        let holders = self.holders.entry(block).or_default();
        if let Err(at) = holders.binary_search(&worker) {
            holders.insert(at, worker);
        }
        true
    }

    fn remove(&mut self, worker: InstanceId, block: u64) {
        let Some(entry) = self.workers.get_mut(&worker) else {
            return;
        };
        if entry.blocks.remove(&block) {
            self.unhold(worker, block);
        }
    }

    fn unhold(&mut self, worker: InstanceId, block: u64) {
        if let Some(holders) = self.holders.get_mut(&block) {
            if let Ok(at) = holders.binary_search(&worker) {
                holders.remove(at);
            }
            if holders.is_empty() {
                self.holders.remove(&block);
            }
        }
    }

    /// Drop what `worker` is credited with, keeping its sequence position.
    fn drop_entries(&mut self, worker: InstanceId) {
        let Some(entry) = self.workers.get_mut(&worker) else {
            return;
        };
        let blocks = std::mem::take(&mut entry.blocks);
        for block in blocks {
            self.unhold(worker, block);
        }
    }

    /// Forget `worker` entirely (it left admission or discovery, or its event stream
    /// reconnected): its entries go and its next batch starts it afresh.
    pub fn remove_worker(&mut self, worker: InstanceId) {
        self.drop_entries(worker);
        self.workers.remove(&worker);
    }

    /// Keep only the workers `keep` accepts.
    pub fn retain_workers(&mut self, mut keep: impl FnMut(InstanceId) -> bool) {
        let gone: Vec<InstanceId> = self.workers.keys().copied().filter(|&w| !keep(w)).collect();
        for w in gone {
            self.remove_worker(w);
        }
    }

    /// For a request's chained block `hashes`: every worker holding at least its first block,
    /// with how many leading blocks it holds, written to `out` (cleared first) sorted by
    /// worker. Costs O(B + holders of the walked blocks); a block held by exactly the workers
    /// still matching (a shared prefix) costs one memory comparison.
    pub fn overlaps(&self, hashes: &[u64], out: &mut Vec<(InstanceId, usize)>) {
        out.clear();
        let Some(first) = hashes.first().and_then(|h| self.holders.get(h)) else {
            return;
        };
        let depth = hashes.len();
        // While every holder of the first block still matches, `active` is not materialised.
        let mut i = 1;
        while i < hashes.len() {
            match self.holders.get(&hashes[i]) {
                Some(next) if next == first => i += 1,
                _ => break,
            }
        }
        out.extend(first.iter().map(|&w| (w, depth)));
        self.narrow(hashes, i, out);
    }

    /// How many workers hold `block`.
    pub fn held_by(&self, block: u64) -> usize {
        self.holders.get(&block).map_or(0, Vec::len)
    }

    /// The holders of a request's deep blocks only: with `k` the first block of `hashes` held
    /// by at most `limit` workers, every worker holding blocks `0..=k`, with its leading
    /// blocks, written to `out` (cleared first) sorted by worker; returns `k`. Every worker
    /// *not* listed holds at most `k` leading blocks. So a shared prefix held by the whole pool
    /// costs O(k) here instead of O(pool) (the caller bounds the rest with the load order).
    /// `k == 0` is [`overlaps`](Self::overlaps); `k == hashes.len()` (every block widely held)
    /// lists nobody.
    pub fn deep_overlaps(
        &self,
        hashes: &[u64],
        limit: usize,
        out: &mut Vec<(InstanceId, usize)>,
    ) -> usize {
        let k = hashes
            .iter()
            .position(|&h| self.held_by(h) <= limit)
            .unwrap_or(hashes.len());
        if k == 0 {
            self.overlaps(hashes, out);
            return 0;
        }
        out.clear();
        let Some(deep) = hashes.get(k).and_then(|h| self.holders.get(h)) else {
            return k;
        };
        out.extend(
            deep.iter()
                .filter(|w| {
                    self.workers
                        .get(w)
                        .is_some_and(|e| hashes[..k].iter().all(|h| e.blocks.contains(h)))
                })
                .map(|&w| (w, hashes.len())),
        );
        self.narrow(hashes, k + 1, out);
        k
    }

    /// `out` lists workers (sorted) holding every block before `from`, with a depth of
    /// `hashes.len()`: walk the blocks from `from` on and set each worker's depth to its
    /// first missing block.
    fn narrow(&self, hashes: &[u64], from: usize, out: &mut [(InstanceId, usize)]) {
        if from >= hashes.len() || out.is_empty() {
            return;
        }
        // Positions in `out` still matching, ascending (so `out` stays sorted by worker).
        let mut active: Vec<usize> = (0..out.len()).collect();
        let mut kept: Vec<usize> = Vec::with_capacity(active.len());
        for (i, h) in hashes.iter().enumerate().skip(from) {
            let next: &[InstanceId] = self.holders.get(h).map_or(&[], Vec::as_slice);
            kept.clear();
            if next.len() > 8 * active.len() {
                // Much longer: binary searches, O(|active| log |next|).
                for &at in &active {
                    if next.binary_search(&out[at].0).is_ok() {
                        kept.push(at);
                    } else {
                        out[at].1 = i;
                    }
                }
            } else {
                // A merge of two sorted lists, O(|active| + |next|).
                let mut j = 0;
                for &at in &active {
                    let w = out[at].0;
                    while j < next.len() && next[j] < w {
                        j += 1;
                    }
                    if j < next.len() && next[j] == w {
                        kept.push(at);
                    } else {
                        out[at].1 = i;
                    }
                }
            }
            std::mem::swap(&mut active, &mut kept);
            if active.is_empty() {
                return;
            }
        }
    }

    /// Leading blocks of `hashes` the index credits `worker` with.
    pub fn overlap(&self, hashes: &[u64], worker: InstanceId) -> usize {
        let Some(entry) = self.workers.get(&worker) else {
            return 0;
        };
        hashes
            .iter()
            .take_while(|h| entry.blocks.contains(h))
            .count()
    }
}

#[cfg(test)]
mod tests;
