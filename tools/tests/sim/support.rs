//! Shared parts of the simulator's feature suites (conditional disaggregation, sessions, KV
//! events).

use prefill_router_tools::sim::{simulate, Mutant, SimConfig, SimReport, SimStats};

/// Steps per seed in the feature suites.
pub const STEPS: u32 = 120;

/// One run (its own paused runtime).
pub fn run(config: SimConfig) -> SimReport {
    simulate(&config).expect("tokio runtime")
}

/// Run `seeds` with `configure` applied; fail with every failing run's reproduction; the
/// runs' statistics, one per seed.
pub fn sweep(
    seeds: std::ops::Range<u64>,
    configure: impl Fn(SimConfig) -> SimConfig,
) -> Vec<SimStats> {
    let mut failures = Vec::new();
    let mut stats = Vec::new();
    for seed in seeds {
        let report = run(configure(SimConfig::new(seed, STEPS)));
        if !report.passed() {
            eprintln!("{report}");
            failures.push(report.repro_command());
        }
        stats.push(report.stats);
    }
    assert!(
        failures.is_empty(),
        "reproduce with:\n{}",
        failures.join("\n")
    );
    stats
}

/// Some seed of 0..30 with `mutant` planted breaks the oracle `kind`.
pub fn assert_caught(mutant: Mutant, kind: &str) {
    let caught =
        (0..30).any(|seed| run(SimConfig::new(seed, STEPS).with_mutant(mutant)).found(kind));
    assert!(caught, "mutant {mutant:?} not caught as {kind}");
}
