//! KV cache events: what a worker's cache really holds, as the worker reports it.
//!
//! A worker publishes its KV cache changes (blocks stored, with the block they extend; blocks
//! removed; cache cleared) in [`EventBatch`]es numbered per worker. The router indexes them in
//! a [`KvIndex`] and scores a worker by the leading blocks of a request it holds *now*, instead
//! of predicting it from past routing (see [`crate::push::KvSelector`] and docs/kv_events.md).
//!
//! Everything here is pure and synchronous (no I/O, no clock): the wire decoder
//! [`decode_events`] is driven by the fuzzer, the index by property tests.
//!
//! - [`wire`]: the versioned, bounded wire format ([`encode_events`], [`decode_events`]).
//! - [`engine_wire`]: vLLM's and SGLang's own msgpack event batches ([`decode_engine_batch`],
//!   [`encode_engine_batch`]), pure and bounded like [`wire`].
//! - [`index`]: the index of real caches ([`KvIndex`]) and its sequence rule.
//! - [`engine_mirror`]: an engine's (vLLM's, SGLang's) published events kept exact and
//!   translated into our own content hashes ([`EngineMirror`]).
//! - [`snapshot`]: a worker's whole cache at one point of its stream ([`KvSnapshot`]), in
//!   bounded chunks.
//! - [`EventPublisher`]: the worker side, which numbers batches and keeps them bounded.

pub mod engine_mirror;
pub mod engine_wire;
pub mod index;
pub mod snapshot;
pub mod wire;

pub use engine_mirror::{EngineMirror, MirrorAction, MirrorCounts, MirrorError, Picture};
pub use engine_wire::{
    decode_engine_batch, encode_engine_batch, EngineBatch, EngineDecodeError, EngineEncoding,
    EngineEvent, EngineEventKind, InvalidEvent, Skipped, StoredBlocks, MAX_ENGINE_BATCH_BYTES,
    MAX_ENGINE_EVENTS, MAX_ENGINE_HASHES, MAX_ENGINE_TOKENS,
};
pub use index::{Applied, KvIndex, DEFAULT_MAX_BLOCKS_PER_WORKER};
pub use snapshot::{KvSnapshot, SnapshotAssembler, SnapshotError, SNAPSHOT_CHUNK_BLOCKS};
pub use wire::{
    decode_events, encode_events, EventDecodeError, EventEncodeError, MAX_BLOCKS_PER_BATCH,
    MAX_EVENTS_PER_BATCH, WIRE_VERSION,
};

/// The splitmix64 finaliser: a cheap, well-mixed 64-bit hash step.
pub(crate) use crate::rng::finalize as mix;

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
    let mut parent = None;
    for block in token_ids.chunks_exact(size) {
        let h = extend_hash(parent, block);
        hashes.push(h);
        parent = Some(h);
    }
    hashes
}

/// The chained hash of `block` extending the block hashed `parent` (`None`: the prompt's first
/// block): the step of [`block_hashes`], for a consumer that learns blocks one chain at a time
/// (an engine's events, [`engine_mirror`]).
pub fn extend_hash(parent: Option<u64>, block: &[u32]) -> u64 {
    let mut h = parent.unwrap_or(crate::rng::GAMMA);
    for &t in block {
        h = mix(h ^ u64::from(t));
    }
    h
}

/// Hasher for keys that are `u64`s: one splitmix step instead of SipHash. Keys here are
/// block hashes and instance ids chosen by our own code, workers or discovery, not by request
/// senders (block hashes are derived from token ids, but through the keyed-by-nothing chain; a
/// collision flood costs only lookup time, bounded by the index capacity).
#[derive(Clone, Copy, Default)]
pub(crate) struct MixHasher(u64);

impl std::hash::Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = mix(self.0 ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = mix(self.0 ^ n);
    }
}

/// `BuildHasher` for [`MixHasher`].
pub(crate) type MixState = std::hash::BuildHasherDefault<MixHasher>;

/// One change of a worker's KV cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks now held, a chain in prompt order: `blocks[0]` extends `parent` (`None`: the
    /// chain starts at the prompt's first block), `blocks[i]` extends `blocks[i - 1]`.
    Stored {
        /// The block the chain extends.
        parent: Option<u64>,
        /// The block hashes (never empty on the wire).
        blocks: Vec<u64>,
    },
    /// Blocks no longer held (evicted or freed).
    Removed {
        /// The block hashes.
        blocks: Vec<u64>,
    },
    /// Every block dropped (the cache was reset).
    Cleared,
}

