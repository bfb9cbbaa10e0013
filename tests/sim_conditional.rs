//! The simulator with the conditional disaggregation policy on: many seeds hold every oracle
//! (the conditional ones of `sim/conditional.rs` included), both skip reasons occur, and each
//! conditional mutant is caught by its oracle.
#![cfg(feature = "sim")]

use prefill_router::sim::{simulate, Mutant, SimConfig, SimReport};

const STEPS: u32 = 120;

fn run(config: SimConfig) -> SimReport {
    simulate(&config).expect("tokio runtime")
}

#[test]
fn two_hundred_conditional_seeds_hold_every_oracle_and_skip_for_both_reasons() {
    let (mut short, mut busy, mut prefilled) = (0, 0, 0);
    let mut failures = Vec::new();
    for seed in 0..200 {
        let report = run(SimConfig::new(seed, STEPS).with_conditional());
        short += report.stats.conditional_short;
        busy += report.stats.conditional_busy;
        prefilled += report.stats.prefilled_ok;
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
    // The oracles judged real skips of both kinds, and requests still prefilled.
    assert!(
        short > 0 && busy > 0 && prefilled > 0,
        "{short} {busy} {prefilled}"
    );
}

#[test]
fn without_the_policy_nothing_is_skipped() {
    for seed in 0..30 {
        let report = run(SimConfig::new(seed, STEPS));
        assert!(report.passed(), "{report}");
        assert_eq!(
            (
                report.stats.conditional_short,
                report.stats.conditional_busy
            ),
            (0, 0)
        );
    }
}

fn assert_caught(mutant: Mutant, kind: &str) {
    let caught =
        (0..30).any(|seed| run(SimConfig::new(seed, STEPS).with_mutant(mutant)).found(kind));
    assert!(caught, "mutant {mutant:?} not caught as {kind}");
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
