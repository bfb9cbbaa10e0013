//! The simulator with the conditional disaggregation policy on: many seeds hold every oracle
//! (the conditional ones of `sim/conditional.rs` included), both skip reasons occur, and each
//! conditional mutant is caught by its oracle.

use crate::support::{assert_caught, sweep};
use prefill_router_tools::sim::Mutant;

#[test]
fn two_hundred_conditional_seeds_hold_every_oracle_and_skip_for_both_reasons() {
    let stats = sweep(0..200, |c| c.with_conditional());
    let short: u64 = stats.iter().map(|s| s.conditional_short).sum();
    let busy: u64 = stats.iter().map(|s| s.conditional_busy).sum();
    let prefilled: u64 = stats.iter().map(|s| s.prefilled_ok).sum();
    // The oracles judged real skips of both kinds, and requests still prefilled.
    assert!(
        short > 0 && busy > 0 && prefilled > 0,
        "{short} {busy} {prefilled}"
    );
}

#[test]
fn without_the_policy_nothing_is_skipped() {
    for s in sweep(0..30, |c| c) {
        assert_eq!((s.conditional_short, s.conditional_busy), (0, 0));
    }
}

#[test]
fn oracle_catches_a_skip_decided_on_a_probe_that_lies() {
    assert_caught(
        Mutant::ConditionalProbeLies,
        "conditional_skip_without_condition",
    );
}

#[test]
fn oracle_catches_a_request_prefilled_remotely_and_skipped() {
    assert_caught(
        Mutant::ConditionalPrefillOnProbe,
        "conditional_prefilled_and_skipped",
    );
}