impl KvEvent {
    /// Block hashes the event names.
    pub fn block_count(&self) -> usize {
        match self {
            KvEvent::Stored { blocks, .. } | KvEvent::Removed { blocks } => blocks.len(),
            KvEvent::Cleared => 0,
        }
    }
}

/// One worker's cache changes since its previous batch, in the order they happened.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventBatch {
    /// The worker's incarnation: it increases when the worker restarts (cold cache), so a
    /// batch of an older incarnation is recognised as stale.
    pub epoch: u64,
    /// Position in the worker's stream of batches (per epoch, +1 per batch).
    pub seq: u64,
    /// The changes.
    pub events: Vec<KvEvent>,
}

impl EventBatch {
    /// Block hashes over all events.
    pub fn block_count(&self) -> usize {
        self.events.iter().map(KvEvent::block_count).sum()
    }
}

/// Pending block events a publisher keeps before it gives up on them (a consumer that does not
/// drain): they are dropped and the next batch skips a sequence number, so every index sees a
/// gap and drops the worker's entries rather than credit blocks from a partial history.
pub const MAX_PENDING_BLOCKS: usize = 64 * MAX_BLOCKS_PER_BATCH;

/// The worker side of the event stream: collects cache changes, merges adjacent ones, and
/// hands them out as numbered batches within the wire bounds. Memory is bounded by
/// [`MAX_PENDING_BLOCKS`] whether or not anyone drains it.
#[derive(Debug)]
pub struct EventPublisher {
    epoch: u64,
    next_seq: u64,
    pending: Vec<KvEvent>,
    pending_blocks: usize,
    /// Pending events were dropped: the next batch skips a number.
    overflowed: bool,
}

impl EventPublisher {
    /// A publisher for a worker incarnation `epoch` (larger than any earlier incarnation's).
    /// Its first batch opens with [`KvEvent::Cleared`]: the worker announces that it publishes
    /// and that its new incarnation starts cold (an index still crediting the previous one
    /// drops that credit).
    pub fn new(epoch: u64) -> Self {
        EventPublisher {
            epoch,
            next_seq: 0,
            pending: vec![KvEvent::Cleared],
            pending_blocks: 0,
            overflowed: false,
        }
    }

