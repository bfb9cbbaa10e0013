use super::*;
use crate::kv_events::KvEvent;

/// The pick's id and overlap, if there was one.
pub(crate) fn picked(choice: Choice) -> Option<(InstanceId, usize)> {
    match choice {
        Choice::Picked { candidate, .. } => Some((candidate.id, candidate.overlap)),
        _ => None,
    }
}

/// Overlap against booked work alone: no keep credit, no recent work.
fn plain() -> KvRouterConfig {
    KvRouterConfig {
        prefill_load_scale: 0.5,
        ..KvRouterConfig::load_only()
    }
}

fn selector() -> KvSelector {
    KvSelector::new(4, &plain(), 1024)
}

fn stored(seq: u64, blocks: &[u64]) -> EventBatch {
    EventBatch {
        epoch: 1,
        seq,
        events: vec![KvEvent::Stored {
            parent: None,
            blocks: blocks.to_vec(),
        }],
    }
}

#[test]
fn an_evicted_prefix_stops_attracting_requests_once_the_worker_reports_it() {
    let mut kv = selector();
    let hashes = [11, 12, 13];
    // Prediction alone sends the chain back to worker 1, which it was routed to.
    kv.record(&hashes, 1);
    assert_eq!(
        picked(kv.select(&hashes, 4 * hashes.len() as u64, &[(1, 0), (2, 0)], None, 0)),
        Some((1, 3))
    );
    // Worker 1 reports that it stored the chain, then evicted it; worker 2 holds it.
    kv.apply_events(1, &stored(0, &hashes));
    let removed = EventBatch {
        epoch: 1,
        seq: 1,
        events: vec![KvEvent::Removed {
            blocks: vec![11, 12, 13],
        }],
    };
    assert_eq!(kv.apply_events(1, &removed), Applied::InOrder);
    kv.apply_events(2, &stored(0, &hashes[..2]));
    assert_eq!(
        kv.overlap(&hashes, 1),
        0,
        "prediction ignored for a publisher"
    );
    assert_eq!(
        picked(kv.select(&hashes, 4 * hashes.len() as u64, &[(1, 0), (2, 0)], None, 0)),
        Some((2, 2))
    );
}

/// Where a hot prefix sends a request, and whether a cold one stays: worker 1 holds an
/// 8-block prefix and has 100 tokens booked, worker 2 holds nothing and is idle.
fn hot_and_cold_picks(mutant: Option<KvMutant>) -> (Option<InstanceId>, Option<InstanceId>) {
    let mut kv = KvSelector::new(4, &KvRouterConfig::default(), 1024);
    if let Some(m) = mutant {
        kv = kv.with_mutant(m);
    }
    let prefix: Vec<u64> = (1..=8).collect();
    kv.apply_events(1, &stored(0, &prefix));
    let request: Vec<u64> = prefix.iter().copied().chain([100]).collect();
    let pick = |kv: &KvSelector| {
        picked(kv.select(&request, 36, &[(1, 100), (2, 0)], None, 0)).map(|p| p.0)
    };
    let cold = pick(&kv);
    for _ in 0..20 {
        kv.record_credit(&request, 8);
    }
    (cold, pick(&kv))
}

#[test]
fn a_cold_prefix_keeps_its_request_and_a_hot_one_spreads_by_load() {
    // Cold: 8 kept blocks (31 each) outweigh 25 blocks booked. Hot: the keep credit has
    // faded, and the idle worker is cheaper than waiting behind the booked work.
    assert_eq!(hot_and_cold_picks(None), (Some(1), Some(2)));
}

#[test]
fn the_mutant_whose_prefixes_never_heat_up_is_caught() {
    assert_ne!(
        hot_and_cold_picks(Some(KvMutant::IgnoresHeat)),
        hot_and_cold_picks(None)
    );
}

