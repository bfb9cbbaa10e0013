//! State shared by the router handle, the driver and the build tasks.

use std::sync::atomic::AtomicBool;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::config::PrefillRouterConfig;
use super::metrics::StatusSource;
use super::status::{RouterCounters, RouterStatus, Tally};
use crate::binding::{BindingFactory, WorkerSetTarget};
use crate::control::{Control, Effects};
use crate::lifecycle::{BuildId, Lifecycle};
use crate::snapshot::BypassReason;

/// A message to the driver loop.
#[derive(Debug)]
pub(crate) enum Msg {
    /// Effects of a control call made outside the driver (`set_target`).
    Effects(Effects<WorkerSetTarget>),
    /// A build task reported its result; these are the effects of that report.
    Finished(BuildId, Effects<WorkerSetTarget>),
}

/// What the last announced snapshot showed: waiters re-check the route on every change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Announced {
    pub(crate) epoch: u64,
    pub(crate) lifecycle: Lifecycle,
}

pub(crate) struct Shared<F: BindingFactory> {
    pub(crate) control: Control<WorkerSetTarget, F::Binding>,
    pub(crate) factory: F,
    pub(crate) config: PrefillRouterConfig,
    pub(crate) tally: Tally,
    pub(crate) to_driver: mpsc::UnboundedSender<Msg>,
    /// Epoch-stamped announcements, for `wait_active` and the `WaitUpTo` policy.
    pub(crate) announced: watch::Sender<Announced>,
    /// The public lifecycle channel (`subscribe`).
    pub(crate) lifecycle: watch::Sender<Lifecycle>,
    /// Retirements so far (bumped by `announce`), for requests under a drain cap.
    pub(crate) retirements: watch::Sender<u64>,
    /// Root of every token the router hands out; cancelled by shutdown and Drop.
    pub(crate) cancel: CancellationToken,
    /// Every task the router spawns (driver, builds).
    pub(crate) tracker: TaskTracker,
    pub(crate) shut_down: AtomicBool,
    /// Where the router's mutants (and the test pause before dispatch) act on the request
    /// path; zero-sized in normal builds.
    pub(crate) seam: super::mutant::RouterSeam<F::Binding>,
}

impl<F: BindingFactory> Shared<F> {
    /// Hand effects of a control call to the driver and announce the new snapshot.
    pub(crate) fn dispatch(&self, msg: Msg) {
        let empty = match &msg {
            Msg::Effects(e) => e.is_empty(),
            Msg::Finished(..) => false,
        };
        if !empty {
            // Fails only once the driver has ended (shutdown): then there is nothing left to
            // carry out, every token having been cancelled.
            let _ = self.to_driver.send(msg);
        }
        self.announce();
    }

    /// Publish the cell's current lifecycle to the watch channels.
    ///
    /// The cell is read *inside* the watch's lock, so concurrent announcers serialise and the
    /// last one to run stores the newest snapshot: the channels can never be left showing an
    /// older state than the cell (reading first and sending after could store a stale value
    /// last).
    pub(crate) fn announce(&self) {
        if self.config.drain_cap.is_some() {
            let retired = self.control.retired_count();
            self.retirements.send_if_modified(|seen| {
                let changed = *seen != retired;
                *seen = retired;
                changed
            });
        }
        let mut transition = None;
        self.announced.send_if_modified(|last| {
            let snapshot = self.control.load();
            if snapshot.epoch() <= last.epoch {
                return false;
            }
            let lifecycle = snapshot.lifecycle();
            *last = Announced {
                epoch: snapshot.epoch(),
                lifecycle,
            };
            drop(snapshot);
            self.lifecycle.send_if_modified(|l| {
                let changed = *l != lifecycle;
                if changed {
                    transition = Some((*l, lifecycle));
                }
                *l = lifecycle;
                changed
            });
            true
        });
        // Logged outside the watch lock.
        if let Some((from, to)) = transition {
            tracing::info!(router = %self.config.name, %from, %to, "prefill hop lifecycle changed");
        }
    }

    /// Whether a bypass reason means nothing will ever become Active again.
    pub(crate) fn is_final(reason: BypassReason) -> bool {
        reason == BypassReason::ShutDown
    }
}

impl<F: BindingFactory> StatusSource for Shared<F> {
    fn status(&self) -> RouterStatus {
        let health = self
            .control
            .route()
            .binding()
            .map(|b| crate::binding::Binding::health(&**b))
            .unwrap_or_default();
        let c = self.control.status();
        let mut counters = RouterCounters::default();
        self.tally.fill(&mut counters);
        counters.activations = c.counters.published;
        counters.stale_builds_discarded = c.counters.discarded;
        counters.retired = c.counters.retired;
        counters.retired_alive = c.counters.retired_alive;
        RouterStatus {
            name: self.config.name.clone(),
            lifecycle: c.lifecycle,
            targeted: c.targeted,
            desired: c.desired.map(|t| t.id),
            held: c.held.map(|(_, t)| t.id),
            build_in_flight: c.in_flight.map(|(b, t)| (b, t.id)),
            retry_armed: c.retry_armed.is_some(),
            consecutive_failures: c.failures,
            last_error: c.last_error,
            shut_down: c.shut_down,
            epoch: c.epoch,
            counters,
            health,
        }
    }
}
