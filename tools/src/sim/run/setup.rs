//! Building a run: the seed's draws for the world, the fallback policy, the router's timing
//! and where targets come from (the seeded controller or the real topology watcher).

use std::sync::Arc;
use std::time::Duration;

use super::super::binding::{SimDecode, SimFactory};
use super::super::config::{timing, SimConfig, TargetSource};
use super::super::controller::Controller;
use super::super::discovery::FaultyDiscovery;
use super::super::pool::{self, Pool};
use super::super::rng::SimRng;
use super::super::sink::CheckedSink;
use super::super::world::World;
use super::state::{Router, Run, Topo};
use prefill_router::discovery::{Discovery, MemoryConfig, MemoryDiscovery};
use prefill_router::lifecycle::RetryPolicy;
use prefill_router::router::{AfterWait, FallbackPolicy, PrefillRouter, PrefillRouterConfig};
use prefill_router::topology::TopologyWatcher;

impl Run {
    /// Draw the run's shape from the seed and build its world and router.
    pub(super) async fn build(config: &SimConfig) -> Run {
        let mut rng = SimRng::new(config.seed);
        let workers = rng.between(2, 5);
        let world = World::new(config.seed, config.mutant, rng.fork(), workers);
        world.with(|s| {
            s.sessions.on = config.sessions_on();
            s.kv.on = config.kv_events_on();
            s.reports.frontends = config.frontends_on();
            s.conditional.policy = config
                .conditional_on()
                .then_some(super::super::conditional::POLICY);
        });
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
            drain_cap: None,
            conditional: config
                .conditional_on()
                .then_some(super::super::conditional::POLICY),
        };
        let factory = SimFactory::new(Arc::clone(&world), config.mutant);
        let router = Arc::new(PrefillRouter::new(factory, router_config));
        let source = if scenario.percent(50) {
            TargetSource::Controller
        } else {
            TargetSource::Watcher
        };
        let controller = Controller::new(Arc::clone(&world), Arc::clone(&router));
        let topo = match source {
            TargetSource::Controller => Topo::Controller(Arc::clone(&controller)),
            TargetSource::Watcher => watcher_topology(&world, &router, &controller).await,
        };
        Run {
            decode: Arc::new(SimDecode::new(Arc::clone(&world))),
            world,
            router,
            controller,
            topo,
            source,
            fallback,
            scenario,
            wait_budget,
            next_request: 0,
            requests: Vec::new(),
        }
    }
}

/// Targets from the real topology watcher over a faulty view of an in-memory store that a
/// simulated worker pool registers in.
async fn watcher_topology(
    world: &Arc<World>,
    router: &Arc<Router>,
    controller: &Arc<Controller>,
) -> Topo {
    let store = Arc::new(MemoryDiscovery::new(MemoryConfig::with_ttl(pool::TTL)));
    let store_dyn: Arc<dyn Discovery> = store.clone();
    let faulty: Arc<dyn Discovery> =
        Arc::new(FaultyDiscovery::new(Arc::clone(&store), Arc::clone(world)));
    let sink = CheckedSink {
        world: Arc::clone(world),
        router: Arc::clone(router),
    };
    match TopologyWatcher::start(faulty, "sim", sink).await {
        Ok(watcher) => Topo::Watcher {
            pool: Pool::new(Arc::clone(world), store_dyn),
            watcher,
        },
        Err(error) => {
            // The in-memory store cannot fail to open a watch; fall back to the controller
            // rather than abort the run.
            tracing::warn!(%error, "cannot start the topology watcher");
            Topo::Controller(Arc::clone(controller))
        }
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
