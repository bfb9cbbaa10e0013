//! The simulator with sessions and session affinity: many seeds hold every oracle (the affinity
//! ones of `sim/sessions.rs` included) with hits, misses and re-picks all occurring, and each
//! affinity mutant is caught by its oracle.
#![cfg(feature = "sim")]

use prefill_router::sim::{simulate, Mutant, SimConfig, SimReport};

const STEPS: u32 = 120;

fn run(config: SimConfig) -> SimReport {
    simulate(&config).expect("tokio runtime")
}

#[test]
fn two_hundred_session_seeds_hold_every_oracle_with_hits_misses_and_repicks() {
    let (mut hits, mut misses, mut repicks) = (0, 0, 0);
    let mut failures = Vec::new();
    for seed in 0..200 {
        let report = run(SimConfig::new(seed, STEPS).with_sessions());
        hits += report.stats.affinity_hits;
        misses += report.stats.affinity_misses;
        repicks += report.stats.affinity_repicks;
        if !report.passed() {
            eprintln!("{report}");
            failures.push(report.repro_command());
        }
    }
    assert!(
        failures.is_empty(),
        "reproduce with:\n{}",
        failures.join("\n")
    );
    // The oracles judged every kind of pick.
    assert!(
        hits > 0 && misses > 0 && repicks > 0,
        "hits {hits} misses {misses} repicks {repicks}"
    );
}

#[test]
fn without_sessions_nothing_is_counted() {
    for seed in 0..30 {
        let report = run(SimConfig::new(seed, STEPS));
        assert!(report.passed(), "{report}");
        let s = &report.stats;
        assert_eq!(
            (s.affinity_hits, s.affinity_misses, s.affinity_repicks),
            (0, 0, 0)
        );
    }
}

fn assert_caught(mutant: Mutant, kind: &str) {
    let caught =
        (0..30).any(|seed| run(SimConfig::new(seed, STEPS).with_mutant(mutant)).found(kind));
    assert!(caught, "mutant {mutant:?} not caught as {kind}");
}

#[test]
fn oracle_catches_affinity_that_ignores_routability() {
    assert_caught(Mutant::AffinityIgnoresRoutable, "affinity_outside_routable");
}

#[test]
fn oracle_catches_affinity_that_survives_a_rebuild() {
    assert_caught(
        Mutant::AffinityInheritedByRebuild,
        "affinity_survived_rebuild",
    );
}
