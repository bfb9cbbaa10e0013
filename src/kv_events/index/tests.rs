//! Properties of the index: after any interleaving of batches (lost, duplicated, reordered),
//! it never credits a worker with a block the worker does not hold; fed every batch, it equals
//! the real caches; and the scoring walk agrees with a per-worker count. The mutant that
//! ignores removals is caught.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use proptest::prelude::*;
use proptest::strategy::ValueTree;

use super::*;
use crate::kv_events::{mix, EventPublisher};

/// One step of a worker's real cache.
#[derive(Clone, Debug)]
enum Op {
    /// Store a chain of blocks (small domain, so chains overlap across workers).
    Store(Vec<u8>),
    /// Remove one block if held.
    Remove(u8),
    /// Clear the cache.
    Clear,
    /// End the current batch.
    Flush,
    /// The worker restarts: new epoch, empty cache.
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => proptest::collection::vec(0u8..24, 1..6).prop_map(Op::Store),
        3 => (0u8..24).prop_map(Op::Remove),
        1 => Just(Op::Clear),
        3 => Just(Op::Flush),
        1 => Just(Op::Restart),
    ]
}

/// A worker's real cache driven by `ops`: every batch it published, and the real cache right
/// after each batch, keyed by `(epoch, seq)`.
struct Published {
    batches: Vec<EventBatch>,
    after: HashMap<(u64, u64), BTreeSet<u64>>,
    real: BTreeSet<u64>,
}

fn block(b: u8) -> u64 {
    mix(u64::from(b) + 1)
}

fn publish(ops: &[Op]) -> Published {
    let mut epoch = 1;
    let mut publisher = EventPublisher::new(epoch);
    let mut real = BTreeSet::new();
    let mut out = Published {
        batches: Vec::new(),
        after: HashMap::new(),
        real: BTreeSet::new(),
    };
    let flush = |p: &mut EventPublisher, real: &BTreeSet<u64>, out: &mut Published| {
        for b in p.take_batches() {
            out.after.insert((b.epoch, b.seq), real.clone());
            out.batches.push(b);
        }
    };
    for op in ops {
        match op {
            Op::Store(chain) => {
                let mut parent = None;
                for &b in chain {
                    let h = block(b);
                    if real.insert(h) {
                        publisher.stored(parent, h);
                    }
                    parent = Some(h);
                }
            }
            Op::Remove(b) => {
                if real.remove(&block(*b)) {
                    publisher.removed(block(*b));
                }
            }
            Op::Clear => {
                real.clear();
                publisher.cleared();
            }
            Op::Flush => flush(&mut publisher, &real, &mut out),
            Op::Restart => {
                flush(&mut publisher, &real, &mut out);
                epoch += 1;
                publisher = EventPublisher::new(epoch);
                real.clear();
            }
        }
    }
    flush(&mut publisher, &real, &mut out);
    out.real = real;
    out
}

/// What the network does to one batch.
#[derive(Clone, Copy, Debug)]
enum Fault {
    Deliver,
    Drop,
    Duplicate,
    /// Deliver it this many positions later.
    Delay(u8),
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        6 => Just(Fault::Deliver),
        1 => Just(Fault::Drop),
        1 => Just(Fault::Duplicate),
        1 => (1u8..6).prop_map(Fault::Delay),
    ]
}

/// Interleave the workers' batches round-robin, then apply the faults: the delivery order.
fn deliveries(published: &[Published], faults: &[Fault]) -> Vec<(InstanceId, EventBatch)> {
    let mut order = Vec::new();
    let longest = published.iter().map(|p| p.batches.len()).max().unwrap_or(0);
    for i in 0..longest {
        for (w, p) in published.iter().enumerate() {
            if let Some(b) = p.batches.get(i) {
                order.push((w as InstanceId + 1, b.clone()));
            }
        }
    }
    let mut keyed: Vec<(usize, (InstanceId, EventBatch))> = Vec::new();
    for (i, item) in order.into_iter().enumerate() {
        let f = faults
            .get(i % faults.len().max(1))
            .copied()
            .unwrap_or(Fault::Deliver);
        match f {
            Fault::Deliver => keyed.push((2 * i, item)),
            Fault::Drop => {}
            Fault::Duplicate => {
                keyed.push((2 * i, item.clone()));
                keyed.push((2 * i + 1, item));
            }
            Fault::Delay(d) => keyed.push((2 * (i + usize::from(d)) + 1, item)),
        }
    }
    keyed.sort_by_key(|k| k.0);
    keyed.into_iter().map(|k| k.1).collect()
}

