//! `KvSelector::select_on` (holders plus one least-loaded worker) picks a best-scoring worker,
//! as the pass over the whole pool does, through any history of loads, events and routing.

use std::sync::Arc;

use proptest::prelude::*;

use crate::advert::KvRouterConfig;
use crate::discovery::{EndpointId, Instance, InstanceId};
use crate::kv_events::{EventBatch, KvEvent};
use crate::push::kv::KvMutant;
use crate::push::select::{is_busy, Choice};
use crate::push::{KvSelector, LoadBoard};

fn members(ids: &[InstanceId]) -> Arc<[Arc<Instance>]> {
    ids.iter()
        .map(|&id| {
            Arc::new(Instance {
                endpoint: EndpointId::new("t", "prefill", "generate"),
                instance_id: id,
                address: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
            })
        })
        .collect()
}

/// Block `i` of chain `c`; chains `c < 4` share their first two blocks (a system prompt).
fn chain(c: u64, len: usize) -> Vec<u64> {
    (0..len as u64)
        .map(|i| if c < 4 && i < 2 { 1000 + i } else { c << 8 | i })
        .collect()
}

#[derive(Clone, Debug)]
enum Step {
    /// Worker publishes that it stored (a prefix of) a chain.
    Store {
        worker: u64,
        chain: u64,
        len: usize,
    },
    /// Worker publishes that it removed block `at` of a chain.
    Remove {
        worker: u64,
        chain: u64,
        at: usize,
    },
    /// The chain was routed to a worker that publishes nothing (prediction).
    Route {
        worker: u64,
        chain: u64,
        len: usize,
    },
    Acquire(u64),
    Release(u64),
    Members(Vec<u64>),
    /// A pick of a worker was credited with the first `overlap` blocks of a chain and booked
    /// `amount` there (its heat grows; the chain's own work on the worker too).
    Credit {
        worker: u64,
        chain: u64,
        len: usize,
        overlap: usize,
        amount: u64,
    },
    /// A pick placed `amount` tokens of work on a worker (its recent work grows).
    Note(u64, u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0..12u64, 0..8u64, 1..6usize).prop_map(|(worker, chain, len)| Step::Store {
            worker,
            chain,
            len
        }),
        (0..12u64, 0..8u64, 0..6usize).prop_map(|(worker, chain, at)| Step::Remove {
            worker,
            chain,
            at
        }),
        (0..12u64, 0..8u64, 1..6usize).prop_map(|(worker, chain, len)| Step::Route {
            worker,
            chain,
            len
        }),
        (0..12u64).prop_map(Step::Acquire),
        (0..12u64).prop_map(Step::Release),
        proptest::collection::vec(0..12u64, 0..12).prop_map(Step::Members),
        (0..12u64, 0..8u64, 1..6usize, 0..6usize, 1..40u64).prop_map(
            |(worker, chain, len, overlap, amount)| Step::Credit {
                worker,
                chain,
                len,
                overlap,
                amount
            }
        ),
        (0..12u64, 1..40u64).prop_map(|(w, amount)| Step::Note(w, amount)),
    ]
}

/// Tokens one `Acquire` books (one block of 4 tokens).
const BOOKING: u64 = 4;

/// The prompt length of a request of `hashes` (blocks of 4 tokens, plus a partial block).
fn tokens(hashes: &[u64]) -> u64 {
    4 * hashes.len() as u64 + 2
}

/// The pick's id and overlap, if there was one.
fn picked(choice: Choice) -> Option<(InstanceId, usize)> {
    match choice {
        Choice::Picked { candidate, .. } => Some((candidate.id, candidate.overlap)),
        _ => None,
    }
}

/// Workers 0..6 publish events; 6..12 are scored by prediction.
fn publishes(worker: u64) -> bool {
    worker < 6
}

/// Overlap against booked work alone (no keep credit, no recent work), at load scale 0.5.
fn plain() -> KvRouterConfig {
    KvRouterConfig {
        prefill_load_scale: 0.5,
        ..KvRouterConfig::load_only()
    }
}

