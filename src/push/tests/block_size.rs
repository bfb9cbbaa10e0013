//! The KV cost means the same at every block size (issue #40): the same workload in tokens
//! routes the same way at 16 and at 512 tokens per block, and a conversation whose history is
//! cached on one worker of an otherwise idle pool stays there whatever the block size.

use std::collections::HashSet;

use proptest::prelude::*;
use tokio_util::sync::CancellationToken;

use super::booking::{in_runtime, instance, Dispatcher, Unreached};
use crate::advert::KvRouterConfig;
use crate::discovery::{InstanceEvent, InstanceId};
use crate::push::select::{self, Candidate, Choice, CostMutant, KvCost};
use crate::push::{block_hashes, PushConfig, PushMode, RoutableView};
use crate::request::GenerateRequest;

/// The coarse block size every workload is aligned to (the Mooncake traces' 512).
const UNIT: u32 = 512;

/// One step of a workload in tokens.
#[derive(Clone, Debug)]
enum Op {
    /// A request: `units` shared 512-token units (equal ids, equal tokens), then a tail of
    /// `tail` tokens of its own that no later request extends; held until its `End`.
    Request { units: Vec<u16>, tail: u32 },
    /// The held request at this position ends (its booking goes; its recent work stays).
    End(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (proptest::collection::vec(0..6u16, 0..6), 0..700u32)
            .prop_map(|(units, tail)| Op::Request { units, tail }),
        2 => (0..8usize).prop_map(Op::End),
    ]
}

/// The tokens of request number `n`: its units, then its own tail.
fn tokens(n: usize, units: &[u16], tail: u32) -> Vec<u32> {
    let unit = |u: u16| (0..UNIT).map(move |t| u32::from(u) << 16 | t);
    let own = (0..tail).map(move |t| 1 << 31 | (n as u32) << 10 | t);
    units.iter().flat_map(|&u| unit(u)).chain(own).collect()
}

/// The pool as the cost sees it at one block size: each worker's cached blocks (every block
/// of every prompt it prefilled), booked work per held request, and recent work.
struct Pool {
    block: u32,
    cached: Vec<HashSet<u64>>,
    booked: Vec<u64>,
    recent: Vec<f64>,
    held: Vec<(usize, u64)>,
}

impl Pool {
    fn new(block: u32, workers: usize) -> Pool {
        Pool {
            block,
            cached: vec![HashSet::new(); workers],
            booked: vec![0; workers],
            recent: vec![0.0; workers],
            held: Vec::new(),
        }
    }

    /// Pick for `prompt` by `select::choose` (the dispatcher's rule), then book, note the
    /// recent work and cache the prompt's blocks on the pick; the picked worker, if any.
    fn request(
        &mut self,
        cost: &KvCost,
        prompt: &[u32],
        busy: Option<u64>,
        salt: u64,
    ) -> Option<usize> {
        let hashes = block_hashes(prompt, self.block);
        let candidates: Vec<Candidate> = (0..self.cached.len())
            .map(|w| {
                let overlap = hashes
                    .iter()
                    .take_while(|h| self.cached[w].contains(h))
                    .count();
                Candidate::new(w as InstanceId, overlap, self.booked[w]).with_recent(self.recent[w])
            })
            .collect();
        let least = candidates.iter().map(|c| c.booked).min();
        let limit = cost.limit(busy, least);
        let Choice::Picked {
            candidate,
            uncached,
        } = select::choose(cost, prompt.len() as u64, candidates, limit, salt, salt)
        else {
            return None;
        };
        let w = candidate.id as usize;
        let booking = cost.booking(uncached);
        self.booked[w] += booking;
        self.recent[w] += booking as f64;
        self.held.push((w, booking));
        self.cached[w].extend(hashes);
        Some(w)
    }

    fn end(&mut self, i: usize) {
        if i < self.held.len() {
            let (w, booking) = self.held.swap_remove(i);
            self.booked[w] -= booking;
        }
    }
}