/// Where the index stands for each worker: the `(epoch, seq)` of the last batch it applied.
/// Tracked beside the index, from its [`Applied`] answers.
type Positions = BTreeMap<InstanceId, (u64, u64)>;

fn feed(index: &mut KvIndex, order: &[(InstanceId, EventBatch)]) -> Positions {
    let mut at = Positions::new();
    for (w, b) in order {
        if index.apply(*w, b) != Applied::Stale {
            at.insert(*w, (b.epoch, b.seq));
        }
    }
    at
}

/// Soundness: every block the index credits a worker with, the worker really held right after
/// the last batch the index applied for it.
fn check_sound(index: &KvIndex, published: &[Published], at: &Positions) -> Result<(), String> {
    for (w, p) in published.iter().enumerate() {
        let w = w as InstanceId + 1;
        let credited: BTreeSet<u64> = index.blocks_of(w).collect();
        if credited.is_empty() {
            continue;
        }
        let Some(pos) = at.get(&w) else {
            return Err(format!("worker {w} credited without any batch applied"));
        };
        let real = &p.after[pos];
        if let Some(stale) = credited.difference(real).next() {
            return Err(format!(
                "worker {w} credited with {stale:#x}, which it did not hold at {pos:?}"
            ));
        }
    }
    Ok(())
}

fn workers_ops() -> impl Strategy<Value = Vec<Vec<Op>>> {
    proptest::collection::vec(proptest::collection::vec(op(), 0..40), 1..5)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_index_never_credits_a_block_the_worker_does_not_hold(
        ops in workers_ops(),
        faults in proptest::collection::vec(fault(), 1..16),
    ) {
        let published: Vec<Published> = ops.iter().map(|o| publish(o)).collect();
        let order = deliveries(&published, &faults);
        let mut index = KvIndex::default();
        let at = feed(&mut index, &order);
        prop_assert_eq!(check_sound(&index, &published, &at), Ok(()));
    }

    #[test]
    fn fed_every_batch_even_twice_the_index_equals_the_real_caches(
        ops in workers_ops(),
        duplicate in proptest::collection::vec(any::<bool>(), 1..8),
    ) {
        let published: Vec<Published> = ops.iter().map(|o| publish(o)).collect();
        let faults: Vec<Fault> = duplicate
            .iter()
            .map(|&d| if d { Fault::Duplicate } else { Fault::Deliver })
            .collect();
        let mut index = KvIndex::default();
        feed(&mut index, &deliveries(&published, &faults));
        for (w, p) in published.iter().enumerate() {
            let credited: BTreeSet<u64> = index.blocks_of(w as InstanceId + 1).collect();
            prop_assert_eq!(&credited, &p.real, "worker {}", w + 1);
        }
    }

    #[test]
    fn the_scoring_walk_agrees_with_each_workers_leading_count(
        ops in workers_ops(),
        request in proptest::collection::vec(0u8..24, 0..8),
    ) {
        let published: Vec<Published> = ops.iter().map(|o| publish(o)).collect();
        let mut index = KvIndex::default();
        feed(&mut index, &deliveries(&published, &[Fault::Deliver]));
        let hashes: Vec<u64> = request.iter().map(|&b| block(b)).collect();
        let mut out = Vec::new();
        index.overlaps(&hashes, &mut out);
        let walked: BTreeMap<InstanceId, usize> = out.iter().copied().collect();
        prop_assert_eq!(walked.len(), out.len(), "a worker listed twice");
        for w in 1..=published.len() as InstanceId {
            let expected = index.overlap(&hashes, w);
            prop_assert_eq!(walked.get(&w).copied().unwrap_or(0), expected, "worker {}", w);
        }
    }

    #[test]
    fn deep_overlaps_list_exactly_the_workers_beyond_the_widely_held_prefix(
        ops in workers_ops(),
        request in proptest::collection::vec(0u8..24, 0..8),
        limit in 0usize..5,
    ) {
        let published: Vec<Published> = ops.iter().map(|o| publish(o)).collect();
        let mut index = KvIndex::default();
        feed(&mut index, &deliveries(&published, &[Fault::Deliver]));
        let hashes: Vec<u64> = request.iter().map(|&b| block(b)).collect();
        let mut out = Vec::new();
        let k = index.deep_overlaps(&hashes, limit, &mut out);
        prop_assert!(k <= hashes.len());
        prop_assert!(out.windows(2).all(|p| p[0].0 < p[1].0), "not sorted: {:?}", out);
        let listed: BTreeMap<InstanceId, usize> = out.iter().copied().collect();
        for w in 1..=published.len() as InstanceId {
            let overlap = index.overlap(&hashes, w);
            match listed.get(&w) {
                // Listed: exactly its leading blocks, and beyond k (unless k = 0: all holders).
                Some(&n) => {
                    prop_assert_eq!(n, overlap, "worker {}", w);
                    prop_assert!(overlap > k || (k == 0 && overlap > 0), "worker {} at {}", w, n);
                }
                // Unlisted: at most k leading blocks.
                None => prop_assert!(overlap <= k, "worker {} holds {} > k = {}", w, overlap, k),
            }
        }
    }
}

