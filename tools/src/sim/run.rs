//! The runner: builds the world on a paused current-thread runtime, plays the seeded
//! scenario, stops the faults, checks convergence and release, and reports.
//!
//! The pieces: [`setup`] draws the run's shape (workers, fallback, where targets come from)
//! and builds the router; [`scenario`] plays the seeded steps; [`request`] sends one request
//! through the real request path under the deadline oracle. Every draw from the scenario's
//! RNG happens in a fixed order, so a seed replays its history (its digest).

mod request;
mod scenario;
mod setup;
mod state;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::config::{timing, SimConfig};
use super::controller::Controller;
use super::feed;
use super::oracle::Violation;
use super::report::SimReport;
use super::world::World;
use state::{Run, Topo};

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

async fn run(config: SimConfig) -> SimReport {
    let start = Instant::now();
    let mut sim = Run::build(&config).await;
    let resync_stop = CancellationToken::new();
    let resync = tokio::spawn(resync_loop(
        Arc::clone(&sim.world),
        match &sim.topo {
            Topo::Controller(c) => Some(Arc::clone(c)),
            Topo::Watcher { .. } => None,
        },
        resync_stop.clone(),
    ));

    let refresh = (super::frontends::frontends(&sim.world) > 1).then(|| {
        tokio::spawn(super::frontends::refresh_loop(
            Arc::clone(&sim.world),
            resync_stop.clone(),
        ))
    });

    let shutdown_in_flight = sim.scenario.percent(20);
    sim.play(config.steps).await;
    if shutdown_in_flight {
        sim.shut_down_in_flight();
    } else {
        sim.settle().await;
    }
    sim.finish_requests().await;
    sim.check_end_state();
    super::frontends::check_quiescent(&sim.world).await;
    sim.tear_down().await;
    resync_stop.cancel();
    let _ = resync.await;
    if let Some(refresh) = refresh {
        let _ = refresh.await;
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
    // After shutdown and the last request, no binding may survive.
    sim.world.check_bindings(None, None);
    sim.report(config, start.elapsed(), shutdown_in_flight)
}

/// The periodic level-triggered resync of the controller's belief and every view.
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
    /// Shutdown with requests in flight and faults still on: the held binding is retired
    /// under the requests holding it, waiters give up at once, later requests bypass or are
    /// rejected, and the topology keeps calling `set_target` on a router that ignores it.
    fn shut_down_in_flight(&mut self) {
        self.world.trace(&[40]);
        self.router.shutdown();
        for _ in 0..self.scenario.between(1, 4) {
            self.spawn_request();
        }
    }

    /// Faults stop. Deliveries already scheduled may still land (late and stale) for one
    /// maximal delay; after that a resync makes the controller's and the views' belief true,
    /// and the convergence and healthy-request oracles run.
    async fn settle(&mut self) {
        self.world.with(|s| s.faults = false);
        tokio::time::sleep(Duration::from_millis(timing::FEED_DELAY_MAX_MS + 1)).await;
        self.heal().await;
        self.converge().await;
        // Breakers opened by the last blips close within the probe cap.
        tokio::time::sleep(timing::HEALTH.max + timing::HEALTH_SLACK).await;
        self.world.check_recovered();
        self.healthy_request().await;
    }

    /// Every request ends by its own deadline; the bound here only guards the runner.
    async fn finish_requests(&mut self) {
        for handle in std::mem::take(&mut self.requests) {
            if let Ok(Err(e)) = tokio::time::timeout(Duration::from_secs(10), handle).await {
                if e.is_panic() {
                    self.world
                        .violate(Violation::RequestPanicked { request: u64::MAX });
                }
            }
        }
    }

    /// Oracles over the quiet end state: bindings released, counters agree.
    fn check_end_state(&self) {
        self.check_bindings();
        let reported = self.router.status().counters.retired_alive;
        if reported != 0 {
            self.world
                .violate(Violation::RetiredAliveMiscounted { reported });
        }
        request::check_counters(&self.world, &self.router);
    }

    /// Stop the watcher (deregistering its pool) and the router; the router's tasks must end.
    async fn tear_down(&mut self) {
        let controller = Topo::Controller(Arc::clone(&self.controller));
        if let Topo::Watcher { pool, watcher } = std::mem::replace(&mut self.topo, controller) {
            watcher.stopped().await;
            pool.clear_all();
        }
        self.router.shutdown();
        if tokio::time::timeout(Duration::from_secs(1), self.router.terminated())
            .await
            .is_err()
        {
            self.world.violate(Violation::TasksLeftAfterShutdown {
                alive: self.router.tasks_alive(),
            });
        }
    }

    fn report(self, config: SimConfig, simulated: Duration, shutdown_in_flight: bool) -> SimReport {
        let digest = self.world.digest();
        let (stats, violations) = self
            .world
            .with(|s| (s.stats.clone(), std::mem::take(&mut s.violations)));
        SimReport {
            config,
            stats,
            violations,
            simulated,
            digest,
            fallback: self.fallback,
            source: self.source,
            shutdown_in_flight,
        }
    }

    fn check_bindings(&self) {
        let current = self.router.load().binding().map(|b| b.serial());
        let held = self.router.status().held;
        self.world.check_bindings(current, held.as_ref());
    }
}
