//! The mirror against a simulated engine: whatever the engine stores, evicts, clears or
//! restarts, and whatever the transport loses, the index holds only blocks the engine holds,
//! and all of them whenever the mirror says its picture is exact.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use proptest::prelude::*;

use super::*;
use crate::kv_events::engine_wire::{EngineBatch, EngineEvent, Skipped, StoredBlocks};
use crate::kv_events::{block_hashes, Applied, KvIndex};

const BS: u32 = 4;
const WORKER: u64 = 1;

/// The engine's own hash of a block: deterministic in the content, unlike ours.
fn engine_hash(ours: u64) -> u64 {
    ours.rotate_left(17) ^ 0xa5a5_5a5a_0f0f_f0f0
}

/// Prompt `p`'s tokens: prompts share prefixes in varied ways (block `i` of `p` depends on
/// `p % (i + 1)`), so chains branch and share parents.
fn prompt(p: u8, blocks: usize) -> Vec<u32> {
    (0..blocks)
        .flat_map(|i| {
            let t = u32::from(p) % (i as u32 + 1) * 100 + i as u32;
            std::iter::repeat_n(t, BS as usize)
        })
        .collect()
}

/// A vLLM-like engine: a block cache, batches numbered from 0 per process, a replay buffer.
struct SimEngine {
    /// engine hash -> our hash, of the blocks held.
    cache: BTreeMap<u64, u64>,
    seq: u64,
    buffer: VecDeque<(u64, EngineBatch)>,
    window: usize,
    clock: u64,
}

impl SimEngine {
    fn new(window: usize) -> Self {
        SimEngine {
            cache: BTreeMap::new(),
            seq: 0,
            buffer: VecDeque::new(),
            window,
            clock: 0,
        }
    }

    fn publish(&mut self, events: Vec<EngineEvent>) -> (u64, EngineBatch) {
        self.clock += 1;
        let batch = EngineBatch {
            ts: self.clock as f64 * 0.001,
            events,
            dp_rank: Some(0),
            skipped: Skipped::default(),
        };
        let seq = self.seq;
        self.seq += 1;
        self.buffer.push_back((seq, batch.clone()));
        while self.buffer.len() > self.window {
            self.buffer.pop_front();
        }
        (seq, batch)
    }

    fn store(&mut self, p: u8, blocks: usize) -> Option<(u64, EngineBatch)> {
        let tokens = prompt(p, blocks);
        let ours = block_hashes(&tokens, BS);
        let first_missing = ours
            .iter()
            .position(|h| !self.cache.contains_key(&engine_hash(*h)))?;
        let parent = first_missing.checked_sub(1).map(|i| engine_hash(ours[i]));
        let hashes: Vec<u64> = ours[first_missing..]
            .iter()
            .map(|h| engine_hash(*h))
            .collect();
        for h in &ours[first_missing..] {
            self.cache.insert(engine_hash(*h), *h);
        }
        Some(self.publish(vec![EngineEvent::Stored(StoredBlocks {
            hashes,
            parent,
            token_ids: tokens[first_missing * BS as usize..].to_vec(),
            block_size: BS,
            lora_id: None,
            medium: Some("GPU".into()),
            group_idx: 0,
            spec_kind: Some("full_attention".into()),
        })]))
    }

    fn evict(&mut self, pick: usize) -> Option<(u64, EngineBatch)> {
        let h = *self.cache.keys().nth(pick % self.cache.len().max(1))?;
        self.cache.remove(&h);
        Some(self.publish(vec![EngineEvent::Removed {
            hashes: vec![h],
            group_idx: 0,
            medium: Some("GPU".into()),
        }]))
    }

    fn clear(&mut self) -> (u64, EngineBatch) {
        self.cache.clear();
        self.publish(vec![EngineEvent::Cleared])
    }

    fn restart(&mut self) {
        self.cache.clear();
        self.seq = 0;
        self.buffer.clear();
    }