/// The soundness check bites: the mutant that ignores removals credits a removed block on
/// some interleaving, and the check says so.
#[test]
fn the_soundness_check_catches_an_index_that_ignores_removals() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (workers_ops(), proptest::collection::vec(fault(), 1..16));
    let mut caught = 0;
    for _ in 0..256 {
        let (ops, faults) = strategy.new_tree(&mut runner).unwrap().current();
        let published: Vec<Published> = ops.iter().map(|o| publish(o)).collect();
        let order = deliveries(&published, &faults);
        let mut real = KvIndex::default();
        let at = feed(&mut real, &order);
        assert_eq!(check_sound(&real, &published, &at), Ok(()));
        let mut mutant = KvIndex::default().with_mutant(IndexMutant::IgnoresRemovals);
        let at = feed(&mut mutant, &order);
        if check_sound(&mutant, &published, &at).is_err() {
            caught += 1;
        }
    }
    assert!(
        caught > 0,
        "the check never caught the removal-ignoring mutant"
    );
}

#[test]
fn a_gap_drops_the_workers_entries_and_resyncs_from_the_next_batch() {
    let mut index = KvIndex::default();
    let stored = |seq, blocks: Vec<u64>| EventBatch {
        epoch: 1,
        seq,
        events: vec![KvEvent::Stored {
            parent: None,
            blocks,
        }],
    };
    assert_eq!(index.apply(7, &stored(0, vec![1, 2])), Applied::Started);
    assert_eq!(index.apply(7, &stored(1, vec![3])), Applied::InOrder);
    assert_eq!(index.apply(7, &stored(1, vec![9])), Applied::Stale);
    assert_eq!(index.overlap(&[1, 2, 3], 7), 3);
    // Batch 2 is lost (it removed block 1, say): batch 3 is a gap.
    assert_eq!(index.apply(7, &stored(3, vec![4])), Applied::Resynced);
    assert_eq!(index.blocks_of(7).collect::<Vec<_>>(), vec![4]);
    assert_eq!(index.apply(7, &stored(2, vec![5])), Applied::Stale, "late");
    // A restart (newer epoch) starts afresh; the old epoch's batches are then stale.
    let restarted = EventBatch {
        epoch: 2,
        seq: 0,
        events: vec![KvEvent::Stored {
            parent: None,
            blocks: vec![8],
        }],
    };
    assert_eq!(index.apply(7, &restarted), Applied::Started);
    assert_eq!(index.blocks_of(7).collect::<Vec<_>>(), vec![8]);
    assert_eq!(index.apply(7, &stored(4, vec![6])), Applied::Stale);
    index.remove_worker(7);
    assert!(!index.publishes(7) && index.is_empty());
}

