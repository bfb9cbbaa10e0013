//! A worker's whole KV cache at one point of its event stream, cut into bounded chunks for the
//! wire and reassembled on the router side.
//!
//! **Consistency.** A [`KvSnapshot`] holds the blocks the worker's cache held when it was
//! taken and `seq`, the last batch the worker had handed out by then (taken under the same lock
//! as the batches, so atomically with respect to the stream). Every change in a batch up to
//! `seq` is in the snapshot; a change not yet handed out may also be in it, which is harmless:
//! the batch carrying it applies after the snapshot (`seq` larger), and re-applying a store or
//! removal to a state that already has it changes nothing.
//!
//! **Chunks.** [`KvSnapshot::chunks`] cuts the blocks into [`EventBatch`]es within the batch
//! bounds ([`MAX_BLOCKS_PER_BATCH`] blocks, [`MAX_EVENTS_PER_BATCH`] chains), numbered from
//! 0 in their `seq` field and carrying the snapshot's epoch, so each chunk travels in the
//! fuzzed, bounded v1 batch encoding. [`SnapshotAssembler`] checks them back in order, Stored
//! events only, at most a given number of blocks in all.

use super::{EventBatch, KvEvent, MAX_BLOCKS_PER_BATCH, MAX_EVENTS_PER_BATCH};

/// Block hashes in one snapshot chunk, at most: a chunk is a v1 batch, so the batch bound.
pub const SNAPSHOT_CHUNK_BLOCKS: usize = MAX_BLOCKS_PER_BATCH;

/// A worker's cached blocks, consistent with its event stream up to `seq`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvSnapshot {
    /// The worker's incarnation (as in its batches).
    pub epoch: u64,
    /// The last batch of `epoch` the worker had handed out when the snapshot was taken: live
    /// batches with a larger `seq` apply after it. `None`: none yet (the epoch's batch 0 and
    /// later all apply after it).
    pub seq: Option<u64>,
    /// The held blocks as chains, [`KvEvent::Stored`] only, parents before their children
    /// where the parent is held.
    pub chains: Vec<KvEvent>,
}

impl KvSnapshot {
    /// Block hashes over all chains.
    pub fn block_count(&self) -> usize {
        self.chains.iter().map(KvEvent::block_count).sum()
    }

    /// The snapshot as chunks within the batch bounds, in order: chunk `i` has `seq == i`
    /// and the snapshot's epoch. Chains longer than a chunk are split (each part's parent is
    /// the previous part's last block); events other than Stored, and empty ones, are left
    /// out. A snapshot without blocks is one empty chunk, so the router still hears its `seq`.
    pub fn chunks(&self) -> Vec<EventBatch> {
        let mut chunks = Vec::new();
        let mut current = EventBatch {
            epoch: self.epoch,
            seq: 0,
            events: Vec::new(),
        };
        let mut blocks = 0;
        for chain in &self.chains {
            let KvEvent::Stored {
                parent,
                blocks: hashes,
            } = chain
            else {
                continue;
            };
            let mut parent = *parent;
            let mut rest = hashes.as_slice();
            while !rest.is_empty() {
                if current.events.len() >= MAX_EVENTS_PER_BATCH || blocks >= SNAPSHOT_CHUNK_BLOCKS {
                    let next = EventBatch {
                        epoch: self.epoch,
                        seq: current.seq + 1,
                        events: Vec::new(),
                    };
                    chunks.push(std::mem::replace(&mut current, next));
                    blocks = 0;
                }
                let take = rest.len().min(SNAPSHOT_CHUNK_BLOCKS - blocks);
                let (part, tail) = rest.split_at(take);
                current.events.push(KvEvent::Stored {
                    parent,
                    blocks: part.to_vec(),
                });
                blocks += take;
                parent = part.last().copied();
                rest = tail;
            }
        }
        chunks.push(current);
        chunks
    }
}

