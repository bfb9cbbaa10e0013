//! `prefill-router replay`: a request trace through the router in virtual time, per policy.

use std::process::ExitCode;
use std::time::Duration;

use prefill_router::router::ConditionalPolicy;

use crate::args::{CliError, Flags};

/// Usage of `prefill-router replay`.
pub const USAGE: &str = "\
usage: prefill-router replay (--trace FILE | --workload SPEC) [--workers N] [--policy P] [--cache-blocks C]
                             [--block-tokens LIST] [--closed-loop LIST]
                             [--limit K] [--json OUT] [--svg OUT] [--quiet]
                             [--retarget-at T | --flap-at T | --flap-rebuild-at T]
                             [--event-loss-every K] [--event-delay-ms D]
                             [--conditional SPECS] [--affinity SPECS]
                             [--frontends LIST] [--spread round-robin|session]
                             [--no-load-reports] [--report-delay-ms D]
                             [--join-at T [--join-cold | --join-compare]]

Replays a Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length,
hash_ids of 512-token blocks) in virtual time through the real PrefillRouter and dispatchers
over in-process prefill workers with an LRU KV block cache (cost model: docs/replay.md), and
reports prefix hit rate against the trace's ceiling, TTFT, queueing and work balance.

  --trace FILE       the trace (this or --workload is required)
  --workload SPEC    a generated trace instead: shared-prefix:rate=R[,requests=N,prefix=B,seed=S]
                     (every prompt the same B blocks, default 30, plus 2-6 of its own) or
                     multi-tenant:rate=R[,requests=N,tenants=T,seed=S] (T system prompts,
                     Zipf popularity, 1-8-turn sessions) or conversation:rate=R[,requests=N,
                     seed=S] (chat sessions of 2-10 turns growing by 48-768 tokens, in
                     16-token units); docs/replay.md
  --block-tokens LIST  tokens per KV block of the router and the workers, one run per
                     comma-separated size (default 512): the same prompts at every size
  --kv-config JSON   the KV cost terms the pool's card advertises, e.g.
                     '{\"prefill_load_scale\":0.5,\"busy_threshold_tokens\":20000}'
  --closed-loop U[:T] closed-loop arrivals: U users, each running a session's turns (a
                     turn continues the session whose last prompt prefixes it) one after
                     another, T ms (default 1000) after the previous turn completed; a
                     comma-separated list runs each (a grid: 8:500,32:2000,...)
  --overload-wait-ms W  how long a request waits for room when every worker is over the
                     busy threshold before it is shed (default 2000)
  --workers N        prefill workers (default 6)
  --policy P         kv | kv-events | kv-oracle | dynamo | dynamo-blocks | round-robin | random | all
                     (default kv; all runs each; a comma-separated list runs those)
  --cache-blocks C   KV blocks of 512 tokens per worker, LRU (default unbounded; the same
                     memory at every --block-tokens)
  --limit K          replay only the first K requests
  --json OUT         also write the reports as JSON to OUT
  --svg OUT          also draw TTFT CDF and hit rate over the trace per policy as SVG
  --quiet            no progress lines on stderr
  --retarget-at T    at trace second T, roll the pool to a new generation of cold workers
  --flap-at T        at trace second T, remove the pool for 1 s and bring the same target
                     back (the router reuses its binding)
  --flap-rebuild-at T  the same, but back as a new generation (a new binding)
  --event-loss-every K  kv-events: lose every K-th KV event batch (default none)
  --event-delay-ms D    kv-events: KV event batches reach the router D ms late (default 0)
  --conditional SPECS   conditional disaggregation, one run per comma-separated spec (and
                     policy): `off`, `short:N` (skip when under N uncached tokens), `busy:M`
                     (skip when the pool holds over M uncached tokens per worker), or
                     `short:N+busy:M` (default: off only)
  --affinity SPECS   session affinity (a session is a conversation), one run per
                     comma-separated spec (and policy and conditional spec): `off` or a TTL
                     in seconds (default: off only); kv, kv-events, round-robin, random
  --frontends LIST   independent frontends over the one pool, one run per comma-separated
                     count (default 1): each its own router, binding, dispatcher, KV index,
                     bookings and affinity table, as separate processes
  --spread S         how the balancer in front spreads requests over the frontends:
                     round-robin (default) or session (every turn of a conversation to one)
  --no-load-reports  workers send no load reports: each frontend counts only its own
                     bookings (default: reports on; they matter with several frontends)
  --report-delay-ms D  load reports reach the frontends D ms late (default 0)
  --join-at T        the last of the frontends (needs --frontends 2 or more) joins at trace
                     second T with an empty KV index, asking every worker for its KV snapshot
                     (kv-events only), and from then on gets its share of the requests; the
                     report gives its hit rate per window of requests since the join next to
                     the long-running frontends' (and --svg draws that instead)
  --join-cold        the joiner asks for no snapshot: live KV events from the join on only
  --join-compare     one run with the snapshot and one cold
