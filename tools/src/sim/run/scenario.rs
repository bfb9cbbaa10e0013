//! The seeded scenario: requests, pauses, retargets (new generations, clears, returns),
//! admission churn, worker crashes and restarts; then, with the faults off, healing and the
//! convergence oracle.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::time::Instant;

use super::super::config::timing;
use super::super::feed;
use super::super::oracle::Violation;
use super::state::{Run, Topo};
use prefill_router::binding::WorkerSetTargetId;
use prefill_router::lifecycle::Lifecycle;

impl Run {
    /// The scenario proper: most runs start with a generation, then `steps` seeded steps.
    pub(super) async fn play(&mut self, steps: u32) {
        if self.scenario.percent(85) {
            self.new_generation().await;
        }
        for _ in 0..steps {
            self.step().await;
            let pause = self.scenario.below(10);
            tokio::time::sleep(Duration::from_millis(pause)).await;
            self.check_bindings();
            self.world.check_recovered();
            self.requests.retain(|r| !r.is_finished());
        }
    }

    /// One scenario step.
    async fn step(&mut self) {
        match self.scenario.below(100) {
            0..=39 => {
                for _ in 0..self.scenario.between(1, 6) {
                    self.spawn_request();
                }
            }
            40..=55 => {
                let ms = self.scenario.between(5, 80);
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            56..=61 => self.blip_one(),
            62..=69 => self.readmit().await,
            70..=74 => self.new_generation().await,
            75..=77 => self.clear(),
            78..=81 => self.restore().await,
            82..=85 => self.retarget_burst().await,
            86..=91 => self.crash_one(),
            _ => self.restart_one().await,
        }
    }

    /// A burst of retargets while requests are in flight.
    async fn retarget_burst(&mut self) {
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

    /// Crash a seeded worker that is up (its registration may survive it or go with it).
    fn crash_one(&mut self) {
        let Some(id) = self.pick_worker(true) else {
            return;
        };
        self.world.with(|s| s.stats.crashes += 1);
        match &self.topo {
            Topo::Controller(_) => self.world.crash(id),
            Topo::Watcher { pool, .. } => {
                let killed = self.scenario.percent(50);
                pool.crash(id, killed);
            }
        }
    }

    /// A seeded worker that is up loses its connections for 10-150 ms; its registration stays.
    fn blip_one(&mut self) {
        let Some(id) = self.pick_worker(true) else {
            return;
        };
        let down = Duration::from_millis(self.scenario.between(10, 150));
        self.world.blip(id);
        let world = std::sync::Arc::clone(&self.world);
        tokio::spawn(async move {
            tokio::time::sleep(down).await;
            world.unblip(id);
        });
    }

    /// Bring a seeded worker that is down back up.
    async fn restart_one(&mut self) {
        let Some(id) = self.pick_worker(false) else {
            return;
        };
        match &self.topo {
            Topo::Controller(_) => self.world.set_worker(id, true),
            Topo::Watcher { pool, .. } => pool.restart(id).await,
        }
    }

    /// A seeded worker among those that are `up` (or down), if any.
    fn pick_worker(&mut self, up: bool) -> Option<u64> {
        let ids: Vec<u64> = self.world.with(|s| {
            s.workers
                .iter()
                .filter(|(_, u)| **u == up)
                .map(|(id, _)| *id)
                .collect()
        });
        if ids.is_empty() {
            return None;
        }
        Some(ids[self.scenario.below(ids.len() as u64) as usize])
    }

    pub(super) async fn new_generation(&mut self) {
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
    pub(super) async fn heal(&mut self) {
        let blipped: Vec<u64> = self.world.with(|s| s.blipped.iter().copied().collect());
        for id in blipped {
            self.world.unblip(id);
        }
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
                target.map(Some)
            }
        }
    }

    /// The admission set a healthy request may use.
    pub(super) fn admitted_now(&self) -> BTreeSet<u64> {
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

    /// Oracle: after the faults stop, the router reaches the topology's target.
    pub(super) async fn converge(&self) {
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
}