/// The cost of `config` at `block` tokens per block, running `mutant` if any.
fn cost_at(block: u32, config: &KvRouterConfig, mutant: Option<CostMutant>) -> KvCost {
    let cost = KvCost::from_config(block, config);
    match mutant {
        Some(m) => cost.with_mutant(m),
        None => cost,
    }
}

/// Run `ops` over `workers` at `small` and at 512 tokens per block, with the same salt per
/// request; the first request picked differently, if any.
fn invariance_violation(
    config: &KvRouterConfig,
    mutant: Option<CostMutant>,
    workers: usize,
    small: u32,
    ops: &[Op],
    salt: u64,
) -> Option<String> {
    let (fine, coarse) = (
        cost_at(small, config, mutant),
        cost_at(UNIT, config, mutant),
    );
    let (mut a, mut b) = (Pool::new(small, workers), Pool::new(UNIT, workers));
    let busy = config.busy_threshold_tokens;
    for (n, op) in ops.iter().enumerate() {
        match op {
            Op::Request { units, tail } => {
                let prompt = tokens(n, units, *tail);
                let s = crate::kv_events::mix(salt ^ n as u64);
                let (x, y) = (
                    a.request(&fine, &prompt, busy, s),
                    b.request(&coarse, &prompt, busy, s),
                );
                if x != y {
                    return Some(format!(
                        "request {n} ({units:?} + {tail}): {x:?} at {small}, {y:?} at 512"
                    ));
                }
            }
            Op::End(i) => {
                a.end(*i);
                b.end(*i);
            }
        }
    }
    None
}

fn config() -> impl Strategy<Value = KvRouterConfig> {
    (
        0.0..2.0f64,
        0.0..2.0f64,
        0..8_192u64,
        proptest::option::of(0..20_000u64),
        0.0..40.0f64,
        0.0..1.0f64,
        proptest::option::of(1..30_000u64),
        prop_oneof![Just(0.0), 1.0..5_000.0f64],
    )
        .prop_map(
            |(overlap, load, overhead, slack, keep, recent, busy, temperature)| KvRouterConfig {
                overlap_score_weight: overlap,
                prefill_load_scale: load,
                prefill_request_tokens: overhead,
                balance_slack_tokens: slack,
                prefill_keep_credit: keep,
                prefill_recent_work_weight: recent,
                busy_threshold_tokens: busy,
                router_temperature: temperature,
                ..KvRouterConfig::default()
            },
        )
}

/// A pool of `workers` dispatching in KV mode at `block` tokens per block (no KV events: the
/// selector's prediction stands for the caches).
fn kv_dispatcher(block: u32, workers: usize, kv: KvRouterConfig) -> Dispatcher {
    let view = RoutableView::spawn(
        futures_util::stream::pending(),
        None,
        CancellationToken::new(),
    );
    for id in 1..=workers as InstanceId {
        view.apply(InstanceEvent::Added(instance(id)));
    }
    let mode = PushMode::Kv {
        block_size: block,
        config: kv,
    };
    Dispatcher::with_link(view, mode, PushConfig::default(), Unreached)
}

/// A conversation sent turn by turn (each turn's pick is dropped, its prefill over, before the
/// next): turn `t` carries the whole history plus `growth[t]` new tokens. The workers each
/// turn went to.
fn conversation(dispatcher: &Dispatcher, first: u32, growth: &[u32]) -> Vec<InstanceId> {
    let mut history: Vec<u32> = (0..first).collect();
    let mut workers = Vec::new();
    for (turn, &g) in std::iter::once(&0).chain(growth).enumerate() {
        let start = history.len() as u32;
        history.extend((0..g).map(|t| (turn as u32 + 1) << 20 | (start + t)));
        let pick = dispatcher
            .select_held(&GenerateRequest::new(history.clone(), 1))
            .expect("an idle pool picks");
        workers.push(pick.instance().instance_id);
    }
    workers
}