    fn truth(&self) -> BTreeSet<u64> {
        self.cache.values().copied().collect()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Store(u8, usize),
    Evict(usize),
    Clear,
    Restart,
    /// The next batch published is lost in transit.
    Lose,
    /// Everything published until `Reconnect` is lost.
    Disconnect,
    Reconnect,
    /// The next replay asked for fails.
    ReplayFails,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..6, 1usize..5).prop_map(|(p, n)| Op::Store(p, n)),
        3 => (0usize..64).prop_map(Op::Evict),
        1 => Just(Op::Clear),
        1 => Just(Op::Restart),
        2 => Just(Op::Lose),
        1 => Just(Op::Disconnect),
        1 => Just(Op::Reconnect),
        1 => Just(Op::ReplayFails),
    ]
}

/// The subscriber's side: carries the mirror's actions out against the engine and a real
/// index, and checks the property whenever the mirror has seen the engine's latest batch.
struct Harness {
    engine: SimEngine,
    mirror: EngineMirror,
    index: KvIndex,
    lose_next: bool,
    disconnected: bool,
    replay_fails: bool,
    /// The mirror has seen the engine's latest batch (nothing published since was lost).
    synced: bool,
}

impl Harness {
    fn new(window: usize, mutant: Option<MirrorMutant>) -> Self {
        let mut mirror = EngineMirror::new(BS, 1);
        if let Some(m) = mutant {
            mirror = mirror.with_mutant(m);
        }
        Harness {
            engine: SimEngine::new(window),
            mirror,
            index: KvIndex::default(),
            lose_next: false,
            disconnected: false,
            replay_fails: false,
            synced: true,
        }
    }

    fn run(&mut self, actions: Vec<MirrorAction>) {
        let mut queue: VecDeque<MirrorAction> = actions.into();
        while let Some(action) = queue.pop_front() {
            match action {
                MirrorAction::Apply(batch) => {
                    let applied = self.index.apply(WORKER, &batch);
                    assert!(
                        matches!(applied, Applied::InOrder | Applied::Started),
                        "the mirror's own stream is in order: {applied:?}"
                    );
                }
                MirrorAction::Withdraw => {
                    panic!("the simulated engine's blocks are the card's size")
                }
                MirrorAction::Replay { rank, from } => {
                    let more = if std::mem::take(&mut self.replay_fails) {
                        self.mirror.handle_replay_failed(rank)
                    } else {
                        let replayed: Vec<_> = self
                            .engine
                            .buffer
                            .iter()
                            .filter(|(s, _)| *s >= from)
                            .cloned()
                            .collect();
                        let mut more = Vec::new();
                        for (seq, batch) in replayed {
                            more.extend(self.mirror.handle_replayed(rank, seq, batch));
                        }
                        more.extend(self.mirror.handle_replay_end(rank));
                        more
                    };
                    queue.extend(more);
                }
            }
        }
    }

    fn published(&mut self, batch: Option<(u64, EngineBatch)>) {
        let Some((seq, batch)) = batch else { return };
        if self.disconnected || std::mem::take(&mut self.lose_next) {
            self.synced = false;
            return;
        }
        let actions = self.mirror.handle_live(0, seq, batch);
        self.run(actions);
        self.synced = true;
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Store(p, n) => {
                let b = self.engine.store(p, n);
                self.published(b);
            }
            Op::Evict(pick) => {
                let b = self.engine.evict(pick);
                self.published(b);
            }
            Op::Clear => {
                let b = self.engine.clear();
                self.published(Some(b));
            }
            // The process goes, and its connections with it: the subscriber hears the stream
            // break, and misses what the new process publishes until it is back.
            Op::Restart => {
                self.engine.restart();
                self.disconnected = true;
                self.synced = false;
            }
            Op::Lose => self.lose_next = true,
            Op::Disconnect => self.disconnected = true,
            Op::Reconnect => {
                if std::mem::take(&mut self.disconnected) {
                    let actions = self.mirror.handle_reconnected(0);
                    self.run(actions);
                }
            }
            Op::ReplayFails => self.replay_fails = true,
        }
    }

    /// The property, when the mirror has seen the engine's latest batch.
    fn check(&self) -> Result<(), String> {
        if !self.synced {
            return Ok(());
        }
        let truth = self.engine.truth();
        let indexed: BTreeSet<u64> = self.index.blocks_of(WORKER).collect();
        let mirrored: BTreeSet<u64> = self.mirror.held().collect();
        if indexed != mirrored {
            return Err(format!("index {indexed:?} != mirror {mirrored:?}"));
        }
        if let Some(extra) = indexed.difference(&truth).next() {
            return Err(format!("indexed block {extra:#x} the engine does not hold"));
        }
        if self.mirror.picture() == Picture::Exact && indexed != truth {
            return Err(format!(
                "exact picture misses {:?}",
                truth.difference(&indexed)
            ));
        }
        Ok(())
    }
}

