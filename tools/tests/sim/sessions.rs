//! The simulator with sessions and session affinity: many seeds hold every oracle (the affinity
//! ones of `sim/sessions.rs` included) with hits, misses and re-picks all occurring, and each
//! affinity mutant is caught by its oracle.

use crate::support::{assert_caught, sweep};
use prefill_router_tools::sim::Mutant;

#[test]
fn two_hundred_session_seeds_hold_every_oracle_with_hits_misses_and_repicks() {
    let stats = sweep(0..200, |c| c.with_sessions());
    let hits: u64 = stats.iter().map(|s| s.affinity_hits).sum();
    let misses: u64 = stats.iter().map(|s| s.affinity_misses).sum();
    let repicks: u64 = stats.iter().map(|s| s.affinity_repicks).sum();
    // The oracles judged every kind of pick.
    assert!(
        hits > 0 && misses > 0 && repicks > 0,
        "hits {hits} misses {misses} repicks {repicks}"
    );
}

#[test]
fn without_sessions_nothing_is_counted() {
    for s in sweep(0..30, |c| c) {
        assert_eq!(
            (s.affinity_hits, s.affinity_misses, s.affinity_repicks),
            (0, 0, 0)
        );
    }
}

#[test]
fn oracle_catches_affinity_that_ignores_routability() {
    assert_caught(Mutant::AffinityIgnoresRoutable, "affinity_outside_routable");
}

#[test]
fn oracle_catches_affinity_that_keeps_a_live_entry_off_the_rendezvous_order() {
    assert_caught(Mutant::AffinityKeepsLiveEntry, "affinity_off_rendezvous");
}

#[test]
fn oracle_catches_affinity_that_survives_a_rebuild() {
    assert_caught(
        Mutant::AffinityInheritedByRebuild,
        "affinity_survived_rebuild",
    );
}
