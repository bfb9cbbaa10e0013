//! The runner: builds the world on a paused current-thread runtime, plays the seeded
//! scenario, stops the faults, checks convergence and release, and reports.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::binding::{SimDecode, SimFactory};
use super::config::{timing, SimConfig, TargetSource};
use super::controller::Controller;
use super::discovery::FaultyDiscovery;
use super::feed;
use super::oracle::Violation;
use super::pool::{self, Pool};
use super::report::SimReport;
use super::rng::SimRng;
use super::sink::CheckedSink;
use super::world::World;
use crate::discovery::{Discovery, MemoryConfig, MemoryDiscovery};
use crate::lifecycle::{Lifecycle, RetryPolicy};
use crate::push::PushError;
use crate::router::PrefillError;
use crate::router::WorkerSetTargetId;
use crate::router::{AfterWait, FallbackPolicy, GenerateError, PrefillRouter, PrefillRouterConfig};
use crate::topology::TopologyWatcher;
use crate::transport::GenerateRequest;

type Router = PrefillRouter<SimFactory>;

/// Run one simulation to the end on its own paused, single-threaded tokio runtime.
///
/// Deterministic: the same configuration gives the same history (same
/// [`digest`](SimReport::digest)) on every run. Must not be called from within a tokio
/// runtime (it blocks on its own).
///
/// # Errors
/// Only if the tokio runtime cannot be built (an OS resource failure); oracle violations are
/// reported in the returned [`SimReport`].
pub fn simulate(config: &SimConfig) -> std::io::Result<SimReport> {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_time().start_paused(true);
    // tokio randomizes a few internal choices (the order in which one channel's waiters
    // wake); with `--cfg tokio_unstable` the runtime's RNG is seeded too. Without it the
    // simulator's decisions still replay (they are keyed, not sequenced), see
    // `docs/simulation.md`.
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(
        &config.seed.to_le_bytes(),
    ));
    let runtime = builder.build()?;
    Ok(runtime.block_on(run(config.clone())))
}

/// How a request ended (the deadline oracle has already judged hangs).
#[derive(Debug)]
enum Outcome {
    Completed {
        prefilled: bool,
    },
    Rejected,
    /// The binding had no routable worker (empty admission, all down): failed fast.
    Unroutable,
    PrefillFailed(String),
    DecodeFailed(String),
    Hung,
}

/// What moves the topology in this run.
enum Topo {
    Controller(Arc<Controller>),
    Watcher {
        pool: Arc<Pool>,
        watcher: TopologyWatcher,
    },
}

struct Run {
    world: Arc<World>,
    router: Arc<Router>,
    decode: Arc<SimDecode>,
    topo: Topo,
    scenario: SimRng,
    wait_budget: Duration,
    next_request: u64,
    requests: Vec<JoinHandle<()>>,
}

