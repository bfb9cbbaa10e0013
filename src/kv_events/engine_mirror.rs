//! One engine's KV cache as the router sees it, kept exact from its published events: the pure
//! machine between an engine's event streams (vLLM's or SGLang's, [`EngineBatch`]es numbered
//! per data-parallel rank) and our index of content hashes ([`KvIndex`](super::KvIndex)).
//!
//! No I/O and no clock: the subscriber (`engine::kv_subscriber`, feature `engine`) feeds it
//! what arrives (`handle_*`) and carries out the [`MirrorAction`]s it returns: batches for the
//! index, replay requests to the engine's replay endpoint.
//!
//! **Our hashes, not the engine's.** A stored block is indexed under our own chained hash of
//! its tokens ([`extend_hash`](super::extend_hash())), the hash the router computes for a prompt;
//! the engine's hash only links a block to its parent and names it in removals. So a
//! different hash algorithm or seed in the engine cannot make every lookup miss.
//!
//! **Sequence rule, per rank** (a rank's batches are numbered from 0 at its process start):
//! - the next number: applied;
//! - a number skipped: a replay from the first missed number is asked for, and live batches
//!   wait (bounded) until it ends; replayed batches fill the gap;
//! - a replay that cannot fill it (the engine no longer buffers that far back, no replay
//!   endpoint, a timeout): the rank's blocks are dropped and it is rebuilt from what comes next,
//!   marked [`Picture::Partial`] until its cache is known whole again;
//! - a number going back: the engine restarted (its cache is cold): the rank's blocks are
//!   dropped, and it is rebuilt from its new stream;
//! - the first batch we see: from 0 it is the whole history; later, a replay from 0 is asked
//!   for (the buffer usually still holds a young engine's whole history).
//!
//! A rank's picture is [`Picture::Exact`] when everything it stored since its cache was last
//! empty (process start, or `AllBlocksCleared`) was seen; otherwise `Partial`: a subset of its
//! cache, never a block it does not hold. Whatever can no longer be trusted to be held (after a
//! lost removal, say) is dropped, never kept.
//!
//! Ranks of one engine share one index entry (the engine is one worker to the router): a block
//! is held while any rank holds it.

use std::collections::{BTreeMap, HashMap};

use super::engine_wire::{EngineBatch, EngineEvent, StoredBlocks};
use super::{extend_hash, EventBatch, EventPublisher, MixState};
use crate::hooks::Seam;

mod report;

pub use report::{MirrorCounts, MirrorError, Picture};

/// Live batches a rank keeps aside while a replay is in flight, at most (beyond it the replay
/// is given up: the rank is dropped and rebuilt from the live stream).
pub const MAX_HELD_BATCHES: usize = 1024;

/// Batches per rank whose `(seq, timestamp)` the mirror remembers, to tell a late live copy of
/// a replayed batch from a restart.
const RECENT_BATCHES: usize = 64;

/// Blocks one engine may hold in the mirror by default (past it the engine's blocks are
/// dropped and it is marked partial: one engine cannot grow the router's memory without bound).
pub const DEFAULT_MAX_ENGINE_BLOCKS: usize = 1 << 20;

/// What the subscriber must do for the mirror.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MirrorAction {
    /// Apply this batch (our hashes, in order) to the index.
    Apply(EventBatch),
    /// Ask `rank`'s replay endpoint for its buffered batches from `from` on; feed them to
    /// [`EngineMirror::handle_replayed`], then [`EngineMirror::handle_replay_end`] (or
    /// [`EngineMirror::handle_replay_failed`]).
    Replay {
        /// The data-parallel rank.
        rank: u32,
        /// The first sequence number wanted.
        from: u64,
    },
    /// Drop the engine from the index for good (its blocks come at another size than the
    /// card's): it is scored by prediction; no batch follows.
    Withdraw,
}

/// A deliberately broken variant of the mirror, caught by its property tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MirrorMutant {
    /// A skipped sequence number is ignored: no replay, no drop.
    IgnoresGaps,
    /// A sequence number going back is taken for a duplicate: the restart goes unnoticed.
    MissesRestarts,
}

/// One data-parallel rank's stream.
#[derive(Debug, Default)]
struct Rank {
    /// The sequence number expected next (`None`: nothing applied yet).
    next: Option<u64>,
    /// The timestamp (bits) of the last batch applied: a replay must give it back unchanged.
    last_ts: u64,
    /// `(seq, timestamp bits)` of the last batches applied: a live batch among them is one the
    /// replay already brought (the subscription was still reaching the publisher), not a
    /// restart.
    recent: std::collections::VecDeque<(u64, u64)>,
    /// A replay in flight.
    replay: Option<Replay>,
    /// What the rank holds: engine hash -> our hash.
    blocks: HashMap<u64, u64, MixState>,
    picture: Option<Picture>,
}