/// The turns that left the first turn's worker, if any.
fn conversation_moved(
    block: u32,
    workers: usize,
    first: u32,
    growth: &[u32],
    kv: KvRouterConfig,
    mutant: Option<CostMutant>,
) -> Option<Vec<InstanceId>> {
    let dispatcher = kv_dispatcher(block, workers, kv);
    let dispatcher = match mutant {
        Some(m) => dispatcher.map_kv(|kv| kv.with_cost_mutant(m)),
        None => dispatcher,
    };
    let picks = conversation(&dispatcher, first, growth);
    picks.iter().any(|&w| w != picks[0]).then_some(picks)
}

proptest! {
    #[test]
    fn the_same_workload_in_tokens_routes_the_same_at_every_block_size(
        config in config(),
        workers in 1..6usize,
        small in prop_oneof![Just(16u32), Just(32), Just(64), Just(128)],
        ops in proptest::collection::vec(op(), 1..40),
        salt in any::<u64>(),
    ) {
        prop_assert_eq!(invariance_violation(&config, None, workers, small, &ops, salt), None);
    }

    #[test]
    fn a_conversation_cached_on_one_worker_of_an_idle_pool_stays_there_at_every_block_size(
        block in prop_oneof![Just(16u32), Just(32), Just(128), Just(512)],
        workers in 2..6usize,
        first in 0..600u32,
        growth in proptest::collection::vec(0..600u32, 1..12),
    ) {
        // The history fills at least one block from the first turn on, and every turn adds at
        // least one block's worth of tokens (a user message and the previous answer).
        let growth: Vec<u32> = growth.iter().map(|g| block + g).collect();
        let moved = in_runtime(|| {
            conversation_moved(block, workers, block + first, &growth, KvRouterConfig::default(), None)
        });
        prop_assert_eq!(moved, None);
    }
}

/// The invariance property bites: a cost that reads the overhead as tokens at 16 and as blocks
/// at 512 routes a request differently (the worker holding a prefix with a request booked).
#[test]
fn the_mutant_that_reads_the_overhead_in_blocks_at_large_blocks_is_caught() {
    let load_only = KvRouterConfig {
        prefill_keep_credit: 0.0,
        prefill_recent_work_weight: 0.0,
        ..KvRouterConfig::default()
    };
    // Request 0 caches 8 units on some worker and ends; request 2 holds one unit's work on
    // some worker; request 3 extends request 0's prefix: its holder, if also holding request
    // 2's booking, weighs 512 + 4,096 booked tokens against an idle worker's whole prompt.
    let ops = [
        Op::Request {
            units: (1..9).collect(),
            tail: 0,
        },
        Op::End(0),
        Op::Request {
            units: vec![20],
            tail: 0,
        },
        Op::Request {
            units: (1..10).collect(),
            tail: 0,
        },
    ];
    let mutant = Some(CostMutant::OverheadInBlocksAtLargeBlocks);
    let caught = (0..64u64)
        .any(|salt| invariance_violation(&load_only, mutant, 2, 16, &ops, salt).is_some());
    assert!(caught, "the mutant was not caught");
    for salt in 0..64u64 {
        assert_eq!(
            invariance_violation(&load_only, None, 2, 16, &ops, salt),
            None
        );
    }
}

/// The conversation property bites: with recent work held in full against the worker that
/// holds the conversation's cold history (each turn's 4,096-token overhead), a chat adding a
/// block a turn leaves its worker at 16 tokens per block.
#[test]
fn the_mutant_that_holds_recent_work_against_a_cold_history_is_caught() {
    let growth = [16u32; 10];
    let mutant = Some(CostMutant::RecentAgainstColdHistory);
    let moved =
        in_runtime(|| conversation_moved(16, 3, 16, &growth, KvRouterConfig::default(), mutant));
    assert!(moved.is_some(), "the mutant was not caught");
    let kept =
        in_runtime(|| conversation_moved(16, 3, 16, &growth, KvRouterConfig::default(), None));
    assert_eq!(kept, None);
}
