//! `prefill-router demo`: the story of a prefill pool, with traffic flowing.
//!
//! Everything runs in this process on loopback: a discovery store (a temporary directory, or
//! etcd), mock prefill workers and a mock decode worker serving over TCP, and a frontend: one
//! `PrefillHop` (topology watcher, prefill router, decode hop following the decode set). See
//! `docs/demo.md`.

mod cluster;
mod report;
mod traffic;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prefill_router::advert::{DecodeDefaults, SelectionMode};
use prefill_router::binding::BindingStats;
use prefill_router::discovery::{Discovery, FileConfig, FileDiscovery, InstanceId};
use prefill_router::hop::HopRouter;
use prefill_router::lifecycle::Lifecycle;
use prefill_router::push::PushConfig;
use prefill_router::router::PrefillRouterConfig;
use prefill_router::{PrefillHop, PrefillHopConfig};
use prefill_router_tools::mock::MockConfig;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::args::{CliError, Flags};
use cluster::{prefill_card, Cluster, NAMESPACE};
use report::Row;
use traffic::{converse, Frontend, Tally, TrafficShape, DECODE_IDS};

/// `demo` usage.
pub const USAGE: &str = "\
usage: prefill-router demo [--quick] [--discovery file|etcd://HOST:PORT[,...]] [--sessions N]

Runs the prefill-router story on loopback: the prefill pool appears, a new generation rolls
out with another block size, a prefill worker is killed, the pool vanishes (bypass) and
returns (binding reuse), then RoundRobin vs KV prefill routing on the same multi-turn
traffic. Exits non-zero if a request was lost or routed outside its binding's admission set.

options:
  --quick              a short run (a few seconds; for tests)
  --discovery SPEC     `file` (a temporary directory, the default) or
                       `etcd://HOST:PORT[,HOST:PORT...]` (the members of one etcd cluster)
  --sessions N         concurrent conversations (default 12)";

/// Where discovery lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiscoverySpec {
    /// A temporary directory (file store).
    File,
    /// The members of an etcd cluster, each `host:port`.
    Etcd(Vec<String>),
}

/// Parsed `demo` options.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    quick: bool,
    discovery: DiscoverySpec,
    sessions: usize,
}

impl DemoOptions {
    /// Parse the arguments after `demo`.
    pub fn parse(args: &[String]) -> Result<Self, CliError> {
        let mut options = DemoOptions {
            quick: false,
            discovery: DiscoverySpec::File,
            sessions: 12,
        };
        let mut flags = Flags::new(args);
        while let Some(flag) = flags.next_flag() {
            match flag {
                "--quick" => options.quick = true,
                "--discovery" => {
                    let spec = flags.value(flag)?;
                    options.discovery = match spec {
                        "file" => DiscoverySpec::File,
                        _ => match spec.strip_prefix("etcd://") {
                            Some(list) => crate::store::parse_etcd_members(list)
                                .map(DiscoverySpec::Etcd)
                                .map_err(|e| CliError::Usage(format!("--discovery: {e}")))?,
                            None => {
                                return Err(CliError::Usage(format!(
                                "--discovery: expected `file` or `etcd://HOST:PORT[,HOST:PORT...]`, got `{spec}`"
                            )))
                            }
                        },
                    };
                }
                "--sessions" => {
                    options.sessions = flags.parsed(flag)?;
                    if options.sessions == 0 {
                        return Err(CliError::Usage("--sessions must be at least 1".into()));
                    }
                }
                "--help" | "-h" => return Err(CliError::Help(USAGE.to_owned())),
                other => return Err(CliError::Usage(format!("unknown demo option `{other}`"))),
            }
        }
        Ok(options)
    }
}

/// How fast the story moves.
struct Pace {
    /// How long each story step holds while traffic flows.
    hold: Duration,
    /// Discovery lease TTL (a killed worker's record outlives it by this much).
    ttl: Duration,
    /// Turns per conversation in each comparison run.
    compare_turns: usize,
}

/// Run the demo; the exit code says whether every request was accounted for.
pub async fn run(options: DemoOptions) -> ExitCode {
    match demo(options).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("demo failed: {error}");
            ExitCode::FAILURE
        }
    }
}

type DynError = Box<dyn std::error::Error + Send + Sync>;