/// `deep_limit`: list holders from the first block held by at most this many workers;
/// `mutant`: the walk ignores the shallow blocks; the KV terms of `config`.
fn build_on(
    steps: &[Step],
    deep_limit: usize,
    mutant: bool,
    config: &KvRouterConfig,
) -> (KvSelector, LoadBoard) {
    let mut kv = KvSelector::new(4, config, 64).with_deep_limit(deep_limit);
    if mutant {
        kv = kv.with_mutant(KvMutant::IgnoresShallow);
    }
    let mut board = LoadBoard::default();
    board.set_members(members(&(0..12).collect::<Vec<_>>()));
    let mut seq = [0u64; 12];
    for s in steps {
        let mut publish = |kv: &mut KvSelector, worker: u64, event: KvEvent| {
            let w = usize::try_from(worker).unwrap_or(0);
            kv.apply_events(
                worker,
                &EventBatch {
                    epoch: 1,
                    seq: seq[w],
                    events: vec![event],
                },
            );
            seq[w] += 1;
        };
        match s {
            Step::Store {
                worker,
                chain: c,
                len,
            } if publishes(*worker) => {
                let blocks = chain(*c, *len);
                publish(
                    &mut kv,
                    *worker,
                    KvEvent::Stored {
                        parent: None,
                        blocks,
                    },
                );
            }
            Step::Remove {
                worker,
                chain: c,
                at,
            } if publishes(*worker) => {
                let block = chain(*c, 6)[*at];
                publish(
                    &mut kv,
                    *worker,
                    KvEvent::Removed {
                        blocks: vec![block],
                    },
                );
            }
            Step::Route {
                worker,
                chain: c,
                len,
            } if !publishes(*worker) => {
                kv.record(&chain(*c, *len), *worker);
            }
            Step::Credit {
                worker,
                chain: c,
                len,
                overlap,
                amount,
            } => kv.record_pick(&chain(*c, *len), *overlap, *worker, *amount),
            Step::Note(w, amount) => board.note_work(*w, *amount),
            Step::Acquire(w) => board.acquire(*w, BOOKING),
            Step::Release(w) => board.release(*w, BOOKING),
            Step::Members(ids) => {
                let mut ids = ids.clone();
                ids.sort_unstable();
                ids.dedup();
                board.set_members(members(&ids));
            }
            _ => {}
        }
    }
    (kv, board)
}

/// What a correct pick satisfies: a usable member that is not busy (none only when there is
/// none; overloaded only when every usable member is busy), its overlap as the selector credits
/// it, and the least cost over every usable member that is not busy.
fn check(
    kv: &KvSelector,
    board: &LoadBoard,
    excluded: &[InstanceId],
    hashes: &[u64],
    threshold: Option<u64>,
    choice: Choice,
) -> Result<(), String> {
    let cost = |id: InstanceId| {
        kv.cost().cost(
            tokens(hashes),
            &kv.candidate(hashes, id, board.combined(id))
                .with_recent(board.recent(id)),
        )
    };
    let usable: Vec<InstanceId> = board
        .members()
        .iter()
        .map(|i| i.instance_id)
        .filter(|id| !excluded.contains(id))
        .collect();
    let free: Vec<InstanceId> = usable
        .iter()
        .copied()
        .filter(|&id| !is_busy(board.combined(id), threshold))
        .collect();
    let best = free.iter().map(|&id| cost(id)).reduce(f64::min);
    match (choice, best) {
        (Choice::Empty, None) if usable.is_empty() => Ok(()),
        (Choice::Overloaded, None) if !usable.is_empty() => Ok(()),
        (Choice::Picked { candidate, .. }, Some(best)) => {
            let (id, overlap) = (candidate.id, candidate.overlap);
            if !free.contains(&id) {
                return Err(format!(
                    "picked {id}, not a usable member under the threshold"
                ));
            }
            if overlap != kv.overlap(hashes, id) {
                return Err(format!("overlap {overlap} reported for {id}"));
            }
            if cost(id) != best {
                return Err(format!("picked {id} costing {}, best is {best}", cost(id)));
            }
            Ok(())
        }
        (choice, best) => Err(format!("choice {choice:?} with best {best:?}")),
    }
}

/// One case of the `select_on` property: a history, a request, exclusions, a tie salt, a deep
/// limit, a busy threshold and the KV terms (overlap weight, keep credit, recent-work weight,
/// heat half-life).
type Case = (
    Vec<Step>,
    (u64, usize),
    Vec<u64>,
    u64,
    usize,
    Option<u64>,
    (f64, f64, f64, u32),
);

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::collection::vec(step(), 0..80),
        (0..10u64, 0..7usize),
        proptest::collection::vec(0..12u64, 0..3),
        any::<u64>(),
        // Small limits make the shared prefix (chains 0..4) "widely held": the walk's path.
        prop_oneof![0..4usize, Just(crate::push::DEEP_HOLDERS_LIMIT)],
        proptest::option::of(1..24u64),
        (
            prop_oneof![Just(0.25), Just(1.0)],
            prop_oneof![Just(0.0), Just(31.0), Just(2.0)],
            prop_oneof![Just(0.0), Just(0.3), Just(1.5)],
            prop_oneof![Just(1u32), Just(32)],
        ),
    )
}