async fn run(config: SimConfig) -> SimReport {
    let start = Instant::now();
    let mut rng = SimRng::new(config.seed);
    let workers = rng.between(2, 5);
    let world = World::new(config.seed, config.mutant, rng.fork(), workers);
    let mut scenario = rng.fork();
    let fallback = draw_fallback(&mut scenario);
    let wait_budget = match fallback {
        FallbackPolicy::WaitUpTo { timeout, .. } => timeout,
        _ => Duration::ZERO,
    };
    let router_config = PrefillRouterConfig {
        retry: RetryPolicy {
            initial: timing::RETRY_INITIAL,
            max: timing::RETRY_MAX,
        },
        build_timeout: timing::BUILD_TIMEOUT,
        // Real jitter, seeded from the run's seed so a run still replays from it.
        retry_jitter: 0.1,
        jitter_seed: Some(scenario.next_u64()),
        fallback,
        name: format!("sim-{}", config.seed),
    };
    let router = Arc::new(PrefillRouter::new(
        SimFactory::new(Arc::clone(&world), config.mutant),
        router_config,
    ));
    let source = if scenario.percent(50) {
        TargetSource::Controller
    } else {
        TargetSource::Watcher
    };
    let controller = Controller::new(Arc::clone(&world), Arc::clone(&router));
    let topo = match source {
        TargetSource::Controller => Topo::Controller(Arc::clone(&controller)),
        TargetSource::Watcher => {
            let store = Arc::new(MemoryDiscovery::new(MemoryConfig::with_ttl(pool::TTL)));
            let store_dyn: Arc<dyn Discovery> = store.clone();
            let faulty: Arc<dyn Discovery> =
                Arc::new(FaultyDiscovery::new(Arc::clone(&store), Arc::clone(&world)));
            let sink = CheckedSink {
                world: Arc::clone(&world),
                router: Arc::clone(&router),
            };
            match TopologyWatcher::start(faulty, "sim", sink).await {
                Ok(watcher) => Topo::Watcher {
                    pool: Pool::new(Arc::clone(&world), store_dyn),
                    watcher,
                },
                Err(error) => {
                    // The in-memory store cannot fail to open a watch; fall back to the
                    // controller rather than abort the run.
                    tracing::warn!(%error, "cannot start the topology watcher");
                    Topo::Controller(Arc::clone(&controller))
                }
            }
        }
    };
    let mut sim = Run {
        decode: Arc::new(SimDecode::new(Arc::clone(&world))),
        world: Arc::clone(&world),
        router: Arc::clone(&router),
        topo,
        scenario,
        wait_budget,
        next_request: 0,
        requests: Vec::new(),
    };

    let resync_stop = CancellationToken::new();
    let resync = tokio::spawn(resync_loop(
        Arc::clone(&world),
        match &sim.topo {
            Topo::Controller(c) => Some(Arc::clone(c)),
            Topo::Watcher { .. } => None,
        },
        resync_stop.clone(),
    ));

    let shutdown_in_flight = sim.scenario.percent(20);
    if sim.scenario.percent(85) {
        sim.new_generation().await;
    }
    for _ in 0..config.steps {
        sim.step().await;
        let pause = sim.scenario.below(10);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        sim.check_bindings();
        sim.requests.retain(|r| !r.is_finished());
    }

    if shutdown_in_flight {
        // Shutdown with requests in flight and faults still on: the held binding is retired
        // under the requests holding it, waiters give up at once, later requests bypass or are
        // rejected, and the topology keeps calling `set_target` on a router that ignores it.
        world.trace(&[40]);
        router.shutdown();
        for _ in 0..sim.scenario.between(1, 4) {
            sim.spawn_request();
        }
    } else {
        // Faults stop. Deliveries already scheduled may still land (late and stale) for one
        // maximal delay; after that a resync makes the controller's and the views' belief
        // true.
        world.with(|s| s.faults = false);
        tokio::time::sleep(Duration::from_millis(timing::FEED_DELAY_MAX_MS + 1)).await;
        sim.heal().await;
        sim.converge().await;
        sim.healthy_request().await;
    }

    // Every request ends by its own deadline; the bound here only guards the runner.
    for handle in std::mem::take(&mut sim.requests) {
        if let Ok(Err(e)) = tokio::time::timeout(Duration::from_secs(10), handle).await {
            if e.is_panic() {
                world.violate(Violation::RequestPanicked { request: u64::MAX });
            }
        }
    }
    sim.check_bindings();
    let reported = router.status().counters.retired_alive;
    if reported != 0 {
        world.violate(Violation::RetiredAliveMiscounted { reported });
    }
    check_counters(&world, &router);

    if let Topo::Watcher { pool, watcher } =
        std::mem::replace(&mut sim.topo, Topo::Controller(Arc::clone(&controller)))
    {
        watcher.stopped().await;
        pool.clear_all();
    }
    router.shutdown();
    if tokio::time::timeout(Duration::from_secs(1), router.terminated())
        .await
        .is_err()
    {
        world.violate(Violation::TasksLeftAfterShutdown {
            alive: router.tasks_alive(),
        });
    }
    resync_stop.cancel();
    let _ = resync.await;
    tokio::time::sleep(Duration::from_millis(1)).await;
    // After shutdown and the last request, no binding may survive.
    world.check_bindings(None, None);

    let simulated = start.elapsed();
    let digest = world.digest();
    let (stats, violations) = world.with(|s| (s.stats.clone(), std::mem::take(&mut s.violations)));
    drop(sim);
    drop(controller);
    drop(router);
    SimReport {
        config,
        stats,
        violations,
        simulated,
        digest,
        fallback,
        source,
        shutdown_in_flight,
    }
}