/// Run `ops`, then one more batch delivered (so every loss is noticed), checking throughout.
fn violation(ops: &[Op], window: usize, mutant: Option<MirrorMutant>) -> Option<String> {
    let mut h = Harness::new(window, mutant);
    for op in ops {
        h.step(op);
        if let Err(e) = h.check() {
            return Some(format!("after {op:?}: {e}"));
        }
    }
    h.step(&Op::Reconnect);
    h.lose_next = false;
    let b = h.engine.store(250, 1);
    h.published(b);
    h.check().err().map(|e| format!("at the end: {e}"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn index_never_credits_a_block_the_engine_does_not_hold_and_exact_means_equal(
        ops in prop::collection::vec(op(), 1..40),
        window in 1usize..16,
    ) {
        if let Some(v) = violation(&ops, window, None) {
            prop_assert!(false, "{}", v);
        }
    }

    #[test]
    fn without_faults_the_picture_is_exact_and_equal(
        ops in prop::collection::vec(
            prop_oneof![
                (0u8..6, 1usize..5).prop_map(|(p, n)| Op::Store(p, n)),
                (0usize..64).prop_map(Op::Evict),
                Just(Op::Clear),
            ],
            1..40,
        ),
    ) {
        let mut h = Harness::new(8, None);
        for op in &ops {
            h.step(op);
        }
        let indexed: BTreeSet<u64> = h.index.blocks_of(WORKER).collect();
        prop_assert_eq!(indexed, h.engine.truth());
        prop_assert!(matches!(h.mirror.picture(), Picture::Exact | Picture::Unknown));
    }
}

fn evict_first() -> Op {
    Op::Evict(0)
}

#[test]
fn a_lost_removal_is_replayed() {
    let ops = [Op::Store(1, 3), Op::Lose, evict_first(), Op::Store(2, 2)];
    assert_eq!(violation(&ops, 16, None), None);
    let mut h = Harness::new(16, None);
    for op in &ops {
        h.step(op);
    }
    assert_eq!(h.mirror.counts().gaps, 1);
    // The lost batch and the one that showed the gap (which came live too: a duplicate).
    assert_eq!(h.mirror.counts().replayed, 2);
    assert_eq!(
        h.mirror.picture(),
        Picture::Exact,
        "the replay filled the gap"
    );
}

#[test]
fn mutant_that_ignores_gaps_is_caught() {
    let ops = [Op::Store(1, 3), Op::Lose, evict_first(), Op::Store(2, 2)];
    assert!(violation(&ops, 16, Some(MirrorMutant::IgnoresGaps)).is_some());
}

#[test]
fn a_restart_is_noticed_and_the_rank_rebuilt() {
    // Restarted and already past our number: only the replay's timestamp check tells.
    let mut ops = vec![
        Op::Store(1, 3),
        Op::Store(2, 3),
        Op::Restart,
        Op::Store(3, 1),
    ];
    ops.extend([
        Op::Store(4, 1),
        Op::Store(5, 1),
        Op::Reconnect,
        Op::Store(6, 2),
    ]);
    assert_eq!(violation(&ops, 16, None), None);
    // Back before the new process published: the sequence going back tells.
    let ops = [
        Op::Store(1, 3),
        Op::Store(2, 3),
        Op::Restart,
        Op::Reconnect,
        Op::Store(3, 1),
    ];
    assert_eq!(violation(&ops, 16, None), None);
    let mut h = Harness::new(16, None);
    for op in &ops {
        h.step(op);
    }
    assert_eq!(h.mirror.counts().restarts, 1);
    assert_eq!(
        h.mirror.picture(),
        Picture::Exact,
        "a new process starts cold: exact"
    );
}

#[test]
fn mutant_that_misses_restarts_is_caught() {
    let ops = [
        Op::Store(1, 3),
        Op::Store(2, 3),
        Op::Restart,
        Op::Reconnect,
        Op::Store(3, 1),
    ];
    assert!(violation(&ops, 16, Some(MirrorMutant::MissesRestarts)).is_some());
    let mut ops = vec![
        Op::Store(1, 3),
        Op::Store(2, 3),
        Op::Restart,
        Op::Store(3, 1),
    ];
    ops.extend([
        Op::Store(4, 1),
        Op::Store(5, 1),
        Op::Reconnect,
        Op::Store(6, 2),
    ]);
    assert!(violation(&ops, 16, Some(MirrorMutant::MissesRestarts)).is_some());
}

#[test]
fn a_gap_older_than_the_replay_window_is_declared_partial() {
    let mut ops = vec![Op::Store(1, 3), Op::Disconnect];
    ops.extend((0..6).map(|p| Op::Store(p, 4)));
    ops.push(Op::Reconnect);
    let mut h = Harness::new(2, None);
    for op in &ops {
        h.step(op);
    }
    assert_eq!(h.mirror.picture(), Picture::Partial);
    assert!(h.mirror.counts().rebuilds >= 1);
    assert_eq!(violation(&ops, 2, None), None);
    // A clear makes the picture whole again.
    h.step(&Op::Clear);
    h.step(&Op::Store(1, 2));
    assert_eq!(h.mirror.picture(), Picture::Exact);
    assert_eq!(h.check(), Ok(()));
}

#[test]
fn a_late_joiner_replays_the_whole_history() {
    let mut engine = SimEngine::new(100);
    let _ = engine.store(1, 3);
    let _ = engine.store(2, 2);
    let (seq, batch) = engine.store(3, 4).unwrap();
    let mut h = Harness::new(100, None);
    h.engine = engine;
    let actions = h.mirror.handle_live(0, seq, batch);
    assert_eq!(actions, vec![MirrorAction::Replay { rank: 0, from: 0 }]);
    // Until the history is in, there is no picture to trust.
    let (first_seq, first) = h.engine.buffer[0].clone();
    let _ = h.mirror.handle_replayed(0, first_seq, first);
    assert_eq!(h.mirror.picture(), Picture::Unknown, "mid-replay");
    h.mirror.handle_replay_failed(0);
    let mut h = Harness::new(100, None);
    h.engine = SimEngine::new(100);
    let _ = h.engine.store(1, 3);
    let _ = h.engine.store(2, 2);
    let (seq, batch) = h.engine.store(3, 4).unwrap();
    let actions = h.mirror.handle_live(0, seq, batch);
    h.run(actions);
    assert_eq!(h.mirror.picture(), Picture::Exact);
    assert_eq!(h.check(), Ok(()));
}

fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, block_size: u32) -> EngineEvent {
    EngineEvent::Stored(StoredBlocks {
        hashes,
        parent,
        token_ids: tokens,
        block_size,
        lora_id: None,
        medium: None,
        group_idx: 0,
        spec_kind: None,
    })
}

fn batch(ts: f64, events: Vec<EngineEvent>) -> EngineBatch {
    EngineBatch {
        ts,
        events,
        dp_rank: Some(0),
        skipped: Skipped::default(),
    }
}

#[test]
fn a_block_size_other_than_the_cards_is_a_typed_counted_error() {
    let mut mirror = EngineMirror::new(16, 1);
    let actions = mirror.handle_live(
        0,
        0,
        batch(1.0, vec![stored(vec![7], None, vec![1; 32], 32)]),
    );
    assert_eq!(
        actions,
        vec![MirrorAction::Withdraw],
        "withdrawn, never indexed"
    );
    assert_eq!(mirror.counts().block_size_mismatches, 1);
    assert_eq!(
        mirror.last_error(),
        Some(&MirrorError::BlockSizeMismatch {
            card: 16,
            engine: 32
        })
    );
    assert_eq!(
        mirror.held().count(),
        0,
        "nothing indexed at the wrong size"
    );
    // Withdrawn for good: not even a block at the card's size goes to the index after it.
    let later = mirror.handle_live(
        1,
        0,
        batch(2.0, vec![stored(vec![8], None, vec![1; 16], 16)]),
    );
    assert!(later.is_empty(), "no batch after a withdrawal: {later:?}");
}

#[test]
fn blocks_are_indexed_under_our_hashes_of_their_tokens() {
    let tokens: Vec<u32> = (10..110).collect();
    let ours = block_hashes(&tokens, 32);
    let mut mirror = EngineMirror::new(32, 1);
    let actions = mirror.handle_live(
        0,
        0,
        batch(
            1.0,
            vec![stored(vec![11, 12, 13], None, tokens[..96].to_vec(), 32)],
        ),
    );
    let mut index = KvIndex::default();
    for a in actions {
        if let MirrorAction::Apply(b) = a {
            index.apply(WORKER, &b);
        }
    }
    assert_eq!(index.overlap(&ours, WORKER), 3);
}

#[test]
fn other_groups_and_lora_blocks_are_skipped() {
    let mut mirror = EngineMirror::new(4, 1);
    let mut other = StoredBlocks {
        hashes: vec![1],
        parent: None,
        token_ids: vec![1; 4],
        block_size: 4,
        lora_id: None,
        medium: None,
        group_idx: 1,
        spec_kind: None,
    };
    let mut lora = other.clone();
    lora.group_idx = 0;
    lora.lora_id = Some(3);
    other.hashes = vec![2];
    let _ = mirror.handle_live(
        0,
        0,
        batch(
            1.0,
            vec![EngineEvent::Stored(other), EngineEvent::Stored(lora)],
        ),
    );
    assert_eq!(mirror.held().count(), 0);
    assert_eq!(mirror.counts().skipped_events, 2);
}

#[test]
fn ranks_share_a_block_until_the_last_one_drops_it() {
    let mut mirror = EngineMirror::new(4, 1);
    let _ = mirror.handle_live(0, 0, batch(1.0, vec![stored(vec![5], None, vec![9; 4], 4)]));
    let _ = mirror.handle_live(1, 0, batch(1.5, vec![stored(vec![6], None, vec![9; 4], 4)]));
    assert_eq!(mirror.held().count(), 1, "one block, held by two ranks");
    let removed = mirror.handle_live(
        0,
        1,
        batch(
            2.0,
            vec![EngineEvent::Removed {
                hashes: vec![5],
                group_idx: 0,
                medium: None,
            }],
        ),
    );
    assert!(removed.is_empty(), "rank 1 still holds it: {removed:?}");
    let _ = mirror.handle_live(1, 1, batch(2.5, vec![EngineEvent::Cleared]));
    assert_eq!(mirror.held().count(), 0);
}

#[test]
fn a_subscriber_asks_for_the_history_at_once_and_a_silent_engine_is_exactly_empty() {
    let mut h = Harness::new(100, None);
    let actions = h.mirror.handle_subscribed(0);
    assert_eq!(actions, vec![MirrorAction::Replay { rank: 0, from: 0 }]);
    h.run(actions);
    assert_eq!(
        h.mirror.picture(),
        Picture::Exact,
        "nothing published: empty"
    );
    assert!(
        h.index.publishes(WORKER),
        "scored by its (empty) cache from now on"
    );
    // An engine with a history: the replay brings all of it before any live batch.
    let mut h = Harness::new(100, None);
    let _ = h.engine.store(1, 3);
    let _ = h.engine.evict(1);
    let _ = h.engine.store(2, 2);
    let actions = h.mirror.handle_subscribed(0);
    h.run(actions);
    assert_eq!(h.mirror.picture(), Picture::Exact);
    assert_eq!(h.check(), Ok(()));
    let indexed: BTreeSet<u64> = h.index.blocks_of(WORKER).collect();
    assert_eq!(indexed, h.engine.truth());
}

#[test]
fn a_live_batch_the_replay_already_brought_is_a_duplicate_not_a_restart() {
    let mut h = Harness::new(100, None);
    let early = h.engine.store(1, 3).unwrap();
    let actions = h.mirror.handle_subscribed(0);
    h.run(actions);
    // The subscription reached the publisher late: the batch the replay brought arrives live.
    let actions = h.mirror.handle_live(0, early.0, early.1);
    assert!(actions.is_empty(), "{actions:?}");
    assert_eq!(h.mirror.counts().restarts, 0);
    assert_eq!(h.mirror.counts().duplicates, 1);
    assert_eq!(h.mirror.picture(), Picture::Exact);
    assert_eq!(h.check(), Ok(()));
}
