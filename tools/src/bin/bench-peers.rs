//! `bench-peers`: our router, the SGLang gateway and vLLM's router in front of the same
//! engines, in one run (`docs/performance.md`, "Against the peers"; `--help` for the flags).

use std::path::{Path, PathBuf};
use std::time::Duration;

use prefill_router_tools::peers::pool::{MockPoolConfig, Pool};
use prefill_router_tools::peers::report::{markdown, svg, Row};
use prefill_router_tools::peers::routers::{Binaries, Peer, PoolAddrs, RouterSpec};
use prefill_router_tools::peers::run::{HeadToHead, LoopMode};
use prefill_router_tools::peers::workload::{
    ceiling, conversation, multi_tenant, shared_prefix, WorkloadConfig, WorkloadKind,
};
use prefill_router_tools::replay::read_trace;

const USAGE: &str = "\
usage: bench-peers [options]

Starts a pool of mock vLLM engines (mock-vllm: N prefill engines with KV events, one decode
engine), puts each router in front of it in turn, replays the same request stream through it
in real time with the engines' prefix caches cleared between routers, and reports per router:
TTFT p50/p99, end-to-end p99, throughput, the prefill engines' prefix-cache hit rate, failed
requests, the router's CPU per request and peak RSS, and whether its outputs equal the first
router's. The peers (smg 1.13.0, vllm-router 0.1.17) are installed into --peers-venv by
.ci/engines/peers.sh when missing.