fn draw_fallback(rng: &mut SimRng) -> FallbackPolicy {
    let then = if rng.percent(50) {
        AfterWait::Decode
    } else {
        AfterWait::Reject
    };
    match rng.below(10) {
        0..=4 => FallbackPolicy::Decode,
        5..=6 => FallbackPolicy::Reject,
        _ => FallbackPolicy::WaitUpTo {
            timeout: Duration::from_millis(rng.between(1, timing::WAIT_MAX_MS)),
            then,
        },
    }
}

async fn resync_loop(
    world: Arc<World>,
    controller: Option<Arc<Controller>>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(timing::RESYNC_PERIOD) => {
                if let Some(controller) = &controller {
                    controller.resync();
                }
                feed::resync_instances(&world);
            }
        }
    }
}

impl Run {
    /// One scenario step.
    async fn step(&mut self) {
        match self.scenario.below(100) {
            0..=39 => {
                for _ in 0..self.scenario.between(1, 6) {
                    self.spawn_request();
                }
            }
            40..=61 => {
                let ms = self.scenario.between(5, 80);
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            62..=69 => self.readmit().await,
            70..=74 => self.new_generation().await,
            75..=77 => self.clear(),
            78..=81 => self.restore().await,
            82..=85 => {
                // A burst of retargets while requests are in flight.
                for _ in 0..self.scenario.between(2, 5) {
                    match self.scenario.below(3) {
                        0 => self.new_generation().await,
                        1 => self.clear(),
                        _ => self.restore().await,
                    }
                    self.spawn_request();
                    let ms = self.scenario.below(3);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
            }
            86..=91 => {
                let up: Vec<u64> = self.world.with(|s| {
                    s.workers
                        .iter()
                        .filter(|(_, u)| **u)
                        .map(|(id, _)| *id)
                        .collect()
                });
                if !up.is_empty() {
                    let id = up[self.scenario.below(up.len() as u64) as usize];
                    self.world.with(|s| s.stats.crashes += 1);
                    match &self.topo {
                        Topo::Controller(_) => self.world.crash(id),
                        Topo::Watcher { pool, .. } => {
                            let killed = self.scenario.percent(50);
                            pool.crash(id, killed);
                        }
                    }
                }
            }
            _ => {
                let down: Vec<u64> = self.world.with(|s| {
                    s.workers
                        .iter()
                        .filter(|(_, u)| !**u)
                        .map(|(id, _)| *id)
                        .collect()
                });
                if !down.is_empty() {
                    let id = down[self.scenario.below(down.len() as u64) as usize];
                    match &self.topo {
                        Topo::Controller(_) => self.world.set_worker(id, true),
                        Topo::Watcher { pool, .. } => pool.restart(id).await,
                    }
                }
            }
        }
    }

    async fn new_generation(&mut self) {
        match &self.topo {
            Topo::Controller(c) => c.new_generation(),
            Topo::Watcher { pool, .. } => pool.roll(&mut self.scenario).await,
        }
    }

    fn clear(&mut self) {
        match &self.topo {
            Topo::Controller(c) => c.clear(),
            Topo::Watcher { pool, .. } => pool.clear(self.scenario.percent(50)),
        }
    }

    async fn restore(&mut self) {
        match &self.topo {
            Topo::Controller(c) => c.restore(),
            Topo::Watcher { pool, .. } => pool.restore().await,
        }
    }

    async fn readmit(&mut self) {
        match &self.topo {
            Topo::Controller(c) => c.readmit(),
            Topo::Watcher { pool, .. } => pool.churn(&mut self.scenario).await,
        }
    }

    /// Faults are off: every worker back up and registered, every belief resynced.
    async fn heal(&mut self) {
        let ids: Vec<u64> = self.world.with(|s| s.workers.keys().copied().collect());
        match &self.topo {
            Topo::Controller(c) => {
                for id in ids {
                    self.world.set_worker(id, true);
                }
                c.resync();
            }
            Topo::Watcher { pool, .. } => {
                for id in ids {
                    pool.restart(id).await;
                }
                pool.restore().await;
            }
        }
        feed::resync_instances(&self.world);
    }

    /// The target the router must converge to; `None` while the watcher has not caught up.
    fn expected_target(&self) -> Option<Option<WorkerSetTargetId>> {
        match &self.topo {
            Topo::Controller(c) => Some(c.truth_target()),
            Topo::Watcher { watcher, .. } => {
                // Healed: one prefill set and one decode set are registered, so the truth
                // has a target; a watcher still showing none has not caught up yet.
                let view = watcher.view();
                let target = view.borrow().target.clone();
                target.map(|(group, generation)| Some(WorkerSetTargetId { group, generation }))
            }
        }
    }

    /// The admission set a healthy request may use.
    fn admitted_now(&self) -> std::collections::BTreeSet<u64> {
        match &self.topo {
            Topo::Controller(c) => c.truth_admitted(),
            Topo::Watcher { .. } => self
                .router
                .load()
                .target()
                .map(|t| t.admitted.borrow().clone())
                .unwrap_or_default(),
        }
    }

    fn request(&mut self) -> (u64, GenerateRequest, Duration) {
        let id = self.next_request;
        self.next_request += 1;
        let len = self.scenario.between(4, 96);
        let base = self.scenario.below(4) as u32 * 1000;
        let tokens: Vec<u32> = (0..len as u32).map(|t| base + t).collect();
        let max_tokens = self.scenario.between(1, u64::from(timing::MAX_TOKENS)) as u32;
        let request = GenerateRequest {
            token_ids: tokens,
            max_tokens,
            session: Some(format!("req-{id}")),
            ..GenerateRequest::default()
        };
        let deadline = self.wait_budget
            + timing::PREFILL_TIMEOUT
            + Duration::from_millis(u64::from(max_tokens) * timing::TOKEN_MAX_MS)
            + timing::DEADLINE_SLACK;
        (id, request, deadline)
    }

    fn spawn_request(&mut self) {
        let (id, request, deadline) = self.request();
        self.world.with(|s| s.stats.requests += 1);
        let world = Arc::clone(&self.world);
        let router = Arc::clone(&self.router);
        let decode = Arc::clone(&self.decode);
        self.requests.push(tokio::spawn(async move {
            let outcome = serve(&world, &router, &decode, id, request, deadline).await;
            world.trace(&[20, id, outcome_code(&outcome)]);
        }));
    }

    fn check_bindings(&self) {
        let current = self.router.load().binding().map(|b| b.serial());
        let held = self.router.status().held;
        self.world.check_bindings(current, held.as_ref());
    }

    /// Oracle: after the faults stop, the router reaches the topology's target.
    async fn converge(&self) {
        let deadline = Instant::now() + timing::CONVERGE_WITHIN;
        loop {
            let expected = self.expected_target();
            let status = self.router.status();
            let done = match &expected {
                Some(Some(id)) => {
                    status.lifecycle == Lifecycle::Active && status.held.as_ref() == Some(id)
                }
                Some(None) => status.lifecycle == Lifecycle::Unavailable,
                None => false,
            };
            if done {
                return;
            }
            if Instant::now() >= deadline {
                self.world.violate(Violation::NotConverged {
                    expected: expected.flatten(),
                    lifecycle: status.lifecycle,
                    held: status.held,
                });
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Oracle: once converged with admitted workers up and no faults, a request prefills and
    /// completes.
    async fn healthy_request(&mut self) {
        if self.router.load().target().is_none() || self.admitted_now().is_empty() {
            return;
        }
        let (id, request, deadline) = self.request();
        self.world.with(|s| s.stats.requests += 1);
        let outcome = serve(
            &self.world,
            &self.router,
            &self.decode,
            id,
            request,
            deadline,
        )
        .await;
        if !matches!(outcome, Outcome::Completed { prefilled: true }) {
            self.world.violate(Violation::HealthyRequestFailed {
                outcome: format!("{outcome:?}"),
            });
        }
    }
}

/// One request through the real request path, under the deadline oracle.
async fn serve(
    world: &World,
    router: &Router,
    decode: &SimDecode,
    id: u64,
    request: GenerateRequest,
    deadline: Duration,
) -> Outcome {
    let work = async {
        match router.generate(request, decode).await {
            Ok(mut stream) => {
                while let Some(item) = stream.next().await {
                    if let Err(e) = item {
                        return Outcome::DecodeFailed(e.to_string());
                    }
                }
                let prefilled = world.with(|s| s.prefilled.contains(&id));
                Outcome::Completed { prefilled }
            }
            Err(GenerateError::NotActivated { .. }) => Outcome::Rejected,
            Err(GenerateError::Prefill(PrefillError::Push(PushError::NoRoutableInstances))) => {
                Outcome::Unroutable
            }
            Err(GenerateError::Prefill(e)) => Outcome::PrefillFailed(e.to_string()),
            Err(e) => Outcome::DecodeFailed(e.to_string()),
        }
    };
    let outcome = match tokio::time::timeout(deadline, work).await {
        Ok(outcome) => outcome,
        Err(_) => {
            world.violate(Violation::RequestHung {
                request: id,
                deadline,
            });
            Outcome::Hung
        }
    };
    world.with(|s| {
        // The accounting the router's counters must agree with (see `check_counters`).
        let prefilled = s.prefilled.remove(&id);
        let stats = &mut s.stats;
        stats.prefill_calls += u64::from(prefilled);
        match &outcome {
            Outcome::Completed { prefilled: true } => stats.prefilled_ok += 1,
            Outcome::Completed { prefilled: false } => stats.bypassed_ok += 1,
            Outcome::Rejected => stats.rejected += 1,
            Outcome::Unroutable => stats.unroutable += 1,
            Outcome::PrefillFailed(_) => stats.prefill_failed += 1,
            Outcome::DecodeFailed(_) => stats.decode_failed += 1,
            Outcome::Hung => {}
        }
        if !prefilled
            && matches!(
                outcome,
                Outcome::Completed { .. } | Outcome::DecodeFailed(_)
            )
        {
            stats.bypass_calls += 1;
        }
    });
    if let Outcome::PrefillFailed(why) | Outcome::DecodeFailed(why) = &outcome {
        tracing::debug!(request = id, %why, "simulated request failed");
    }
    outcome
}

/// Oracle: with every request ended, the router's request counters agree with what the
/// requests saw (each request counted once, under the path it took).
fn check_counters(world: &World, router: &Router) {
    let (stats, hung) = world.with(|s| {
        let hung = s.violations.iter().any(|v| v.kind() == "request_hung");
        (s.stats.clone(), hung)
    });
    if hung {
        // A request cut off by its deadline may have been counted before it hung.
        return;
    }
    let counters = router.status().counters;
    let pairs = [
        ("prefilled", counters.prefilled, stats.prefill_calls),
        (
            "prefill_errors",
            counters.prefill_errors,
            stats.prefill_failed + stats.unroutable,
        ),
        (
            "bypassed",
            counters.bypassed.values().sum(),
            stats.bypass_calls,
        ),
        ("rejected", counters.rejected.values().sum(), stats.rejected),
    ];
    for (counter, reported, observed) in pairs {
        if reported != observed {
            world.violate(Violation::CountersDisagree {
                counter,
                reported,
                observed,
            });
        }
    }
}

fn outcome_code(outcome: &Outcome) -> u64 {
    match outcome {
        Outcome::Completed { prefilled: true } => 1,
        Outcome::Completed { prefilled: false } => 2,
        Outcome::Rejected => 3,
        Outcome::PrefillFailed(_) => 4,
        Outcome::DecodeFailed(_) => 5,
        Outcome::Hung => 6,
        Outcome::Unroutable => 7,
    }
}