/// A replay in flight for one rank.
#[derive(Debug, Default)]
struct Replay {
    /// The live batches that arrived meanwhile, in arrival order.
    held: Vec<(u64, EngineBatch)>,
    /// Whether its first batch was checked against the last one applied.
    checked: bool,
    /// Whether it brings the rank's whole history (a first subscription or a late join): until
    /// it ends, the rank's picture is not there yet.
    history: bool,
}

/// One engine's KV cache mirrored from its events (see the module docs).
#[derive(Debug)]
pub struct EngineMirror {
    block_size: u32,
    /// Our output stream to the index: the worker side's own publisher (merged changes,
    /// numbered batches within the wire bounds, the first opening with `Cleared`).
    publisher: EventPublisher,
    ranks: BTreeMap<u32, Rank>,
    /// Our hash -> ranks holding it.
    held: HashMap<u64, u32, MixState>,
    max_blocks: usize,
    /// Whether the index may hear of the engine yet (its first batch opens with `Cleared`):
    /// not before there is a picture.
    started: bool,
    /// Whether the engine was withdrawn from the index for good (its blocks can never match).
    withdrawn: bool,
    counts: MirrorCounts,
    /// The last error seen, for the operator (cleared by nothing: it is history).
    last_error: Option<MirrorError>,
    mutant: Seam<MirrorMutant>,
}

impl EngineMirror {
    /// A mirror for an engine whose card says `block_size` tokens per block. `epoch` numbers
    /// this mirror's output stream to the index (a new mirror for the same worker must use a
    /// larger one, so the index drops what the previous one said).
    pub fn new(block_size: u32, epoch: u64) -> Self {
        EngineMirror {
            block_size,
            publisher: EventPublisher::new(epoch),
            ranks: BTreeMap::new(),
            held: HashMap::default(),
            max_blocks: DEFAULT_MAX_ENGINE_BLOCKS,
            started: false,
            withdrawn: false,
            counts: MirrorCounts::default(),
            last_error: None,
            mutant: Seam::off(),
        }
    }

    /// The same mirror holding at most `max_blocks` blocks.
    pub fn with_max_blocks(mut self, max_blocks: usize) -> Self {
        self.max_blocks = max_blocks.max(1);
        self
    }

    #[cfg(test)]
    pub(crate) fn with_mutant(mut self, mutant: MirrorMutant) -> Self {
        self.mutant = Seam::on(mutant);
        self
    }

    /// The card's block size the mirror checks events against.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// What the mirror counted.
    pub fn counts(&self) -> MirrorCounts {
        self.counts
    }

    /// The last reason events could not be indexed, if any.
    pub fn last_error(&self) -> Option<&MirrorError> {
        self.last_error.as_ref()
    }

    /// The engine's picture: the worst of its ranks' (`Unknown` before any rank was seen).
    pub fn picture(&self) -> Picture {
        let mut pictures = self.ranks.values().map(|r| {
            if r.replay.as_ref().is_some_and(|p| p.history) {
                Picture::Unknown
            } else {
                r.picture.unwrap_or(Picture::Unknown)
            }
        });
        let Some(first) = pictures.next() else {
            return Picture::Unknown;
        };
        pictures.fold(first, |worst, p| match (worst, p) {
            (Picture::Unknown, _) | (_, Picture::Unknown) => Picture::Unknown,
            (Picture::Partial, _) | (_, Picture::Partial) => Picture::Partial,
            _ => Picture::Exact,
        })
    }

    /// The sequence number `rank` expects next (`None`: nothing applied yet).
    pub fn expected(&self, rank: u32) -> Option<u64> {
        self.ranks.get(&rank).and_then(|r| r.next)
    }