#[test]
fn a_worker_claiming_more_than_its_limit_is_dropped() {
    let mut index = KvIndex::new(2);
    let batch = EventBatch {
        epoch: 0,
        seq: 0,
        events: vec![KvEvent::Stored {
            parent: None,
            blocks: vec![1, 2, 3],
        }],
    };
    assert_eq!(index.apply(1, &batch), Applied::Overflowed);
    assert_eq!(index.blocks_of(1).count(), 0);
    assert!(index.is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The snapshot rule: whatever the index held for the worker (a lossy, reordered prefix of
    /// its stream), a snapshot consistent with batch `k` (and possibly already holding the
    /// changes of a few later batches, not yet handed out when it was taken), then late copies
    /// of the covered batches and every later batch, leave the index equal to the real cache.
    #[test]
    fn a_snapshot_then_the_later_batches_equals_the_real_cache(
        ops in proptest::collection::vec(op(), 0..60),
        cut in any::<proptest::sample::Index>(),
        ahead in 0usize..3,
        faults in proptest::collection::vec(fault(), 1..16),
    ) {
        let p = publish(&ops);
        prop_assume!(!p.batches.is_empty());
        let k = cut.index(p.batches.len());
        let at = &p.batches[k];
        // The cache state a few batches on, within the same epoch.
        let mut state_at = k;
        while state_at + 1 < p.batches.len()
            && state_at < k + ahead
            && p.batches[state_at + 1].epoch == at.epoch
        {
            state_at += 1;
        }
        let state = &p.batches[state_at];
        let snapshot = KvSnapshot {
            epoch: at.epoch,
            seq: Some(at.seq),
            chains: p.after[&(state.epoch, state.seq)]
                .iter()
                .map(|&h| KvEvent::Stored { parent: None, blocks: vec![h] })
                .collect(),
        };
        let mut index = KvIndex::default();
        let covered = |b: &EventBatch| (b.epoch, b.seq) <= (at.epoch, at.seq);
        for (w, b) in deliveries(std::slice::from_ref(&p), &faults) {
            if covered(&b) {
                index.apply(w, &b);
            }
        }
        prop_assert_ne!(index.apply_snapshot(1, &snapshot), Applied::Stale);
        for b in &p.batches[..=k] {
            prop_assert_eq!(index.apply(1, b), Applied::Stale, "covered by the snapshot");
        }
        for b in &p.batches[k + 1..] {
            index.apply(1, b);
        }
        let credited: BTreeSet<u64> = index.blocks_of(1).collect();
        prop_assert_eq!(credited, p.real);
    }
}

#[test]
fn a_snapshot_before_the_epochs_first_batch_lets_batch_zero_apply_in_order() {
    let mut index = KvIndex::default();
    let stored = |epoch, seq, h| EventBatch {
        epoch,
        seq,
        events: vec![KvEvent::Stored {
            parent: None,
            blocks: vec![h],
        }],
    };
    assert_eq!(index.apply(4, &stored(1, 7, 70)), Applied::Started);
    let snapshot = KvSnapshot {
        epoch: 2,
        seq: None,
        chains: vec![KvEvent::Stored {
            parent: None,
            blocks: vec![5, 6],
        }],
    };
    assert_eq!(index.apply_snapshot(4, &snapshot), Applied::Started);
    assert_eq!(index.overlap(&[5, 6], 4), 2);
    assert!(
        !index.holds(4, 70),
        "the older epoch's entries are replaced"
    );
    assert_eq!(index.apply(4, &stored(2, 0, 8)), Applied::InOrder);
    assert_eq!(index.apply(4, &stored(1, 9, 9)), Applied::Stale);
    let older = KvSnapshot {
        epoch: 1,
        ..KvSnapshot::default()
    };
    assert_eq!(index.apply_snapshot(4, &older), Applied::Stale);
    assert_eq!(
        index.overlap(&[5, 6, 8], 4),
        3,
        "unchanged by the stale snapshot"
    );
}
