//! The simulator with KV routing and workers publishing KV cache events, some batches lost or
//! delayed: many seeds hold every oracle (the stale-credit one of `sim/kv_events.rs` included)
//! with losses and delays occurring, and the mutant that drops removals is caught.

use crate::support::{assert_caught, sweep};
use prefill_router_tools::sim::Mutant;

#[test]
fn two_hundred_kv_event_seeds_hold_every_oracle_with_lost_and_late_batches() {
    let stats = sweep(0..200, |c| c.with_kv_events());
    let lost: u64 = stats.iter().map(|s| s.kv_batches_lost).sum();
    let late: u64 = stats.iter().map(|s| s.kv_batches_delayed).sum();
    let prefilled: u64 = stats.iter().map(|s| s.prefilled_ok).sum();
    assert!(
        lost > 0 && late > 0 && prefilled > 0,
        "lost {lost} late {late} prefilled {prefilled}"
    );
}

#[test]
fn without_kv_events_no_batch_is_published() {
    for s in sweep(0..30, |c| c) {
        assert_eq!((s.kv_batches_lost, s.kv_batches_delayed), (0, 0));
    }
}

#[test]
fn oracle_catches_batches_published_without_their_removals() {
    assert_caught(Mutant::KvIgnoresRemovals, "kv_stale_credit");
}
