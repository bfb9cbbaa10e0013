//! The simulator with several frontends per binding sharing the workers, which keep real load
//! ledgers and publish load reports, some lost or late: many seeds hold every oracle (the
//! no-leak and no-double-count ones of `sim/frontends.rs` included) with losses, delays,
//! other frontends' work counted and the quiescent checkpoint reached, and each load-report
//! mutant is caught.

use crate::support::{assert_caught, run, sweep, STEPS};
use prefill_router_tools::sim::{Mutant, SimConfig, SimStats, Violation};

#[test]
fn five_hundred_multi_frontend_seeds_hold_every_oracle_with_lost_and_late_reports() {
    // Two or three frontends, by seed.
    let stats = sweep(0..500, |c| {
        let n = 2 + (c.seed % 2) as u32;
        c.with_frontends(n)
    });
    let sum = |f: fn(&SimStats) -> u64| stats.iter().map(f).sum::<u64>();
    let made = sum(|s| s.load_reports);
    let lost = sum(|s| s.load_reports_lost);
    let late = sum(|s| s.load_reports_late);
    let others = sum(|s| s.picks_with_others);
    let exact = sum(|s| s.picks_on_exact_view);
    let quiescent = sum(|s| s.quiescent_views_checked);
    assert!(
        made > 0 && lost > 0 && late > 0 && others > 0 && exact > 0 && quiescent > 0,
        "reports made {made} lost {lost} late {late}; picks counting others {others}, on an \
         exact view {exact}; views checked at the checkpoint {quiescent}"
    );
}

#[test]
fn multi_frontend_seeds_with_kv_events_and_the_conditional_policy_hold_every_oracle() {
    let stats = sweep(0..40, |c| {
        c.with_frontends(3).with_kv_events().with_conditional()
    });
    assert!(stats
        .iter()
        .any(|s| s.load_reports > 0 && s.kv_batches_lost > 0));
}

#[test]
fn with_one_frontend_no_load_report_is_made() {
    for s in sweep(0..30, |c| c) {
        assert_eq!(s.load_reports, 0);
    }
}

#[test]
fn oracle_catches_reports_that_hold_the_receivers_own_work() {
    assert_caught(Mutant::ReportsOwnWork, "load_double_counted");
}

#[test]
fn oracle_catches_a_ledger_that_keeps_failed_work() {
    assert_caught(Mutant::LedgerKeepsFailedWork, "load_leaked");
}

/// The end-of-run checkpoint alone (not only the check at picks) finds the leaked work, in
/// the ledger and in a frontend's view.
#[test]
fn the_quiescent_checkpoint_finds_the_work_a_ledger_kept() {
    let checks = |seed| {
        let report = run(SimConfig::new(seed, STEPS).with_mutant(Mutant::LedgerKeepsFailedWork));
        report
            .violations
            .iter()
            .filter_map(|v| match v {
                Violation::LoadLeaked { check, .. } => Some(*check),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let caught = (0..30).any(|seed| {
        let found = checks(seed);
        found.contains(&"quiescent_ledger") && found.contains(&"quiescent_view")
    });
    assert!(
        caught,
        "no seed of 0..30 caught the kept work at the checkpoint"
    );
}

/// The oracles are distinct: reports holding the receiver's own work are caught as double
/// counting only, never as a leak (the reports stay true to the ledger's changes).
#[test]
fn reports_of_own_work_are_not_mistaken_for_a_leak() {
    for seed in 0..30 {
        let report = run(SimConfig::new(seed, STEPS).with_mutant(Mutant::ReportsOwnWork));
        assert!(!report.found("load_leaked"), "{report}");
    }
}

#[test]
fn a_multi_frontend_seed_replays_the_same_history() {
    let mut exact = 0;
    for seed in 0..30 {
        let config = SimConfig::new(seed, STEPS).with_frontends(3);
        let (a, b) = (run(config.clone()), run(config));
        if a.exact_replay() {
            assert_eq!(a.digest, b.digest, "seed {seed} diverged");
            assert_eq!(a.stats, b.stats, "seed {seed} diverged");
            exact += 1;
        }
    }
    assert!(exact >= 10, "only {exact} of 30 seeds replay exactly");
}