    /// The incarnation.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    fn room(&mut self) {
        if self.pending_blocks >= MAX_PENDING_BLOCKS {
            self.pending.clear();
            self.pending_blocks = 0;
            self.overflowed = true;
        }
        self.pending_blocks += 1;
    }

    /// Block `hash` is now held; it extends `parent`.
    pub fn stored(&mut self, parent: Option<u64>, hash: u64) {
        self.room();
        if let Some(KvEvent::Stored { blocks, .. }) = self.pending.last_mut() {
            if parent.is_some() && blocks.last() == parent.as_ref() {
                blocks.push(hash);
                return;
            }
        }
        self.pending.push(KvEvent::Stored {
            parent,
            blocks: vec![hash],
        });
    }

    /// Block `hash` is no longer held.
    pub fn removed(&mut self, hash: u64) {
        self.room();
        if let Some(KvEvent::Removed { blocks }) = self.pending.last_mut() {
            blocks.push(hash);
            return;
        }
        self.pending.push(KvEvent::Removed { blocks: vec![hash] });
    }

    /// Every block was dropped (earlier pending changes no longer matter).
    pub fn cleared(&mut self) {
        self.pending.clear();
        self.pending_blocks = 0;
        self.pending.push(KvEvent::Cleared);
    }

    /// The `seq` a snapshot of the cache taken now is consistent with (see
    /// [`KvSnapshot::seq`]): the last batch handed out, or the number the next batch skips
    /// when pending changes were dropped (the cache state covers them, so that batch applies
    /// in order after the snapshot). Call it under the same lock as [`take_batches`](Self::take_batches).
    pub fn snapshot_seq(&self) -> Option<u64> {
        (self.next_seq + u64::from(self.overflowed)).checked_sub(1)
    }

    /// Whether changes wait to be taken.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The pending changes as batches within [`MAX_EVENTS_PER_BATCH`] and
    /// [`MAX_BLOCKS_PER_BATCH`], numbered consecutively (after a skipped number if pending
    /// changes were dropped). Empty when nothing changed.
    pub fn take_batches(&mut self) -> Vec<EventBatch> {
        if self.pending.is_empty() {
            return Vec::new();
        }
        if std::mem::take(&mut self.overflowed) {
            self.next_seq += 1;
        }
        self.pending_blocks = 0;
        let mut batches = Vec::new();
        let mut current = EventBatch {
            epoch: self.epoch,
            seq: self.next_seq,
            events: Vec::new(),
        };
        let mut blocks = 0;
        for event in std::mem::take(&mut self.pending) {
            // Split long events so that each fits a batch.
            let mut parts = Vec::new();
            match event {
                KvEvent::Stored { parent, blocks } => {
                    let mut parent = parent;
                    for chunk in blocks.chunks(MAX_BLOCKS_PER_BATCH) {
                        parts.push(KvEvent::Stored {
                            parent,
                            blocks: chunk.to_vec(),
                        });
                        parent = chunk.last().copied();
                    }
                }
                KvEvent::Removed { blocks } => {
                    for chunk in blocks.chunks(MAX_BLOCKS_PER_BATCH) {
                        parts.push(KvEvent::Removed {
                            blocks: chunk.to_vec(),
                        });
                    }
                }
                KvEvent::Cleared => parts.push(KvEvent::Cleared),
            }
            for part in parts {
                let n = part.block_count();
                if current.events.len() >= MAX_EVENTS_PER_BATCH || blocks + n > MAX_BLOCKS_PER_BATCH
                {
                    self.next_seq += 1;
                    let next = EventBatch {
                        epoch: self.epoch,
                        seq: self.next_seq,
                        events: Vec::new(),
                    };
                    batches.push(std::mem::replace(&mut current, next));
                    blocks = 0;
                }
                blocks += n;
                current.events.push(part);
            }
        }
        self.next_seq += 1;
        batches.push(current);
        batches
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publisher_merges_chains_and_numbers_batches_consecutively() {
        let mut p = EventPublisher::new(1);
        p.stored(None, 10);
        p.stored(Some(10), 11);
        p.removed(3);
        p.removed(4);
        let batches = p.take_batches();
        assert_eq!(
            batches,
            vec![EventBatch {
                epoch: 1,
                seq: 0,
                events: vec![
                    KvEvent::Cleared,
                    KvEvent::Stored {
                        parent: None,
                        blocks: vec![10, 11]
                    },
                    KvEvent::Removed { blocks: vec![3, 4] },
                ],
            }]
        );
        assert!(p.take_batches().is_empty());
        p.stored(None, 12);
        assert_eq!(p.take_batches()[0].seq, 1);
    }

    #[test]
    fn a_publisher_splits_within_the_wire_bounds() {
        let mut p = EventPublisher::new(0);
        let mut parent = None;
        for h in 0..(2 * MAX_BLOCKS_PER_BATCH as u64 + 5) {
            p.stored(parent, h);
            parent = Some(h);
        }
        let batches = p.take_batches();
        assert_eq!(batches.len(), 3);
        for (i, b) in batches.iter().enumerate() {
            assert_eq!(b.seq, i as u64);
            assert!(encode_events(b).is_ok());
        }
    }

    #[test]
    fn an_undrained_publisher_stays_bounded_and_forces_a_gap() {
        let mut p = EventPublisher::new(0);
        p.stored(None, 1);
        assert_eq!(p.take_batches()[0].seq, 0);
        for h in 0..(MAX_PENDING_BLOCKS as u64 + 10) {
            p.removed(h);
        }
        assert!(p.pending_blocks <= MAX_PENDING_BLOCKS);
        let batches = p.take_batches();
        assert_eq!(batches[0].seq, 2, "seq 1 skipped: the dropped changes");
    }

    #[test]
    fn a_snapshot_seq_is_the_last_batch_handed_out_or_the_skipped_one() {
        let mut p = EventPublisher::new(0);
        assert_eq!(p.snapshot_seq(), None, "nothing handed out yet");
        p.stored(None, 1);
        p.take_batches();
        assert_eq!(p.snapshot_seq(), Some(0));
        p.stored(None, 2);
        assert_eq!(
            p.snapshot_seq(),
            Some(0),
            "pending changes are not handed out"
        );
        for h in 0..(MAX_PENDING_BLOCKS as u64 + 10) {
            p.removed(h);
        }
        assert_eq!(p.snapshot_seq(), Some(1), "the skipped number is covered");
        assert_eq!(p.take_batches()[0].seq, 2);
    }
}