options:
  --routers LIST        router/policy labels, comma-separated, or all (default all):
                        prefill-router/kv, prefill-router/round-robin, smg/cache_aware,
                        smg/round_robin, vllm-router/kv_aware, vllm-router/cache_aware,
                        vllm-router/round_robin
  --workloads LIST      conversation, shared-prefix, multi-tenant (default all)
  --loops LIST          open, closed (default both)
  --prefill N           prefill engines in the mock pool (default 6)
  --block-tokens N      tokens per KV block (default 16: vllm-router's P/D events assume it)
  --cache-blocks N      blocks each mock engine holds (default 4096)
  --prefill-us-per-token Y  the mock prefill engines' time per uncached prompt token
                        (default 100): raise it to load the pool at the same rate
  --requests N          requests per workload (default 240)
  --rate R              open-loop arrivals per second (default 8)
  --users U             closed-loop users (default 8)
  --think-ms T          closed-loop pause after each answer (default 200)
  --max-tokens N        tokens per answer, at most (default 16)
  --seed S              workload seed (default 1)
  --trace FILE          the Mooncake conversation trace (default
                        ../shared/traces/mooncake_conversation_trace.jsonl)
  --tokenizer DIR       a model folder: engines and our router tokenize with it
  --pool-prefill URLS   use running engines instead of mock ones (http://H:P,...), with
  --pool-events TCPS    their KV event publishers (tcp://H:P,..., same order) and
  --pool-decode URL     the decode engine
  --model NAME          the model name requests carry (default tiny-llama)
  --peers-venv DIR      where smg and vllm-router are (default /var/tmp/prefill-router-peers)
  --out DIR             where peers.md, peers.jsonl, peers.svg and router logs go
                        (default target/bench-peers)";

#[derive(Debug)]
struct Options {
    routers: Vec<RouterSpec>,
    workloads: Vec<WorkloadKind>,
    loops: Vec<LoopMode>,
    prefill: usize,
    cache_blocks: u32,
    prefill_us_per_token: Option<u64>,
    workload: WorkloadConfig,
    trace: PathBuf,
    tokenizer: Option<PathBuf>,
    given: Option<PoolAddrs>,
    model: String,
    peers_venv: PathBuf,
    out: PathBuf,
}

fn list<T>(value: &str, parse: impl Fn(&str) -> Option<T>, what: &str) -> Result<Vec<T>, String> {
    value
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| parse(s).ok_or_else(|| format!("unknown {what}: {s}")))
        .collect()
}

fn parse(args: &[String]) -> Result<Options, String> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut options = Options {
        routers: RouterSpec::ALL.to_vec(),
        workloads: WorkloadKind::ALL.to_vec(),
        loops: Vec::new(),
        prefill: 6,
        cache_blocks: 4096,
        prefill_us_per_token: None,
        workload: WorkloadConfig::default(),
        trace: repo.join("../shared/traces/mooncake_conversation_trace.jsonl"),
        tokenizer: None,
        given: None,
        model: "tiny-llama".into(),
        peers_venv: "/var/tmp/prefill-router-peers".into(),
        out: repo.join("target/bench-peers"),
    };
    let (mut loops, mut users, mut think) = ("open,closed".to_owned(), 8usize, 200u64);
    let (mut pool_prefill, mut pool_events, mut pool_decode) = (None, None, None);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(String::new());
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = |v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{flag}: not a number: {v}"))
        };
        match flag.as_str() {
            "--routers" if value == "all" => {}
            "--routers" => options.routers = list(value, RouterSpec::parse, "router")?,
            "--workloads" => options.workloads = list(value, WorkloadKind::parse, "workload")?,
            "--loops" => loops.clone_from(value),
            "--prefill" => options.prefill = usize::try_from(number(value)?).unwrap_or(usize::MAX),
            "--block-tokens" => {
                options.workload.block_tokens =
                    u32::try_from(number(value)?).map_err(|e| e.to_string())?
            }
            "--cache-blocks" => {
                options.cache_blocks = u32::try_from(number(value)?).map_err(|e| e.to_string())?
            }
            "--prefill-us-per-token" => options.prefill_us_per_token = Some(number(value)?),
            "--requests" => {
                options.workload.requests = usize::try_from(number(value)?).unwrap_or(usize::MAX)
            }
            "--rate" => {
                options.workload.rate = value.parse().map_err(|_| format!("--rate: {value}"))?
            }
            "--users" => users = usize::try_from(number(value)?).unwrap_or(1),
            "--think-ms" => think = number(value)?,
            "--max-tokens" => {
                options.workload.max_tokens =
                    u32::try_from(number(value)?).map_err(|e| e.to_string())?
            }
            "--seed" => options.workload.seed = number(value)?,
            "--trace" => options.trace = value.into(),
            "--tokenizer" => options.tokenizer = Some(value.into()),
            "--pool-prefill" => pool_prefill = Some(value.clone()),
            "--pool-events" => pool_events = Some(value.clone()),
            "--pool-decode" => pool_decode = Some(value.clone()),
            "--model" => options.model.clone_from(value),
            "--peers-venv" => options.peers_venv = value.into(),
            "--out" => options.out = value.into(),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if options.workload.block_tokens == 0 || options.prefill == 0 || options.workload.rate <= 0.0 {
        return Err("--block-tokens, --prefill and --rate must be positive".into());
    }
    for name in loops.split(',').filter(|s| !s.is_empty()) {
        options.loops.push(match name {
            "open" => LoopMode::Open,
            "closed" => LoopMode::Closed {
                users,
                think: Duration::from_millis(think),
            },
            other => return Err(format!("unknown loop {other}")),
        });
    }
    match (pool_prefill, pool_events, pool_decode) {
        (None, None, None) => {}
        (Some(prefill), events, Some(decode)) => {
            let split = |s: &str| s.split(',').map(str::to_owned).collect::<Vec<_>>();
            options.given = Some(PoolAddrs {
                prefill: split(&prefill),
                events: events.as_deref().map(split).unwrap_or_default(),
                decode: split(&decode),
                block_tokens: options.workload.block_tokens,
                tokenizer: options.tokenizer.clone(),
            });
        }
        _ => return Err("--pool-prefill and --pool-decode go together".into()),
    }
    Ok(options)
}

/// The load average now (the machine is shared: every table says what else ran).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Install the peers if they are missing (`.ci/engines/peers.sh`).
fn ensure_peers(venv: &Path) -> Result<(), String> {
    if venv.join("venv/bin/smg").exists() && venv.join("venv/bin/vllm-router").exists() {
        return Ok(());
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.ci/engines/peers.sh");
    eprintln!("bench-peers: installing the peers into {}", venv.display());
    let status = std::process::Command::new("bash")
        .arg(&script)
        .arg(venv)
        .status()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{} failed ({status})", script.display()))
    }
}

/// Requests each engine serves before the first router is measured.
const WARM_UP: usize = 4;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let options = match parse(&args) {
        Ok(options) => options,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("bench-peers: {message}");
            }
            eprintln!("{USAGE}");
            std::process::exit(if message.is_empty() { 0 } else { 2 });
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    prefill_router_tools::peers::procs::stop_children_on_signal();
    if let Err(message) = run(options).await {
        eprintln!("bench-peers: {message}");
        std::process::exit(1);
    }
}