/// Why a snapshot could not be taken or reassembled.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The worker takes no snapshots (or an older build ignored the request).
    #[error("the worker takes no KV snapshots")]
    Unsupported,
    /// A chunk out of order, of another epoch, or for another `seq` than the first chunk's.
    #[error("snapshot chunk {got} out of order (expected chunk {expected})")]
    OutOfOrder {
        /// The chunk index expected.
        expected: u64,
        /// The chunk index received.
        got: u64,
    },
    /// A chunk whose epoch or snapshot seq differs from the first chunk's.
    #[error("snapshot chunk disagrees with the first chunk on epoch or seq")]
    Mismatch,
    /// A chunk holding a Removed or Cleared event.
    #[error("snapshot chunk holds an event other than Stored")]
    NotStored,
    /// More blocks than the router keeps for one worker.
    #[error("snapshot exceeds {max} blocks")]
    TooLarge {
        /// The bound.
        max: usize,
    },
    /// A chunk frame that is not a valid v1 batch (or is oversize).
    #[error("undecodable snapshot chunk: {0}")]
    Malformed(String),
    /// The event stream lost a batch while the snapshot streamed.
    #[error("the event stream lost a batch while the snapshot streamed")]
    Gap,
    /// More live batches arrived than the router buffers while a snapshot streams.
    #[error("more than {max} live batches arrived while the snapshot streamed")]
    BufferFull {
        /// The bound.
        max: usize,
    },
    /// The worker did not finish the snapshot within the router's wait.
    #[error("the snapshot did not complete in time")]
    Timeout,
}

/// Reassembles a snapshot from its chunks (pure; the router side's state for one snapshot).
#[derive(Debug)]
pub struct SnapshotAssembler {
    max_blocks: usize,
    /// `(epoch, seq)` of the first chunk.
    head: Option<(u64, Option<u64>)>,
    next_chunk: u64,
    blocks: usize,
    chains: Vec<KvEvent>,
}

impl SnapshotAssembler {
    /// An assembler refusing snapshots of more than `max_blocks` blocks (the router's
    /// per-worker bound: more would be dropped by the index anyway).
    pub fn new(max_blocks: usize) -> Self {
        SnapshotAssembler {
            max_blocks,
            head: None,
            next_chunk: 0,
            blocks: 0,
            chains: Vec::new(),
        }
    }