/// Where a conversation's second turn goes: worker 1 holds its first turn (8 blocks of 4
/// tokens, credited to it once, booked `own` tokens) and `others` tokens of other sessions'
/// recent work; worker 2 holds nothing and idled. Default KV terms.
fn second_turn(others: f64, mutant: Option<select::CostMutant>) -> Option<InstanceId> {
    let mut kv = KvSelector::new(4, &KvRouterConfig::default(), 1024);
    if let Some(m) = mutant {
        kv = kv.with_cost_mutant(m);
    }
    let first: Vec<u64> = (1..=8).collect();
    let own = 20_000u64;
    kv.record_pick(&first, 0, 1, own);
    kv.apply_events(1, &stored(0, &first));
    let second: Vec<u64> = first.iter().copied().chain([9, 10]).collect();
    #[allow(clippy::cast_precision_loss)]
    let candidates = [
        kv.candidate(&second, 1, 0).with_recent(own as f64 + others),
        kv.candidate(&second, 2, 0),
    ];
    picked(kv.select_scored(&second, 40, &candidates, 0)).map(|p| p.0)
}

#[test]
fn a_conversations_own_turns_are_not_held_against_its_worker_but_other_sessions_are() {
    // 20,000 tokens of its own work: not charged, so it stays where its history is.
    assert_eq!(second_turn(0.0, None), Some(1));
    // 20,000 tokens of other sessions' work there as well: charged in full (0.3 × 20,000
    // against a keep credit of 31 × 32 cached tokens), so it moves to the idle worker. A
    // discount by the history's coldness alone (1 here: never credited) kept it behind them.
    assert_eq!(second_turn(20_000.0, None), Some(2));
}

#[test]
fn the_mutant_that_holds_a_conversations_own_work_against_it_is_caught() {
    let mutant = Some(select::CostMutant::RecentAgainstColdHistory);
    assert_eq!(second_turn(0.0, mutant), Some(2));
}

#[test]
fn a_worker_without_events_is_scored_by_prediction_in_a_mixed_pool() {
    let mut kv = selector();
    let hashes = [21, 22, 23, 24];
    kv.record(&hashes, 1);
    // Worker 2 publishes and holds two leading blocks; worker 1 publishes nothing.
    kv.apply_events(2, &stored(0, &hashes[..2]));
    assert!(!kv.index().publishes(1) && kv.index().publishes(2));
    assert_eq!(
        picked(kv.select(&hashes, 4 * hashes.len() as u64, &[(1, 0), (2, 0)], None, 0)),
        Some((1, 4))
    );
    // Its predicted credit is weighed against the index's on one scale: 6 blocks booked on
    // worker 1 (3 at the default load scale 0.5) cost more than the 2 blocks worker 2 lacks.
    assert_eq!(
        picked(kv.select(&hashes, 16, &[(1, 24), (2, 0)], None, 0)),
        Some((2, 2))
    );
    kv.reset_events(2);
    assert!(!kv.index().publishes(2));
}

#[test]
fn the_pick_does_not_depend_on_the_candidates_order() {
    let mut kv = selector();
    for w in 0..40u64 {
        let chain: Vec<u64> = (0..6)
            .map(|i| if i < 2 { 100 + i } else { w * 10 + i })
            .collect();
        kv.apply_events(w, &stored(0, &chain[..(w as usize % 6) + 1]));
    }
    kv.record(&[100, 101, 7], 99);
    for probe in 0..40u64 {
        let hashes: Vec<u64> = (0..6)
            .map(|i| if i < 2 { 100 + i } else { probe * 10 + i })
            .collect();
        let sorted: Vec<(InstanceId, u64)> = (0..40).chain([99]).map(|w| (w, w % 4)).collect();
        let mut shuffled = sorted.clone();
        shuffled.sort_by_key(|c| mix(c.0 ^ probe));
        let pick = picked(kv.select(&hashes, 24, &sorted, None, 0));
        assert_eq!(
            pick,
            picked(kv.select(&hashes, 24, &shuffled, None, 0)),
            "probe {probe}"
        );
        let (id, overlap) = pick.unwrap();
        assert_eq!(overlap, kv.overlap(&hashes, id), "probe {probe}");
    }
}