async fn run(options: Options) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let bin_dir = exe.parent().ok_or("no binary folder")?.to_path_buf();
    let binaries = Binaries {
        ours: bin_dir.join("prefill-router"),
        peers_bin: options.peers_venv.join("venv/bin"),
    };
    if options.routers.iter().any(|r| r.peer != Peer::Ours) {
        ensure_peers(&options.peers_venv)?;
    }
    std::fs::create_dir_all(&options.out).map_err(|e| e.to_string())?;
    let pool = match options.given.clone() {
        Some(addrs) => Pool::given(addrs),
        None => Pool::start_mock(&MockPoolConfig {
            binary: bin_dir.join("mock-vllm"),
            prefill: options.prefill,
            block_tokens: options.workload.block_tokens,
            cache_blocks: options.cache_blocks,
            tokenizer: options.tokenizer.clone(),
            prefill_us_per_token: options.prefill_us_per_token,
        })
        .await
        .map_err(|e| e.to_string())?,
    };
    let mut header = format!(
        "bench-peers: {} prefill + {} decode engines ({}), block {} tokens, {} blocks each, prefill {} µs per token; load average {}\n",
        pool.addrs.prefill.len(),
        pool.addrs.decode.len(),
        if options.given.is_some() { "given" } else { "mock-vllm" },
        options.workload.block_tokens,
        options.cache_blocks,
        match (&options.given, options.prefill_us_per_token) {
            (Some(_), _) => "the engines' own".to_owned(),
            (None, Some(us)) => us.to_string(),
            (None, None) => "100 (default)".to_owned(),
        },
        load_average(),
    );
    let mut peers: Vec<Peer> = Vec::new();
    for spec in &options.routers {
        if !peers.contains(&spec.peer) {
            peers.push(spec.peer);
        }
    }
    for peer in peers {
        header.push_str(&format!("- {}\n", binaries.version(peer)));
    }
    for spec in &options.routers {
        let (program, args) = binaries.command(*spec, &pool.addrs, 0, 0);
        let name = program
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Ports are drawn per run: the header says where they go.
        let shown: Vec<String> = args
            .iter()
            .map(|a| match a.as_str() {
                "0" => "PORT".to_owned(),
                "127.0.0.1:0" => "127.0.0.1:PORT".to_owned(),
                _ => a.clone(),
            })
            .collect();
        header.push_str(&format!(
            "- `{}`: `{name} {}`\n",
            spec.label(),
            shown.join(" ")
        ));
    }
    eprint!("{header}");
    let harness = HeadToHead {
        binaries: &binaries,
        pool: &pool,
        model: &options.model,
        logs: options.out.clone(),
        timeout: Duration::from_secs(120),
    };
    let mut rows: Vec<Row> = Vec::new();
    let mut warmed = false;
    for kind in &options.workloads {
        let requests = match kind {
            WorkloadKind::Conversation => {
                let trace = read_trace(&options.trace)
                    .map_err(|e| format!("{}: {e}", options.trace.display()))?;
                conversation(&trace, &options.workload)
            }
            WorkloadKind::SharedPrefix => shared_prefix(&options.workload),
            WorkloadKind::MultiTenant => multi_tenant(&options.workload),
        };
        header.push_str(&format!(
            "- {}: {} requests, best possible hit rate {:.3} (whole blocks)\n",
            kind.name(),
            requests.len(),
            ceiling(&requests, options.workload.block_tokens)
        ));
        if !warmed {
            // Before the first router: its run must not pay for the engines' first requests.
            let prompts: Vec<&str> = requests
                .iter()
                .take(WARM_UP)
                .map(|r| r.prompt.as_str())
                .collect();
            let answered = pool.warm(&options.model, &prompts).await;
            header.push_str(&format!(
                "- engines warmed before the first router: {answered} requests answered of {}\n",
                prompts.len() * (pool.addrs.prefill.len() + pool.addrs.decode.len())
            ));
            warmed = true;
        }
        for mode in &options.loops {
            let mut reference = None;
            let found = harness
                .run(
                    &options.routers,
                    kind.name(),
                    &requests,
                    *mode,
                    &mut reference,
                )
                .await;
            rows.extend(found);
            write_outputs(&options.out, &header, &rows)?;
        }
    }
    println!("{header}\n{}", markdown(&rows));
    Ok(())
}

fn write_outputs(out: &Path, header: &str, rows: &[Row]) -> Result<(), String> {
    let write = |name: &str, text: String| {
        std::fs::write(out.join(name), text).map_err(|e| format!("{name}: {e}"))
    };
    write("peers.md", format!("{header}\n{}", markdown(rows)))?;
    write(
        "peers.jsonl",
        rows.iter().map(|r| r.json().to_string() + "\n").collect(),
    )?;
    write(
        "peers.svg",
        svg(rows, "TTFT p99 per router, same engines, same requests"),
    )
}