    /// Take one chunk (`chunk.seq` is its index) of the snapshot consistent with `seq`;
    /// `last` marks the final chunk. Returns the snapshot once the last chunk is in.
    ///
    /// # Errors
    /// [`SnapshotError`] for a chunk out of order, disagreeing with the first, holding other
    /// than Stored events, or past `max_blocks`; the assembler is then of no further use.
    pub fn push(
        &mut self,
        seq: Option<u64>,
        last: bool,
        chunk: EventBatch,
    ) -> Result<Option<KvSnapshot>, SnapshotError> {
        if chunk.seq != self.next_chunk {
            return Err(SnapshotError::OutOfOrder {
                expected: self.next_chunk,
                got: chunk.seq,
            });
        }
        match self.head {
            None => self.head = Some((chunk.epoch, seq)),
            Some(head) if head != (chunk.epoch, seq) => return Err(SnapshotError::Mismatch),
            Some(_) => {}
        }
        self.next_chunk += 1;
        for event in chunk.events {
            if !matches!(event, KvEvent::Stored { .. }) {
                return Err(SnapshotError::NotStored);
            }
            self.blocks += event.block_count();
            if self.blocks > self.max_blocks {
                return Err(SnapshotError::TooLarge {
                    max: self.max_blocks,
                });
            }
            self.chains.push(event);
        }
        if !last {
            return Ok(None);
        }
        Ok(Some(KvSnapshot {
            epoch: chunk.epoch,
            seq,
            chains: std::mem::take(&mut self.chains),
        }))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::kv_events::{decode_events, encode_events};

    fn chains() -> impl Strategy<Value = Vec<KvEvent>> {
        proptest::collection::vec(
            (
                proptest::option::of(any::<u64>()),
                proptest::collection::vec(any::<u64>(), 1..40),
            )
                .prop_map(|(parent, blocks)| KvEvent::Stored { parent, blocks }),
            0..60,
        )
    }

    /// The blocks of `events` in order, one chain's split parts joined back.
    fn flat(events: &[KvEvent]) -> Vec<u64> {
        events
            .iter()
            .flat_map(|e| match e {
                KvEvent::Stored { blocks, .. } => blocks.clone(),
                _ => Vec::new(),
            })
            .collect()
    }

    fn round_trip(snapshot: &KvSnapshot) -> (usize, KvSnapshot) {
        let chunks = snapshot.chunks();
        let n = chunks.len();
        let mut assembler = SnapshotAssembler::new(usize::MAX);
        let mut done = None;
        for (i, chunk) in chunks.into_iter().enumerate() {
            let bytes = encode_events(&chunk).expect("a chunk is within the batch bounds");
            let decoded = decode_events(&bytes).expect("decodes");
            let out = assembler
                .push(snapshot.seq, i + 1 == n, decoded)
                .expect("in order");
            assert_eq!(out.is_some(), i + 1 == n);
            done = out;
        }
        (n, done.expect("the last chunk completes it"))
    }

    proptest! {
        #[test]
        fn chunks_encode_and_reassemble_to_the_same_blocks(
            chains in chains(),
            epoch in any::<u64>(),
            seq in proptest::option::of(any::<u64>()),
        ) {
            let snapshot = KvSnapshot { epoch, seq, chains };
            let (_, back) = round_trip(&snapshot);
            prop_assert_eq!(back.epoch, epoch);
            prop_assert_eq!(back.seq, seq);
            prop_assert_eq!(flat(&back.chains), flat(&snapshot.chains));
        }
    }

    #[test]
    fn a_cache_larger_than_a_chunk_spans_several_chunks_with_linked_parts() {
        let blocks: Vec<u64> = (1..=(2 * SNAPSHOT_CHUNK_BLOCKS as u64 + 7)).collect();
        let snapshot = KvSnapshot {
            epoch: 3,
            seq: Some(9),
            chains: vec![KvEvent::Stored {
                parent: None,
                blocks: blocks.clone(),
            }],
        };
        let chunks = snapshot.chunks();
        assert_eq!(chunks.len(), 3);
        assert_eq!(
            chunks[1].events[0],
            KvEvent::Stored {
                parent: Some(SNAPSHOT_CHUNK_BLOCKS as u64),
                blocks: blocks[SNAPSHOT_CHUNK_BLOCKS..2 * SNAPSHOT_CHUNK_BLOCKS].to_vec(),
            }
        );
        let (n, back) = round_trip(&snapshot);
        assert_eq!(n, 3);
        assert_eq!(flat(&back.chains), blocks);
    }

    #[test]
    fn an_empty_cache_is_one_empty_chunk() {
        let snapshot = KvSnapshot {
            epoch: 1,
            seq: None,
            chains: Vec::new(),
        };
        let (n, back) = round_trip(&snapshot);
        assert_eq!((n, back), (1, snapshot));
    }

    #[test]
    fn bad_chunks_are_typed_errors() {
        let stored = |seq| EventBatch {
            epoch: 1,
            seq,
            events: vec![KvEvent::Stored {
                parent: None,
                blocks: vec![1, 2, 3],
            }],
        };
        let mut a = SnapshotAssembler::new(100);
        assert_eq!(
            a.push(Some(1), false, stored(1)),
            Err(SnapshotError::OutOfOrder {
                expected: 0,
                got: 1
            })
        );
        let mut a = SnapshotAssembler::new(100);
        assert_eq!(a.push(Some(1), false, stored(0)), Ok(None));
        assert_eq!(
            a.push(Some(2), true, stored(1)),
            Err(SnapshotError::Mismatch)
        );
        let mut a = SnapshotAssembler::new(100);
        let removed = EventBatch {
            epoch: 1,
            seq: 0,
            events: vec![KvEvent::Removed { blocks: vec![1] }],
        };
        assert_eq!(a.push(None, true, removed), Err(SnapshotError::NotStored));
        let mut a = SnapshotAssembler::new(2);
        assert_eq!(
            a.push(None, true, stored(0)),
            Err(SnapshotError::TooLarge { max: 2 })
        );
    }
}