/// Open the discovery store; the returned guard keeps a temporary directory alive.
async fn open_discovery(
    spec: &DiscoverySpec,
    ttl: Duration,
) -> Result<(Arc<dyn Discovery>, Option<tempfile::TempDir>), DynError> {
    match spec {
        DiscoverySpec::File => {
            let dir = tempfile::tempdir()?;
            let discovery = FileDiscovery::new(FileConfig::with_ttl(dir.path(), ttl));
            println!("discovery: file store in {}", dir.path().display());
            Ok((Arc::new(discovery), Some(dir)))
        }
        #[cfg(feature = "etcd")]
        DiscoverySpec::Etcd(members) => {
            use prefill_router::discovery::{EtcdConfig, EtcdDiscovery};
            // A fresh key root per run: records of an earlier run cannot leak into this one.
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let root = format!("prefill-router-demo/{}-{nanos}/", std::process::id());
            let config = EtcdConfig::new(members.iter().map(|m| format!("http://{m}")))
                .with_ttl(ttl)
                .with_root(root.clone());
            let discovery = EtcdDiscovery::connect(config).await?;
            println!("discovery: etcd at {}, key root {root}", members.join(","));
            Ok((Arc::new(discovery), None))
        }
        #[cfg(not(feature = "etcd"))]
        DiscoverySpec::Etcd(_) => Err(
            "this binary was built without the `etcd` feature (cargo run --features etcd)".into(),
        ),
    }
}

/// Everything the story needs at hand.
struct Stage {
    cluster: Cluster,
    frontend: Arc<Frontend>,
    tally: Arc<Tally>,
    stats: Arc<BindingStats>,
    mock: MockConfig,
    pace: Pace,
    started: Instant,
}

impl Stage {
    fn say(&self, text: &str) {
        println!("[{:>5.1}s] ── {text}", self.started.elapsed().as_secs_f64());
    }

    fn router(&self) -> &HopRouter {
        self.frontend.hop.router()
    }