/// The property on one case, for the selector with `mutant` (none: the real one).
fn property(case: &Case, mutant: Option<KvMutant>) -> Result<(), String> {
    let (steps, request, excluded, random, deep_limit, threshold, terms) = case;
    let config = KvRouterConfig {
        overlap_score_weight: terms.0,
        prefill_keep_credit: terms.1,
        prefill_recent_work_weight: terms.2,
        prefill_heat_half_life: terms.3,
        ..KvRouterConfig::default()
    };
    let (mut kv, board) = build_on(steps, *deep_limit, false, &config);
    if let Some(m) = mutant {
        kv = kv.with_mutant(m);
    }
    let hashes = chain(request.0, request.1);
    let pick = kv.select_on(
        &hashes,
        tokens(&hashes),
        &board,
        excluded,
        *threshold,
        *random,
    );
    check(&kv, &board, excluded, &hashes, *threshold, pick)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn select_on_picks_a_best_scoring_member(case in case()) {
        prop_assert_eq!(property(&case, None), Ok(()));
    }
}

/// Whether the property finds a case the selector with `mutant` gets wrong: a search of 8,192
/// cases from a fixed seed, so the check gives the same answer on every run (from a random seed,
/// 4,096 cases missed the walk mutant in 1 of 20 runs of the library's tests once the histories
/// recorded own work).
fn caught(mutant: KvMutant) -> bool {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 8_192,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x5e1e_c70f),
        ..ProptestConfig::default()
    });
    runner
        .run(&case(), |case| {
            prop_assert_eq!(property(&case, Some(mutant)), Ok(()));
            Ok(())
        })
        .is_err()
}

/// The property bites on the walk's keep-credit bound: a floor that forgets the keep credit
/// stops before a cold shallow holder that would have won.
#[test]
fn the_check_catches_a_floor_that_ignores_the_keep_credit() {
    assert!(caught(KvMutant::FloorIgnoresKeep));
}

/// The property bites on the walk's recent-work order: ending the whole walk where only the
/// rest of one load was beaten misses a cheaper member of a later load.
#[test]
fn the_check_catches_a_walk_that_stops_on_recent_work() {
    assert!(caught(KvMutant::RecentStopsWalk));
}

/// The check bites: a fast path that scores only the holders (forgetting that an idle worker
/// holding nothing can beat a busy holder) is caught.
#[test]
fn the_check_catches_a_pick_that_ignores_the_least_loaded_worker() {
    let steps = [
        Step::Store {
            worker: 1,
            chain: 5,
            len: 1,
        },
        Step::Acquire(1),
        Step::Acquire(1),
        Step::Acquire(1),
        Step::Members(vec![1, 2]),
    ];
    let (kv, board) = build_on(&steps, crate::push::DEEP_HOLDERS_LIMIT, false, &plain());
    let hashes = chain(5, 1);
    let holders_only = kv.select(&hashes, tokens(&hashes), &[(1, board.load(1))], None, 0);
    assert!(check(&kv, &board, &[], &hashes, None, holders_only).is_err());
    let pick = kv.select_on(&hashes, tokens(&hashes), &board, &[], None, 0);
    assert_eq!(check(&kv, &board, &[], &hashes, None, pick), Ok(()));
    assert_eq!(picked(pick), Some((2, 0)));
}

/// The check bites on the walk too: a selector whose load-order walk credits nobody with the
/// widely held prefix (so a worker holding it looks no better than an idle one holding nothing)
/// is caught.
#[test]
fn the_check_catches_a_walk_that_ignores_the_widely_held_prefix() {
    // Chain 0 = [1000, 1001, 2]; chain 1 = [1000, 1001, ...]: the first two blocks are shared.
    let steps = [
        Step::Store {
            worker: 1,
            chain: 0,
            len: 3,
        },
        Step::Store {
            worker: 2,
            chain: 1,
            len: 2,
        },
        Step::Store {
            worker: 3,
            chain: 1,
            len: 2,
        },
        Step::Acquire(1),
        Step::Acquire(1),
        Step::Acquire(1),
        Step::Acquire(1),
        Step::Acquire(1),
        Step::Acquire(3),
        Step::Members(vec![1, 2, 3, 4, 5]),
    ];
    let hashes = chain(0, 3);
    // Limit 1: blocks 1000 and 1001 (3 holders) are shallow, block 2 (1 holder) is deep, so
    // k = 2; worker 2 (nothing booked, 2 blocks held) costs 1.5 blocks, worker 1 (5 blocks
    // booked at scale 0.5, 3 held) 2.5, idle non-holders 3.5.
    let (kv, board) = build_on(&steps, 1, false, &plain());
    assert_eq!(kv.index().deep_overlaps(&hashes, 1, &mut Vec::new()), 2);
    let pick = kv.select_on(&hashes, tokens(&hashes), &board, &[], None, 0);
    assert_eq!(check(&kv, &board, &[], &hashes, None, pick), Ok(()));
    assert_eq!(picked(pick), Some((2, 2)));
    let (mutant, board) = build_on(&steps, 1, true, &plain());
    let pick = mutant.select_on(&hashes, tokens(&hashes), &board, &[], None, 0);
    assert!(
        check(&mutant, &board, &[], &hashes, None, pick).is_err(),
        "{pick:?}"
    );
}
