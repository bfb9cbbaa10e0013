//! `dynamo-replay`: one replay table with Dynamo's own router (`dynamo-crate`) beside our
//! policies, on the same simulated engines (see README.md).

use std::process::ExitCode;
use std::time::Duration;

use dynamo_replay::DynamoCrate;
use prefill_router_tools::replay::{
    read_trace, run, ClosedLoop, Policy, ReplayConfig, ReplayReport, TraceRecord, Workload,
    BLOCK_TOKENS,
};

const USAGE: &str = "\
usage: dynamo-replay (--trace FILE | --workload SPEC) [--policy LIST] [--cache-blocks C]
                     [--closed-loop U[:T]] [--block-tokens B] [--workers N] [--limit K]
                     [--json OUT] [--quiet]

One table: every policy of LIST over the same trace (default
kv,kv-events,dynamo,dynamo-blocks,dynamo-crate,round-robin); `dynamo-crate` is Dynamo's
dynamo-kv-router 1.6.1 (radix-tree indexer, DefaultWorkerSelector at its default
KvRouterConfig, its own active-sequence booking). The other names and flags are those of
`prefill-router replay`.";

/// The parsed command line.
struct Options {
    trace: Vec<TraceRecord>,
    unit_tokens: u32,
    policies: Vec<String>,
    cache_blocks: Option<usize>,
    closed_loop: Option<ClosedLoop>,
    block_tokens: u32,
    workers: usize,
    limit: Option<usize>,
    json: Option<String>,
    quiet: bool,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut options = Options {
        trace: Vec::new(),
        unit_tokens: BLOCK_TOKENS,
        policies: "kv,kv-events,dynamo,dynamo-blocks,dynamo-crate,round-robin"
            .split(',')
            .map(str::to_owned)
            .collect(),
        cache_blocks: None,
        closed_loop: None,
        block_tokens: BLOCK_TOKENS,
        workers: 6,
        limit: None,
        json: None,
        quiet: false,
    };
    let mut source = None;
    let mut it = args.iter();
    let number = |v: Option<&String>, flag: &str| -> Result<usize, String> {
        v.and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{flag} needs a number"))
    };
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--trace" => {
                let path = it.next().ok_or("--trace needs a file")?;
                let trace =
                    read_trace(std::path::Path::new(path)).map_err(|e| format!("{path}: {e}"))?;
                source = Some(trace);
            }
            "--workload" => {
                let spec = it.next().ok_or("--workload needs a spec")?;
                let workload = Workload::parse(spec).map_err(|e| format!("{spec}: {e}"))?;
                options.unit_tokens = workload.unit_tokens();
                source = Some(workload.generate());
            }
            "--policy" => {
                let list = it.next().ok_or("--policy needs a list")?;
                options.policies = list.split(',').map(str::to_owned).collect();
                if let Some(bad) = options
                    .policies
                    .iter()
                    .find(|p| *p != dynamo_replay::POLICY_NAME && Policy::parse(p).is_none())
                {
                    return Err(format!("unknown policy {bad}"));
                }
            }
            "--cache-blocks" => options.cache_blocks = Some(number(it.next(), flag)?),
            "--closed-loop" => {
                let spec = it.next().ok_or("--closed-loop needs U[:T]")?;
                options.closed_loop = Some(closed_loop(spec)?);
            }
            "--block-tokens" => {
                options.block_tokens = u32::try_from(number(it.next(), flag)?)
                    .map_err(|_| "--block-tokens is too large".to_owned())?;
            }
            "--workers" => options.workers = number(it.next(), flag)?,
            "--limit" => options.limit = Some(number(it.next(), flag)?),
            "--json" => options.json = Some(it.next().ok_or("--json needs a file")?.clone()),
            "--quiet" => options.quiet = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    options.trace = source.ok_or("--trace or --workload is required")?;
    Ok(options)
}

/// One `--closed-loop` spec: `USERS[:THINK_MS]` (think time 1,000 ms by default).
fn closed_loop(spec: &str) -> Result<ClosedLoop, String> {
    let bad = || format!("--closed-loop USERS[:THINK_MS], not `{spec}`");
    let (users, think) = spec.split_once(':').unwrap_or((spec, "1000"));
    let users: usize = users.parse().map_err(|_| bad())?;
    let think: u64 = think.parse().map_err(|_| bad())?;
    if users == 0 {
        return Err(bad());
    }
    Ok(ClosedLoop {
        users,
        think: Duration::from_millis(think),
    })
}

/// The replay of `name` under `options`.
fn config(options: &Options, name: &str) -> ReplayConfig {
    let (policy, external) = match Policy::parse(name) {
        Some(policy) => (policy, None),
        None => (
            Policy::External,
            Some(DynamoCrate::default().into_external()),
        ),
    };
    ReplayConfig {
        workers: options.workers,
        cache_blocks: options.cache_blocks,
        block_tokens: options.block_tokens,
        unit_tokens: options.unit_tokens,
        limit: options.limit,
        closed_loop: options.closed_loop,
        progress: !options.quiet,
        external,
        ..ReplayConfig::new(policy)
    }
}

/// The report as a row of docs/performance.md's tables.
fn row(report: &ReplayReport) -> String {
    format!(
        "| {} | {:.2}% | {:.1}% | {:.0} | {:.0} | {:.0} | {:.3} | {} |",
        report.policy,
        report.prefix_hit_rate * 100.0,
        report.of_ceiling * 100.0,
        report.ttft_ms.p50,
        report.ttft_ms.p90,
        report.ttft_ms.p99,
        report.work_imbalance,
        report.lost,
    )
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let options = match parse(&args) {
        Ok(options) => options,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("error: {message}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut reports = Vec::new();
    for name in &options.policies {
        match run(&config(&options, name), &options.trace) {
            Ok(report) => {
                println!("{report}");
                reports.push(report);
            }
            Err(error) => {
                eprintln!("error: {name}: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("\n| policy | hit | of ceiling | p50 | p90 | p99 | work max/mean | lost |");
    println!("|---|---|---|---|---|---|---|---|");
    for report in &reports {
        println!("{}", row(report));
    }
    if let Some(path) = &options.json {
        let doc = serde_json::json!({ "runs": reports });
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        if let Err(error) = std::fs::write(path, text) {
            eprintln!("error: {path}: {error}");
            return ExitCode::FAILURE;
        }
    }
    if reports.iter().any(|r| r.lost > 0) {
        eprintln!("error: requests lost");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