    async fn wait_for(
        &self,
        what: &str,
        mut ready: impl FnMut(&Self) -> bool,
    ) -> Result<(), DynError> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready(self) {
            if Instant::now() > deadline {
                return Err(format!("timed out waiting for {what}").into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    async fn wait_active_on(&self, generation: u64) -> Result<(), DynError> {
        self.wait_for(&format!("generation {generation} to be active"), |s| {
            let status = s.router().status();
            status.lifecycle == Lifecycle::Active
                && status
                    .held
                    .as_ref()
                    .is_some_and(|id| id.generation == generation)
        })
        .await
    }

    async fn hold(&self) {
        tokio::time::sleep(self.pace.hold).await;
    }
}

async fn demo(options: DemoOptions) -> Result<bool, DynError> {
    let pace = if options.quick {
        Pace {
            hold: Duration::from_millis(700),
            ttl: Duration::from_secs(2),
            compare_turns: 4,
        }
    } else {
        Pace {
            hold: Duration::from_secs(4),
            ttl: Duration::from_secs(2),
            compare_turns: 10,
        }
    };
    let (discovery, _dir) = open_discovery(&options.discovery, pace.ttl).await?;
    let mock = MockConfig {
        block_size: 16,
        block_cost: Duration::from_micros(1500),
        token_interval: Duration::from_millis(1),
        cache_blocks: 8192,
    };
    let shape = TrafficShape {
        sessions: options.sessions,
        system_tokens: 64,
        turn_tokens: 48,
        max_tokens: 8,
        turns_per_conversation: 8,
        think: Duration::from_millis(5),
        deadline: Duration::from_secs(10),
        attempts: 3,
    };

    // The frontend: one PrefillHop (topology watcher, prefill router, decode hop following
    // the namespace's decode set).
    let config = PrefillHopConfig {
        router: PrefillRouterConfig {
            name: "demo".to_owned(),
            build_timeout: Duration::from_secs(5),
            ..PrefillRouterConfig::default()
        },
        decode: DecodeDefaults {
            router_mode: SelectionMode::RoundRobin,
            kv_router_config: None,
            block_size: mock.block_size,
            session_affinity_ttl: None,
        },
        push: PushConfig {
            request_timeout: Some(Duration::from_secs(5)),
            ..PushConfig::default()
        },
        ..PrefillHopConfig::default()
    };
    let hop = PrefillHop::start(Arc::clone(&discovery), NAMESPACE, config).await?;
    let stats = Arc::clone(hop.binding_stats());
    let frontend = Arc::new(Frontend { hop });
    let mut stage = Stage {
        cluster: Cluster::new(Arc::clone(&discovery)),
        frontend,
        tally: Arc::new(Tally::default()),
        stats,
        mock,
        pace,
        started: Instant::now(),
    };

    let result = story_and_compare(&mut stage, &shape).await;
    stage.cluster.stop_all().await;
    stage.frontend.hop.shutdown().await;
    let rows = result?;

    report::print(&rows);
    let lost = stage.tally.lost.load(Ordering::Relaxed);
    let outside = stage.stats.outside_admission.load(Ordering::Relaxed);
    let failed = stage.tally.failed.load(Ordering::Relaxed);
    let status = stage.router().status();
    println!();
    println!(
        "bindings built: {}   activations: {}   requests failed after retries: {failed}   retried: {}",
        stage.stats.built.load(Ordering::Relaxed),
        status.counters.activations,
        stage.tally.retried.load(Ordering::Relaxed),
    );
    println!("lost requests: {lost}   routed outside the admission set: {outside}");
    if let (Some(rr), Some(kv)) = (
        rows.iter().find(|r| r.label.contains("RoundRobin")),
        rows.iter().find(|r| r.label.contains("KV")),
    ) {
        let (rr50, _) = rr.ttft();
        let (kv50, _) = kv.ttft();
        println!(
            "KV routing: prefix hit rate {:.0}% vs {:.0}% (RoundRobin); TTFT p50 {:.1} ms vs {:.1} ms",
            kv.hit_rate().unwrap_or(0.0) * 100.0,
            rr.hit_rate().unwrap_or(0.0) * 100.0,
            kv50.as_secs_f64() * 1e3,
            rr50.as_secs_f64() * 1e3,
        );
    }
    let ok = lost == 0 && outside == 0;
    println!("{}", if ok { "demo: OK" } else { "demo: FAILED" });
    Ok(ok)
}

/// Print one status line per second until `stop` fires.
fn spawn_status(stage: &Stage, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
    let frontend = Arc::clone(&stage.frontend);
    let tally = Arc::clone(&stage.tally);
    let started = stage.started;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            let status = frontend.hop.router().status();
            let held = status
                .held
                .map_or_else(|| "-".to_owned(), |id| format!("gen {}", id.generation));
            println!(
                "[{:>5.1}s]    lifecycle {:<11} binding {:<6} via prefill {:>6}  bypassed {:>6}  retried {:>4}  failed {:>3}  lost {:>3}",
                started.elapsed().as_secs_f64(),
                status.lifecycle.to_string(),
                held,
                tally.via_prefill.load(Ordering::Relaxed),
                tally.bypassed.load(Ordering::Relaxed),
                tally.retried.load(Ordering::Relaxed),
                tally.failed.load(Ordering::Relaxed),
                tally.lost.load(Ordering::Relaxed),
            );
        }
    })
}

async fn story_and_compare(stage: &mut Stage, shape: &TrafficShape) -> Result<Vec<Row>, DynError> {
    let status_stop = CancellationToken::new();
    let status = spawn_status(stage, status_stop.clone());
    let result = async {
        let story = story(stage, shape).await?;
        let mut rows = vec![Row {
            label: "story (all phases)".to_owned(),
            samples: story,
        }];
        for (mode, first_id) in [(SelectionMode::RoundRobin, 20), (SelectionMode::KV, 30)] {
            rows.push(compare(stage, shape, mode, first_id).await?);
        }
        Ok::<_, DynError>(rows)
    }
    .await;
    status_stop.cancel();
    let _ = status.await;
    result
}

/// Traffic on `shape.sessions` conversations, each `turns` long (`None`: until the returned
/// flag is set).
fn start_traffic(
    stage: &Stage,
    shape: &TrafficShape,
    seed: u64,
    turns: Option<usize>,
) -> (Arc<AtomicBool>, JoinSet<()>) {
    let stop = Arc::new(AtomicBool::new(false));
    let mut users = JoinSet::new();
    for session in 0..shape.sessions {
        users.spawn(converse(
            Arc::clone(&stage.frontend),
            Arc::clone(&stage.tally),
            shape.clone(),
            seed + session as u64,
            turns,
            Arc::clone(&stop),
        ));
    }
    (stop, users)
}

