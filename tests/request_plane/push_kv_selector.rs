//! The KV selector alone: prefix hashing, scoring, ties, bounded memory.

use prefill_router::advert::KvRouterConfig;
use prefill_router::push::{block_hashes, KvSelector};
use proptest::prelude::*;

fn selector(capacity: usize) -> KvSelector {
    KvSelector::new(4, &KvRouterConfig::default(), capacity)
}

#[test]
fn block_hashes_cover_full_blocks_and_chain_prefixes() {
    let a = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
    assert_eq!(a.len(), 2, "the partial block is not hashed");
    let b = block_hashes(&[1, 2, 3, 4, 0, 6, 7, 8], 4);
    assert_eq!(a[0], b[0]);
    assert_ne!(a[1], b[1]);
    // Same second block after a different first block: chained, so different.
    let c = block_hashes(&[0, 2, 3, 4, 5, 6, 7, 8], 4);
    assert_ne!(a[1], c[1]);
    assert!(block_hashes(&[1, 2, 3], 0).is_empty());
}

#[test]
fn best_overlap_wins_and_load_can_outweigh_it() {
    let mut kv = selector(1024);
    let prompt: Vec<u32> = (0..32).collect();
    let h = block_hashes(&prompt, 4);
    kv.record(&h[..3], 2);
    kv.record(&h, 5);
    assert_eq!(kv.overlap(&h, 5), 8);
    assert_eq!(kv.overlap(&h, 2), 3);
    let idle = [(1, 0), (2, 0), (5, 0)];
    assert_eq!(kv.select(&h, &idle, 0), Some((5, 8)));
    // Worker 5 is busy: 8 - 10 < 3 - 0.
    let busy = [(1, 0), (2, 0), (5, 10)];
    assert_eq!(kv.select(&h, &busy, 0), Some((2, 3)));
}

#[test]
fn ties_are_broken_deterministically() {
    let kv = selector(16);
    let h = block_hashes(&(0..16).collect::<Vec<_>>(), 4);
    let cands: Vec<(u64, u64)> = (1..=8).map(|i| (i, 0)).collect();
    let first = kv.select(&h, &cands, 1);
    for random in 0..50 {
        assert_eq!(kv.select(&h, &cands, random), first);
    }
    let mut reversed = cands.clone();
    reversed.reverse();
    assert_eq!(
        kv.select(&h, &reversed, 0),
        first,
        "order of candidates does not matter"
    );
}

#[test]
fn positive_temperature_samples_near_best_workers() {
    let config = KvRouterConfig {
        router_temperature: 1.0,
        ..KvRouterConfig::default()
    };
    let mut kv = KvSelector::new(4, &config, 1024);
    let h = block_hashes(&(0..64).collect::<Vec<_>>(), 4);
    kv.record(&h, 3);
    let cands = [(1, 0), (2, 0), (3, 0)];
    let mut hits = 0;
    for i in 0..200u64 {
        let random = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        if kv.select(&h, &cands, random).map(|p| p.0) == Some(3) {
            hits += 1;
        }
    }
    // exp(16) dwarfs exp(0): worker 3 nearly always; sampling is not uniform.
    assert!(hits > 190, "{hits}");
}

#[test]
fn the_least_recently_used_chains_are_evicted_first() {
    let mut kv = selector(4);
    let p1 = block_hashes(&(0..8).collect::<Vec<_>>(), 4);
    let p2 = block_hashes(&(100..108).collect::<Vec<_>>(), 4);
    let p3 = block_hashes(&(200..208).collect::<Vec<_>>(), 4);
    kv.record(&p1, 1);
    kv.record(&p2, 2);
    kv.record(&p1, 1); // p1 used again: p2 is now the oldest
    kv.record(&p3, 3);
    assert_eq!(kv.len(), 4);
    assert_eq!(kv.overlap(&p1, 1), 2);
    assert_eq!(kv.overlap(&p2, 2), 0);
    assert_eq!(kv.overlap(&p3, 3), 2);
    kv.forget(1);
    assert_eq!(kv.overlap(&p1, 1), 0);
    assert_eq!(kv.len(), 2);
}

proptest! {
    #[test]
    fn the_index_never_exceeds_its_capacity(
        capacity in 1usize..64,
        records in proptest::collection::vec((proptest::collection::vec(0u32..8, 0..40), 0u64..6), 0..60),
    ) {
        let mut kv = selector(capacity);
        for (tokens, worker) in records {
            kv.record(&block_hashes(&tokens, 4), worker);
            prop_assert!(kv.len() <= capacity);
        }
    }

    #[test]
    fn selection_picks_a_candidate(
        tokens in proptest::collection::vec(any::<u32>(), 0..64),
        loads in proptest::collection::vec(0u64..5, 1..10),
        random in any::<u64>(),
    ) {
        let mut kv = selector(128);
        let h = block_hashes(&tokens, 4);
        kv.record(&h, 0);
        let cands: Vec<(u64, u64)> = loads.iter().enumerate().map(|(i, l)| (i as u64, *l)).collect();
        let (id, _) = kv.select(&h, &cands, random).expect("non-empty");
        prop_assert!(cands.iter().any(|c| c.0 == id));
    }
}