    /// Our hashes of the blocks the engine holds (any rank).
    pub fn held(&self) -> impl Iterator<Item = u64> + '_ {
        self.held.keys().copied()
    }

    /// `rank`'s live stream is subscribed: its history is asked for (a replay from 0), so the
    /// picture is there before the engine's next batch. An engine that published nothing yet
    /// answers with nothing: its cache is empty, exactly.
    pub fn handle_subscribed(&mut self, rank: u32) -> Vec<MirrorAction> {
        let r = self.rank(rank);
        if r.next.is_some() || r.replay.is_some() {
            return Vec::new();
        }
        r.replay = Some(Replay {
            history: true,
            ..Replay::default()
        });
        vec![MirrorAction::Replay { rank, from: 0 }]
    }

    /// A batch `seq` of `rank` from the live stream.
    pub fn handle_live(&mut self, rank: u32, seq: u64, batch: EngineBatch) -> Vec<MirrorAction> {
        let mut out = Out::default();
        self.live(rank, seq, batch, &mut out);
        out.finish(self)
    }

    /// A batch `seq` of `rank` from the replay endpoint.
    ///
    /// A replay after a gap starts one batch early, at the last batch applied: the engine
    /// must send it back unchanged (same timestamp). Otherwise the engine restarted behind the
    /// gap (its numbers started again and passed ours) and its rank is rebuilt.
    pub fn handle_replayed(
        &mut self,
        rank: u32,
        seq: u64,
        batch: EngineBatch,
    ) -> Vec<MirrorAction> {
        let mut out = Out::default();
        let r = self.rank(rank);
        let Some(replay) = &mut r.replay else {
            // Not asked for (a late answer to a replay already given up): ignore.
            self.counts.duplicates += 1;
            return Vec::new();
        };
        let first = !replay.checked;
        replay.checked = true;
        match r.next {
            // A late joiner's first: the engine's whole history when it starts at 0.
            None => {
                r.picture = Some(if seq == 0 {
                    Picture::Exact
                } else {
                    Picture::Partial
                });
                if seq != 0 {
                    self.counts.rebuilds += 1;
                }
                self.apply(rank, seq, batch, &mut out);
                self.counts.replayed += 1;
            }
            Some(next) if first => {
                let same = seq.checked_add(1) == Some(next) && batch.ts.to_bits() == r.last_ts;
                if same || self.mutant.is(MirrorMutant::MissesRestarts) && seq < next {
                    self.counts.duplicates += 1;
                } else {
                    if seq.checked_add(1) == Some(next) {
                        self.counts.restarts += 1;
                    }
                    // A restart behind the gap, or a buffer that no longer reaches back.
                    self.rebuild(rank);
                    self.apply(rank, seq, batch, &mut out);
                    self.counts.replayed += 1;
                }
            }
            Some(next) if seq < next => self.counts.duplicates += 1,
            Some(next) => {
                if seq > next {
                    self.rebuild(rank);
                }
                self.apply(rank, seq, batch, &mut out);
                self.counts.replayed += 1;
            }
        }
        out.finish(self)
    }

    /// `rank`'s replay ended (the end marker): the live batches kept aside apply now.
    pub fn handle_replay_end(&mut self, rank: u32) -> Vec<MirrorAction> {
        let mut out = Out::default();
        let replay = self.rank(rank).replay.take().unwrap_or_default();
        let missing = !replay.checked && self.rank(rank).next.is_some();
        if missing && !self.mutant.is(MirrorMutant::MissesRestarts) {
            // Not even the last batch applied came back: the engine is a new process that
            // has published nothing yet, so its cache is empty (exactly known).
            self.counts.restarts += 1;
            self.drop_rank(rank);
            let r = self.rank(rank);
            r.next = None;
            r.picture = Some(Picture::Exact);
        }
        if replay.held.is_empty() && self.rank(rank).next.is_none() {
            // Nothing published, nothing pending: the rank's cache is empty.
            self.rank(rank).picture = Some(Picture::Exact);
            self.start();
        }
        for (seq, batch) in replay.held {
            self.drain(rank, seq, batch, &mut out);
        }
        out.finish(self)
    }

    /// `rank`'s replay cannot be had (no endpoint, timeout, the connection lost): the rank is
    /// dropped and rebuilt from the live batches kept aside.
    pub fn handle_replay_failed(&mut self, rank: u32) -> Vec<MirrorAction> {
        let mut out = Out::default();
        let held = self.rank(rank).replay.take().unwrap_or_default().held;
        if self.rank(rank).next.is_some() || !held.is_empty() {
            self.rebuild(rank);
        }
        self.rank(rank).next = None;
        for (seq, batch) in held {
            if self.rank(rank).next.is_none() {
                // Rebuilt from here: what came before is lost.
                self.rank(rank).picture = Some(Picture::Partial);
                self.apply(rank, seq, batch, &mut out);
            } else {
                self.drain(rank, seq, batch, &mut out);
            }
        }
        out.finish(self)
    }

    /// The live stream of `rank` was reconnected after a loss: whatever was published
    /// meanwhile is asked for again.
    pub fn handle_reconnected(&mut self, rank: u32) -> Vec<MirrorAction> {
        let mut out = Out::default();
        let r = self.rank(rank);
        if let (Some(next), None) = (r.next, &r.replay) {
            r.replay = Some(Replay::default());
            // From the last batch applied: it must come back unchanged (the restart check).
            out.actions.push(MirrorAction::Replay {
                rank,
                from: next.saturating_sub(1),
            });
        }
        out.finish(self)
    }

    fn rank(&mut self, rank: u32) -> &mut Rank {
        self.ranks.entry(rank).or_default()
    }

    fn live(&mut self, rank: u32, seq: u64, batch: EngineBatch, out: &mut Out) {
        let r = self.rank(rank);
        if let Some(replay) = &mut r.replay {
            if replay.held.len() >= MAX_HELD_BATCHES {
                // The replay takes too long: give up on it, keep what is live.
                let held = std::mem::take(&mut replay.held);
                r.replay = None;
                self.rebuild(rank);
                self.rank(rank).next = None;
                for (s, b) in held {
                    self.first_or_drain(rank, s, b, out);
                }
                self.first_or_drain(rank, seq, batch, out);
            } else {
                replay.held.push((seq, batch));
            }
            return;
        }
        match r.next {
            None if seq == 0 => {
                r.picture = Some(Picture::Exact);
                self.apply(rank, seq, batch, out);
            }
            None => {
                // Joined late: ask for the whole history the engine still buffers.
                r.replay = Some(Replay {
                    held: vec![(seq, batch)],
                    checked: false,
                    history: true,
                });
                out.actions.push(MirrorAction::Replay { rank, from: 0 });
            }
            Some(next) if seq == next => self.apply(rank, seq, batch, out),
            Some(next) if seq > next => {
                if self.mutant.is(MirrorMutant::IgnoresGaps) {
                    self.apply(rank, seq, batch, out);
                    return;
                }
                self.counts.gaps += 1;
                let r = self.rank(rank);
                r.replay = Some(Replay {
                    held: vec![(seq, batch)],
                    checked: false,
                    history: false,
                });
                // From the last batch applied: it must come back unchanged, or the engine
                // restarted behind the gap.
                out.actions.push(MirrorAction::Replay {
                    rank,
                    from: next - 1,
                });
            }
            Some(_) if r.recent.contains(&(seq, batch.ts.to_bits())) => {
                self.counts.duplicates += 1;
            }
            Some(_) => {
                if self.mutant.is(MirrorMutant::MissesRestarts) {
                    self.counts.duplicates += 1;
                    return;
                }
                // Back to an earlier number: a new process, a cold cache.
                self.counts.restarts += 1;
                self.drop_rank(rank);
                let r = self.rank(rank);
                r.next = None;
                r.picture = None;
                self.live(rank, seq, batch, out);
            }
        }
    }

    /// A live batch kept aside during a replay: the replay may have delivered it already
    /// (not a restart, a duplicate).
    fn drain(&mut self, rank: u32, seq: u64, batch: EngineBatch, out: &mut Out) {
        match self.rank(rank).next {
            Some(next) if seq < next => self.counts.duplicates += 1,
            _ => self.live(rank, seq, batch, out),
        }
    }

    /// After a rebuild (`next` unset): the first batch starts the rank afresh, partial.
    fn first_or_drain(&mut self, rank: u32, seq: u64, batch: EngineBatch, out: &mut Out) {
        if self.rank(rank).next.is_none() {
            self.rank(rank).picture = Some(Picture::Partial);
            self.apply(rank, seq, batch, out);
        } else {
            self.drain(rank, seq, batch, out);
        }
    }

    /// Drop `rank`'s blocks: it is rebuilt from what comes next, partial.
    fn rebuild(&mut self, rank: u32) {
        self.counts.rebuilds += 1;
        self.drop_rank(rank);
        self.rank(rank).picture = Some(Picture::Partial);
    }

    fn drop_rank(&mut self, rank: u32) {
        let blocks = std::mem::take(&mut self.rank(rank).blocks);
        for (_, ours) in blocks {
            self.release(ours);
        }
    }

    fn release(&mut self, ours: u64) {
        if let Some(n) = self.held.get_mut(&ours) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&ours);
                self.publisher.removed(ours);
            }
        }
    }

    /// The index hears of the engine with the mirror's first batch, which opens with `Cleared`:
    /// from then on the engine is scored by its cache, starting empty.
    fn start(&mut self) {
        self.started = true;
    }

    /// Apply batch `seq` of `rank` in order.
    fn apply(&mut self, rank: u32, seq: u64, batch: EngineBatch, out: &mut Out) {
        self.start();
        let r = self.rank(rank);
        r.next = Some(seq.saturating_add(1));
        r.last_ts = batch.ts.to_bits();
        if r.recent.len() == RECENT_BATCHES {
            r.recent.pop_front();
        }
        r.recent.push_back((seq, r.last_ts));
        self.counts.batches += 1;
        self.counts.skipped_events += u64::from(batch.skipped.unknown_events);
        self.counts.skipped_fields += u64::from(batch.skipped.unknown_fields);
        for event in batch.events {
            self.counts.events += 1;
            match event {
                EngineEvent::Stored(stored) => self.stored(rank, stored, out),
                EngineEvent::Removed {
                    hashes, group_idx, ..
                } => {
                    if group_idx != 0 {
                        self.counts.skipped_events += 1;
                        continue;
                    }
                    for h in hashes {
                        match self.rank(rank).blocks.remove(&h) {
                            Some(ours) => self.release(ours),
                            None => self.counts.unknown_removals += 1,
                        }
                    }
                }
                EngineEvent::Cleared => {
                    self.drop_rank(rank);
                    // Empty now, so whatever follows is the whole cache again.
                    self.rank(rank).picture = Some(Picture::Exact);
                }
                EngineEvent::Invalid { .. } => {
                    // A change we cannot read: it may have been a removal, so nothing of the
                    // rank is trusted any more.
                    self.counts.skipped_events += 1;
                    self.rebuild(rank);
                }
            }
        }
        if self.held.len() > self.max_blocks {
            let ranks: Vec<u32> = self.ranks.keys().copied().collect();
            for r in ranks {
                self.rebuild(r);
            }
        }
    }

    fn stored(&mut self, rank: u32, stored: StoredBlocks, out: &mut Out) {
        // Only the main attention group of the base model is what a prompt's prefix hits.
        if stored.group_idx != 0 || stored.lora_id.is_some() {
            self.counts.skipped_events += 1;
            return;
        }
        if stored.block_size != self.block_size {
            self.counts.block_size_mismatches += 1;
            self.last_error = Some(MirrorError::BlockSizeMismatch {
                card: self.block_size,
                engine: stored.block_size,
            });
            if !self.withdrawn {
                // No block of this engine can match a prompt hashed at the card's size: its
                // (empty) index entry goes, so it is scored by prediction, as an engine
                // without events. The mirror keeps counting for the operator.
                self.withdrawn = true;
                out.actions.push(MirrorAction::Withdraw);
            }
            return;
        }
        let size = self.block_size as usize;
        if size == 0 || stored.token_ids.len() != size.saturating_mul(stored.hashes.len()) {
            self.counts.token_mismatches += 1;
            self.last_error = Some(MirrorError::TokenCount {
                tokens: stored.token_ids.len(),
                blocks: stored.hashes.len(),
                block_size: stored.block_size,
            });
            self.rank(rank).picture = Some(Picture::Partial);
            return;
        }
        let mut parent = match stored.parent {
            None => None,
            Some(p) => match self.rank(rank).blocks.get(&p) {
                Some(&ours) => Some(ours),
                None => {
                    self.counts.unknown_parents += 1;
                    self.last_error = Some(MirrorError::UnknownParent(p));
                    self.rank(rank).picture = Some(Picture::Partial);
                    return;
                }
            },
        };
        for (h, tokens) in stored
            .hashes
            .iter()
            .zip(stored.token_ids.chunks_exact(size))
        {
            let extends = parent;
            let ours = extend_hash(extends, tokens);
            parent = Some(ours);
            let r = self.rank(rank);
            if let Some(old) = r.blocks.insert(*h, ours) {
                if old == ours {
                    continue; // stored again: already counted
                }
                self.release(old);
            }
            let n = self.held.entry(ours).or_insert(0);
            *n += 1;
            if *n == 1 {
                self.publisher.stored(extends, ours);
            }
        }
    }
}

/// The actions one input produced besides the index batches.
#[derive(Default)]
struct Out {
    actions: Vec<MirrorAction>,
}

impl Out {
    /// The index batches first (once the index may hear of the engine, and while it is not
    /// withdrawn), then the other actions.
    fn finish(self, mirror: &mut EngineMirror) -> Vec<MirrorAction> {
        let mut actions = Vec::new();
        if mirror.started {
            let batches = mirror.publisher.take_batches();
            if !mirror.withdrawn {
                actions.extend(batches.into_iter().map(MirrorAction::Apply));
            }
        }
        actions.extend(self.actions);
        actions
    }
}

#[cfg(test)]
mod tests;