(from the workspace root: cargo run --release -- replay ...)";

/// Parsed options.
pub struct ReplayOptions {
    trace: String,
    kv: prefill_router::advert::KvRouterConfig,
    overload_wait: Duration,
    /// The closed loops to run (`None`: open loop).
    closed_loop: Vec<Option<prefill_router_tools::replay::ClosedLoop>>,
    /// The block sizes to run.
    block_tokens: Vec<u32>,
    workers: usize,
    policy: String,
    cache_blocks: Option<usize>,
    limit: Option<usize>,
    json: Option<String>,
    svg: Option<String>,
    quiet: bool,
    /// `(kind, trace second)` of the pool event.
    event: Option<(&'static str, f64)>,
    /// Every how many KV event batches one is lost (0: none).
    event_loss_every: u64,
    /// KV event delivery delay in milliseconds.
    event_delay_ms: u64,
    /// The conditional policies to run (`None`: off).
    conditional: Vec<Option<ConditionalPolicy>>,
    /// The session-affinity TTLs to run (`None`: off).
    affinity: Vec<Option<Duration>>,
    /// The frontend counts to run.
    frontends: Vec<usize>,
    /// How requests are spread over the frontends.
    spread: prefill_router_tools::replay::Spread,
    /// Whether workers send load reports.
    load_reports: bool,
    /// Load report delivery delay in milliseconds.
    report_delay_ms: u64,
    /// Trace second at which the last frontend joins.
    join_at: Option<f64>,
    /// The joins to run: with the snapshot (`true`) and/or cold.
    join_snapshot: Vec<bool>,
}

/// One `--closed-loop` spec: `USERS[:THINK_MS]`.
fn parse_closed_loop(spec: &str) -> Result<prefill_router_tools::replay::ClosedLoop, CliError> {
    let bad = || CliError::Usage(format!("--closed-loop USERS[:THINK_MS], not `{spec}`"));
    let (users, think) = spec.split_once(':').unwrap_or((spec, "1000"));
    let users: usize = users.parse().map_err(|_| bad())?;
    let think: u64 = think.parse().map_err(|_| bad())?;
    if users == 0 {
        return Err(bad());
    }
    Ok(prefill_router_tools::replay::ClosedLoop {
        users,
        think: Duration::from_millis(think),
    })
}

/// One `--affinity` spec: `off` or a TTL in seconds (> 0, finite).
fn parse_affinity(spec: &str) -> Result<Option<Duration>, CliError> {
    if spec == "off" {
        return Ok(None);
    }
    spec.parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
        .map(|s| Some(Duration::from_secs_f64(s)))
        .ok_or_else(|| {
            CliError::Usage(format!(
                "bad --affinity spec `{spec}` (off | a TTL in seconds)"
            ))
        })
}

/// One `--conditional` spec: `off`, `short:N`, `busy:M` or both joined by `+`.
fn parse_conditional(spec: &str) -> Result<Option<ConditionalPolicy>, CliError> {
    if spec == "off" {
        return Ok(None);
    }
    let bad = || {
        CliError::Usage(format!(
            "bad --conditional spec `{spec}` (off | short:N | busy:M | short:N+busy:M)"
        ))
    };
    let mut policy = ConditionalPolicy::default();
    for part in spec.split('+') {
        match part.split_once(':') {
            Some(("short", n)) => policy.min_uncached_tokens = Some(n.parse().map_err(|_| bad())?),
            Some(("busy", m)) => {
                policy.max_pool_tokens_per_worker = Some(m.parse().map_err(|_| bad())?);
            }
            _ => return Err(bad()),
        }
    }
    Ok(Some(policy))
}

impl ReplayOptions {
    /// Parse the arguments after `replay`.
    pub fn parse(args: &[String]) -> Result<Self, CliError> {
        let mut trace = None;
        let mut options = ReplayOptions {
            trace: String::new(),
            workers: 6,
            policy: "kv".to_owned(),
            cache_blocks: None,
            limit: None,
            json: None,
            svg: None,
            quiet: false,
            event: None,
            event_loss_every: 0,
            event_delay_ms: 0,
            conditional: vec![None],
            affinity: vec![None],
            kv: prefill_router::advert::KvRouterConfig::default(),
            overload_wait: prefill_router::push::PushConfig::default().overload_wait,
            closed_loop: vec![None],
            block_tokens: vec![prefill_router_tools::replay::BLOCK_TOKENS],
            frontends: vec![1],
            spread: prefill_router_tools::replay::Spread::RoundRobin,
            load_reports: true,
            report_delay_ms: 0,
            join_at: None,
            join_snapshot: vec![true],
        };
        let mut flags = Flags::new(args);
        while let Some(flag) = flags.next_flag() {
            match flag {
                "--trace" => trace = Some(flags.value(flag)?.to_owned()),
                "--closed-loop" => {
                    options.closed_loop = flags
                        .value(flag)?
                        .split(',')
                        .map(|spec| parse_closed_loop(spec).map(Some))
                        .collect::<Result<_, _>>()?;
                }
                "--block-tokens" => {
                    let spec = flags.value(flag)?;
                    options.block_tokens = spec
                        .split(',')
                        .map(|n| n.parse::<u32>().ok().filter(|&n| (1..=1 << 16).contains(&n)))
                        .collect::<Option<_>>()
                        .ok_or_else(|| {
                            CliError::Usage(format!(
                                "--block-tokens takes sizes from 1 to 65536, comma-separated, not `{spec}`"
                            ))
                        })?;
                }
                "--overload-wait-ms" => {
                    options.overload_wait = Duration::from_millis(flags.parsed(flag)?);
                }
                "--kv-config" => {
                    options.kv = serde_json::from_str(flags.value(flag)?)
                        .map_err(|e| CliError::Usage(format!("--kv-config: {e}")))?;
                }
                "--workload" => {
                    let spec = flags.value(flag)?;
                    prefill_router_tools::replay::Workload::parse(spec)
                        .map_err(|e| CliError::Usage(e.to_string()))?;
                    trace = Some(format!("{WORKLOAD_PREFIX}{spec}"));
                }
                "--workers" => options.workers = flags.parsed(flag)?,
                "--policy" => options.policy = flags.value(flag)?.to_owned(),
                "--cache-blocks" => options.cache_blocks = Some(flags.parsed(flag)?),
                "--limit" => options.limit = Some(flags.parsed(flag)?),
                "--json" => options.json = Some(flags.value(flag)?.to_owned()),
                "--svg" => options.svg = Some(flags.value(flag)?.to_owned()),
                "--quiet" => options.quiet = true,
                "--retarget-at" => options.event = Some(("retarget", flags.parsed(flag)?)),
                "--flap-at" => options.event = Some(("flap", flags.parsed(flag)?)),
                "--flap-rebuild-at" => options.event = Some(("flap-rebuild", flags.parsed(flag)?)),
                "--event-loss-every" => options.event_loss_every = flags.parsed(flag)?,
                "--event-delay-ms" => options.event_delay_ms = flags.parsed(flag)?,
                "--conditional" => {
                    options.conditional = flags
                        .value(flag)?
                        .split(',')
                        .map(parse_conditional)
                        .collect::<Result<_, _>>()?;
                }
                "--affinity" => {
                    options.affinity = flags
                        .value(flag)?
                        .split(',')
                        .map(parse_affinity)
                        .collect::<Result<_, _>>()?;
                }
                "--no-load-reports" => options.load_reports = false,
                "--join-at" => options.join_at = Some(flags.parsed(flag)?),
                "--join-cold" => options.join_snapshot = vec![false],
                "--join-compare" => options.join_snapshot = vec![true, false],
                "--report-delay-ms" => options.report_delay_ms = flags.parsed(flag)?,
                "--frontends" => {
                    let spec = flags.value(flag)?;
                    options.frontends = spec
                        .split(',')
                        .map(|n| n.parse::<usize>().ok().filter(|&n| (1..=64).contains(&n)))
                        .collect::<Option<_>>()
                        .ok_or_else(|| {
                            CliError::Usage(format!(
                                "--frontends takes counts from 1 to 64, comma-separated, not `{spec}`"
                            ))
                        })?;
                }
                "--spread" => {
                    let name = flags.value(flag)?;
                    options.spread =
                        prefill_router_tools::replay::Spread::parse(name).ok_or_else(|| {
                            CliError::Usage(format!(
                                "--spread is round-robin or session, not `{name}`"
                            ))
                        })?;
                }
                "--help" | "-h" => return Err(CliError::Help(USAGE.to_owned())),
                other => return Err(CliError::Usage(format!("unknown option `{other}`"))),
            }
        }
        options.trace = trace
            .ok_or_else(|| CliError::Usage("--trace FILE or --workload SPEC is required".into()))?;
        if options
            .event
            .is_some_and(|(_, t)| !(t.is_finite() && t >= 0.0))
        {
            return Err(CliError::Usage("event times are seconds >= 0".into()));
        }
        if options
            .join_at
            .is_some_and(|t: f64| !(t.is_finite() && (0.0..1e9).contains(&t)))
        {
            return Err(CliError::Usage("--join-at is seconds >= 0".into()));
        }
        if options.join_at.is_none() && options.join_snapshot != [true] {
            return Err(CliError::Usage(
                "--join-cold and --join-compare need --join-at".into(),
            ));
        }
        if options.workers == 0 {
            return Err(CliError::Usage("--workers must be at least 1".into()));
        }
        if let Some(bad) = options
            .policy
            .split(',')
            .find(|p| *p != "all" && prefill_router_tools::replay::Policy::parse(p).is_none())
        {
            return Err(CliError::Usage(format!(
                "unknown policy `{bad}` (kv | kv-events | kv-oracle | dynamo | dynamo-blocks | round-robin | random | all)"
            )));
        }
        Ok(options)
    }
}

/// How a generated workload is named where a trace path would be.
const WORKLOAD_PREFIX: &str = "workload:";

/// Run the replays (each on its own paused runtime, off the CLI's runtime).
pub async fn run(options: ReplayOptions) -> ExitCode {
    crate::args::off_runtime("replay", move || run_blocking(&options)).await
}

fn run_blocking(options: &ReplayOptions) -> ExitCode {
    use prefill_router_tools::replay::{
        join_svg, read_trace, run, svg, ClosedLoop, Join, Policy, PoolEvent, ReplayConfig,
        ReplayError,
    };

    let generated = options
        .trace
        .strip_prefix(WORKLOAD_PREFIX)
        .and_then(|spec| prefill_router_tools::replay::Workload::parse(spec).ok());
    let read = match &generated {
        Some(workload) => Ok(workload.generate()),
        None => read_trace(std::path::Path::new(&options.trace)),
    };
    let trace = match read {
        Ok(trace) => trace,
        Err(error) => {
            eprintln!("error: {}: {error}", options.trace);
            return ExitCode::FAILURE;
        }
    };
    // Parse checked every name; `all` expands in place.
    let policies: Vec<Policy> = options
        .policy
        .split(',')
        .flat_map(|name| Policy::parse(name).map_or(Policy::ALL.to_vec(), |p| vec![p]))
        .collect();
    let mut reports = Vec::new();
    let runs = policies.iter().flat_map(|&p| {
        options
            .conditional
            .iter()
            .flat_map(move |&c| options.affinity.iter().map(move |&a| (p, c, a)))
            .flat_map(move |(p, c, a)| options.frontends.iter().map(move |&n| (p, c, a, n)))
            .flat_map(move |(p, c, a, n)| {
                options.join_snapshot.iter().map(move |&s| (p, c, a, n, s))
            })
    });
    // The grid's outer dimensions: block size, then closed loop (each a table's worth).
    let grid: Vec<(u32, Option<ClosedLoop>)> = options
        .block_tokens
        .iter()
        .flat_map(|&b| options.closed_loop.iter().map(move |&c| (b, c)))
        .collect();
    let unit = generated
        .as_ref()
        .map_or(prefill_router_tools::replay::BLOCK_TOKENS, |w| {
            w.unit_tokens()
        });
    let runs: Vec<_> = grid
        .iter()
        .flat_map(|&(b, c)| runs.clone().map(move |r| (b, c, r)))
        .collect();
    let mut heading = None;
    for (block_tokens, closed_loop, (policy, conditional, session_affinity, frontends, snapshot)) in
        runs
    {
        if grid.len() > 1 && heading != Some((block_tokens, closed_loop)) {
            heading = Some((block_tokens, closed_loop));
            let arrivals = closed_loop.map_or("open loop".to_owned(), |c| {
                format!(
                    "closed loop {} users, think {} ms",
                    c.users,
                    c.think.as_millis()
                )
            });
            println!("# {block_tokens} tokens per block, {arrivals}");
        }
        let config = ReplayConfig {
            join: options.join_at.map(|t| Join {
                at: std::time::Duration::from_secs_f64(t),
                snapshot,
            }),
            frontends,
            spread: options.spread,
            load_reports: options.load_reports,
            report_delay: std::time::Duration::from_millis(options.report_delay_ms),
            conditional,
            session_affinity,
            workers: options.workers,
            cache_blocks: options.cache_blocks,
            limit: options.limit,
            progress: !options.quiet,
            event: options.event.map(|(kind, t)| {
                let at = std::time::Duration::from_secs_f64(t);
                match kind {
                    "retarget" => PoolEvent::Retarget { at },
                    _ => PoolEvent::Flap {
                        at,
                        rebuild: kind == "flap-rebuild",
                    },
                }
            }),
            event_loss_every: options.event_loss_every,
            event_delay: std::time::Duration::from_millis(options.event_delay_ms),
            kv: options.kv.clone(),
            overload_wait: options.overload_wait,
            closed_loop,
            block_tokens,
            unit_tokens: unit,
            ..ReplayConfig::new(policy)
        };
        match run(&config, &trace) {
            Ok(report) => {
                println!("{report}");
                reports.push(report);
            }
            Err(error @ ReplayError::Join(_)) => {
                eprintln!("error: {error}");
                return ExitCode::from(2);
            }
            Err(error) => {
                eprintln!("error: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    if let Some(path) = &options.json {
        let doc = serde_json::json!({ "trace": options.trace, "runs": reports });
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        if let Err(error) = std::fs::write(path, text + "\n") {
            eprintln!("error: cannot write {path}: {error}");
            return ExitCode::FAILURE;
        }
    }
    if let Some(path) = &options.svg {
        let cache = options
            .cache_blocks
            .map_or("unbounded caches".to_owned(), |c| {
                format!("{c}-block caches")
            });
        // One closed loop (or none) across the reports: say it, and the run's length, since
        // a closed loop's start weighs on its tail in a short run (docs/replay.md).
        let closed = match reports.first().map(|r| (r.closed_loop, r.requests)) {
            Some((Some((users, think)), requests))
                if reports
                    .iter()
                    .all(|r| r.closed_loop == Some((users, think))) =>
            {
                format!(", closed loop {users} users, think {think} ms, {requests} requests")
            }
            _ => String::new(),
        };
        let title = format!(
            "{}: {} workers, {cache}{closed}",
            std::path::Path::new(&options.trace)
                .file_name()
                .map_or(options.trace.clone(), |n| n.to_string_lossy().into_owned()),
            options.workers
        );
        let picture = if options.join_at.is_some() {
            join_svg(&title, &reports)
        } else {
            svg(&title, &reports)
        };
        if let Err(error) = std::fs::write(path, picture) {
            eprintln!("error: cannot write {path}: {error}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<ReplayOptions, CliError> {
        let args: Vec<String> = args.iter().map(|&a| a.to_owned()).collect();
        ReplayOptions::parse(&args)
    }

    #[test]
    fn affinity_specs_parse_to_ttls_and_bad_ones_are_usage_errors() {
        let Ok(options) = parse(&["--trace", "t", "--affinity", "off,600,0.5"]) else {
            panic!("valid --affinity specs refused");
        };
        assert_eq!(
            options.affinity,
            vec![
                None,
                Some(Duration::from_secs(600)),
                Some(Duration::from_millis(500))
            ]
        );
        for bad in ["0", "-3", "nan", "inf", "ten", ""] {
            assert!(
                matches!(
                    parse(&["--trace", "t", "--affinity", bad]),
                    Err(CliError::Usage(_))
                ),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn join_flags_parse_and_bad_ones_are_usage_errors() {
        let Ok(options) = parse(&["--trace", "t", "--join-at", "2400", "--join-compare"]) else {
            panic!("valid join flags refused");
        };
        assert_eq!(
            (options.join_at, options.join_snapshot),
            (Some(2400.0), vec![true, false])
        );
        let Ok(options) = parse(&["--trace", "t", "--join-at", "60", "--join-cold"]) else {
            panic!("valid join flags refused");
        };
        assert_eq!(options.join_snapshot, vec![false]);
        for bad in [
            &["--trace", "t", "--join-at", "-1"][..],
            &["--trace", "t", "--join-at", "nan"],
            &["--trace", "t", "--join-at", "soon"],
            &["--trace", "t", "--join-cold"],
        ] {
            assert!(
                matches!(parse(bad), Err(CliError::Usage(_))),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn policy_lists_name_known_policies_only() {
        assert!(parse(&["--trace", "t", "--policy", "kv,round-robin"]).is_ok());
        assert!(parse(&["--trace", "t", "--policy", "all"]).is_ok());
        match parse(&["--trace", "t", "--policy", "kv,nope"]) {
            Err(CliError::Usage(message)) => assert!(message.contains("`nope`"), "{message}"),
            _ => panic!("an unknown policy in a list is a usage error"),
        }
    }
}
