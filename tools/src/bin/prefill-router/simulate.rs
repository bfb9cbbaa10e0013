//! `prefill-router simulate`: the deterministic simulator from the command line.
//!
//! One seed, one run (or `--seeds N` consecutive seeds from `--seed`); prints each report and
//! exits non-zero if any oracle was violated, each failure with its one-line reproduction.

use std::process::ExitCode;

use crate::args::{CliError, Flags};

/// Usage of `prefill-router simulate`.
pub const USAGE: &str = "\
usage: prefill-router simulate [--seed N] [--steps K] [--seeds M] [--mutant NAME] [--conditional]
                               [--sessions] [--kv-events] [--frontends N] [--quiet]

Runs the real PrefillRouter against a seeded in-memory world (faulty discovery feed, builds
that fail/hang/outlive cancellation, workers that crash/reject/hang) on a paused clock, and
checks the oracles listed in docs/simulation.md.

  --seed N      first seed (default 0)
  --steps K     scenario steps per run (default 200)
  --seeds M     run M consecutive seeds (default 1)
  --mutant NAME plant a defect the oracles must catch:
                ignore-admission | leak-bindings | no-prefill-timeout |
                deferred-set-target | breaker-never-closes |
                retry-reuses-failed-worker | conditional-probe-lies |
                conditional-prefill-on-probe | affinity-ignores-routable |
                affinity-keeps-live-entry | affinity-inherited-by-rebuild |
                kv-ignores-removals | reports-own-work | ledger-keeps-failed-work
  --conditional run the router with the conditional disaggregation policy
                (prefill_router_tools::sim::conditional::POLICY) and its oracles
  --sessions    give requests session keys and the bindings session affinity
                (prefill_router_tools::sim::sessions::TTL), under the affinity oracles
  --kv-events   KV routing with workers publishing KV cache events, some batches lost or
                late, under the stale-credit oracle (prefill_router_tools::sim::kv_events)
  --frontends N N frontends (2..=4) per binding share the workers, which keep load
                ledgers and publish load reports, some lost or late, under the no-leak
                and no-double-count oracles (prefill_router_tools::sim::frontends);
                not with --sessions (one frontend then)
  --quiet       print failing runs and the summary only
(from the workspace root: cargo run --release -- simulate ...)";

/// Parsed options.
pub struct SimulateOptions {
    seed: u64,
    steps: u32,
    seeds: u64,
    mutant: Option<String>,
    /// Run with the conditional disaggregation policy.
    conditional: bool,
    /// Run with sessions and session affinity.
    sessions: bool,
    /// Run with KV events.
    kv_events: bool,
    /// Frontends per binding.
    frontends: u32,
    quiet: bool,
}

impl SimulateOptions {
    /// Parse the arguments after `simulate`.
    pub fn parse(args: &[String]) -> Result<Self, CliError> {
        let mut options = SimulateOptions {
            seed: 0,
            steps: 200,
            seeds: 1,
            mutant: None,
            conditional: false,
            sessions: false,
            kv_events: false,
            frontends: 1,
            quiet: false,
        };
        let mut flags = Flags::new(args);
        while let Some(flag) = flags.next_flag() {
            match flag {
                "--seed" => options.seed = flags.parsed(flag)?,
                "--steps" => options.steps = flags.parsed(flag)?,
                "--seeds" => options.seeds = flags.parsed(flag)?,
                "--mutant" => options.mutant = Some(flags.value(flag)?.to_owned()),
                "--conditional" => options.conditional = true,
                "--sessions" => options.sessions = true,
                "--kv-events" => options.kv_events = true,
                "--frontends" => {
                    let max = prefill_router_tools::sim::frontends::MAX_FRONTENDS;
                    options.frontends = flags.parsed(flag)?;
                    if !(1..=max).contains(&options.frontends) {
                        return Err(CliError::Usage(format!("--frontends must be 1..={max}")));
                    }
                }
                "--quiet" => options.quiet = true,
                "--help" | "-h" => return Err(CliError::Help(USAGE.to_owned())),
                other => return Err(CliError::Usage(format!("unknown option `{other}`"))),
            }
        }
        if options.sessions && options.frontends > 1 {
            return Err(CliError::Usage(
                "--frontends above 1 does not combine with --sessions".to_owned(),
            ));
        }
        Ok(options)
    }
}

/// Run the simulations (each on its own paused runtime, off the CLI's runtime).
pub async fn run(options: SimulateOptions) -> ExitCode {
    crate::args::off_runtime("simulator", move || run_blocking(&options)).await
}

fn run_blocking(options: &SimulateOptions) -> ExitCode {
    use std::io::Write;

    use prefill_router_tools::sim::{parse_mutant, simulate, SimConfig};

    let mutant = match options.mutant.as_deref().map(|m| (m, parse_mutant(m))) {
        None => None,
        Some((_, Some(m))) => Some(m),
        Some((name, None)) => {
            eprintln!("error: unknown mutant `{name}`\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let started = std::time::Instant::now();
    let (mut failed, mut requests) = (0u64, 0u64);
    let mut out = std::io::stdout().lock();
    for seed in options.seed..options.seed.saturating_add(options.seeds) {
        let mut config = SimConfig::new(seed, options.steps);
        config.mutant = mutant;
        config.conditional = options.conditional;
        config.sessions = options.sessions;
        config.kv_events = options.kv_events;
        config = config.with_frontends(options.frontends);
        let report = match simulate(&config) {
            Ok(report) => report,
            Err(error) => {
                eprintln!("error: cannot build the simulation runtime: {error}");
                return ExitCode::FAILURE;
            }
        };
        requests += report.stats.requests;
        if !report.passed() {
            failed += 1;
        }
        if !options.quiet || !report.passed() {
            // A closed pipe (`| head`) is not an error worth a panic.
            let _ = write!(out, "{report}");
        }
    }
    let wall = started.elapsed();
    let _ = writeln!(
        out,
        "{} runs, {failed} failed; {requests} simulated requests in {wall:.2?} wall ({:.0} \
         requests/s)",
        options.seeds,
        requests as f64 / wall.as_secs_f64().max(1e-9)
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