async fn story(stage: &mut Stage, shape: &TrafficShape) -> Result<Vec<traffic::Sample>, DynError> {
    let gen1 = prefill_card(SelectionMode::KV, 16);
    let gen2 = prefill_card(SelectionMode::KV, 32);
    stage.cluster.start_decode(DECODE_IDS, &stage.mock).await?;
    stage
        .wait_for("the decode worker to be discovered", |s| {
            s.frontend.hop.decode().routable() > 0
        })
        .await?;
    stage.say("decode worker up, no prefill pool: requests bypass to decode");
    let (stop, mut users) = start_traffic(stage, shape, 1, None);
    stage.hold().await;

    stage.say("prefill pool appears: generation 1 (KV, block size 16), workers 1 2 3");
    stage
        .cluster
        .start_prefills(1..=3, &gen1, &stage.mock)
        .await?;
    stage.wait_active_on(1).await?;
    stage.say("generation 1 active: requests route through prefill");
    stage.hold().await;

    stage.say("generation 2 rolls out (block size 32): workers 4 5 6 start (rejected while generation 1 serves: first card wins)");
    stage
        .cluster
        .start_prefills(4..=6, &gen2, &stage.mock)
        .await?;
    tokio::time::sleep(stage.pace.hold / 2).await;
    stage.say("generation 1 workers leave: the set selects the new card, generation 2 builds");
    for id in 1..=3 {
        stage.cluster.stop(id).await;
    }
    stage.wait_active_on(2).await?;
    stage.say("generation 2 active (block size 32)");
    stage.hold().await;

    stage.say("prefill worker 5 is killed (its record lingers until its lease expires)");
    stage.cluster.kill(5);
    tokio::time::sleep(
        stage
            .pace
            .hold
            .max(stage.pace.ttl + Duration::from_millis(500)),
    )
    .await;

    stage.say("the prefill pool vanishes: requests bypass to decode");
    let built_before = stage.stats.built.load(Ordering::Relaxed);
    for id in [4, 6] {
        stage.cluster.stop(id).await;
    }
    stage
        .wait_for("the hop to become unavailable", |s| {
            s.router().status().lifecycle == Lifecycle::Unavailable
        })
        .await?;
    stage.hold().await;

    stage.say("the prefill pool returns with the same card: generation 2 again, binding reused");
    stage
        .cluster
        .start_prefills([4, 6], &gen2, &stage.mock)
        .await?;
    stage.wait_active_on(2).await?;
    let rebuilt = stage.stats.built.load(Ordering::Relaxed) - built_before;
    stage.say(&format!(
        "active again; bindings built since the pool vanished: {rebuilt} (reuse)"
    ));
    stage.hold().await;

    stop.store(true, Ordering::Relaxed);
    while users.join_next().await.is_some() {}
    for id in [4, 6] {
        stage.cluster.stop(id).await;
    }
    Ok(stage.tally.take_samples())
}

/// One comparison run: fresh (cold) workers advertising `mode`, the same traffic every time.
async fn compare(
    stage: &mut Stage,
    shape: &TrafficShape,
    mode: SelectionMode,
    first_id: InstanceId,
) -> Result<Row, DynError> {
    let card = prefill_card(mode, 16);
    let ids: Vec<InstanceId> = (first_id..first_id + 3).collect();
    stage
        .cluster
        .start_prefills(ids.iter().copied(), &card, &stage.mock)
        .await?;
    stage
        .wait_for(&format!("the {mode} pool to be active"), |s| {
            let status = s.router().status();
            status.lifecycle == Lifecycle::Active
                && s.router().route().binding().is_some_and(|b| {
                    b.resolved().router_mode == mode && b.dispatcher().view().routable().len() == 3
                })
        })
        .await?;
    stage.say(&format!(
        "comparison: {mode} prefill routing, 3 cold workers, {} conversations x {} turns",
        shape.sessions, stage.pace.compare_turns
    ));
    stage.tally.take_samples();
    let (_, mut users) = start_traffic(stage, shape, 1000, Some(stage.pace.compare_turns));
    while users.join_next().await.is_some() {}
    let samples = stage.tally.take_samples();
    for &id in &ids {
        stage.cluster.stop(id).await;
    }
    Ok(Row {
        label: format!("comparison: {mode}"),
        samples,
    })
}
