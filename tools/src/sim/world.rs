//! The shared state of one simulated world: the seeded RNG, the workers, what the controller
//! decided, every binding built, the statistics, and the violations found so far.
//!
//! One lock (`parking_lot::Mutex`) guards it; the runtime is single-threaded, so the lock is
//! only there because the router's traits require `Send + Sync`. It is never held across an
//! `.await` nor while calling into the router (a binding may drop inside a router call).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

mod ledgers;

pub(crate) use ledgers::{
    AffinityMirror, ConditionalLedger, KvLedger, KvSubscriber, LoadSubscriber, ReportLedger,
    SessionLedger,
};

use super::config::Mutant;
use super::oracle::Violation;
use super::report::SimStats;
use super::rng::SimRng;
use prefill_router::binding::WorkerSetTargetId;
use prefill_router::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use prefill_router::push::RoutableView;

/// The prefill endpoint every simulated worker serves.
pub(crate) fn prefill_endpoint() -> EndpointId {
    EndpointId::new("sim", "prefill", "generate")
}

/// The discovery record of simulated worker `id` (the address is never dialled).
pub(crate) fn instance(id: InstanceId) -> Instance {
    Instance {
        endpoint: prefill_endpoint(),
        instance_id: id,
        address: SocketAddr::from((Ipv4Addr::LOCALHOST, 40_000 + (id % 20_000) as u16)),
    }
}

/// Stands for one binding in the oracles: the binding owns the only strong reference, so the
/// probe is alive exactly as long as the binding is.
#[derive(Debug)]
pub(crate) struct Probe {
    pub(crate) serial: u64,
    pub(crate) target: WorkerSetTargetId,
    /// Requests currently prefilling on the binding.
    pub(crate) in_flight: AtomicUsize,
    /// The build's cancellation token: cancelled means the router abandoned the build.
    pub(crate) build_cancel: CancellationToken,
}

/// Counts a request as prefilling on a binding for as long as it lives.
pub(crate) struct InFlight(pub(crate) Arc<Probe>);

impl InFlight {
    pub(crate) fn enter(probe: &Arc<Probe>) -> Self {
        probe.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(probe))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

struct ProbeEntry {
    serial: u64,
    target: WorkerSetTargetId,
    probe: Weak<Probe>,
    flagged: bool,
}

/// A routable view fed by the simulated discovery, with the binding it belongs to.
struct ViewFeed {
    serial: u64,
    owner: Weak<Probe>,
    view: RoutableView,
}

pub(crate) struct WorldState {
    /// The controller's draws (made in the runner's deterministic order only).
    pub(crate) rng: SimRng,
    pub(crate) faults: bool,
    start: Instant,
    /// Every worker ever started, and whether it is up.
    pub(crate) workers: BTreeMap<InstanceId, bool>,
    /// Workers up (and registered) whose connections fail for now: a blip, the lease kept.
    pub(crate) blipped: std::collections::BTreeSet<InstanceId>,
    /// Since when each reachable worker (up, not blipped) has been reachable.
    pub(crate) reachable_since: BTreeMap<InstanceId, Instant>,
    /// The controller's last `set_target`, by id.
    pub(crate) desired: Option<WorkerSetTargetId>,
    probes: Vec<ProbeEntry>,
    feeds: Vec<ViewFeed>,
    next_serial: u64,
    /// The `LeakBindings` mutant's stash.
    pub(crate) leaked: Vec<Arc<Probe>>,
    /// Requests that called `prefill` (by id), for the outcome statistics.
    pub(crate) prefilled: std::collections::BTreeSet<u64>,
    /// Conditional disaggregation's probes and skips.
    pub(crate) conditional: ConditionalLedger,
    /// Session affinity's mirror of the bindings' tables.
    pub(crate) sessions: SessionLedger,
    /// KV events: the workers' caches, the subscribed dispatchers, the lag windows.
    pub(crate) kv: KvLedger,
    /// Load reports (runs with several frontends): the workers' ledgers, the frontends'
    /// connections, the ghost truth.
    pub(crate) reports: ReportLedger,
    pub(crate) stats: SimStats,
    pub(crate) violations: Vec<Violation>,
    digest: u64,
}

/// The world, shared by the runner, the fake factory, bindings, decode and the controller.
pub(crate) struct World {
    state: Mutex<WorldState>,
    seed: u64,
    /// The planted defect, if any.
    pub(crate) mutant: Option<Mutant>,
    /// Print every traced event to stderr (`PREFILL_SIM_TRACE=1`), to diff two runs.
    print_trace: bool,
}

impl World {
    pub(crate) fn new(seed: u64, mutant: Option<Mutant>, rng: SimRng, workers: u64) -> Arc<Self> {
        Arc::new(World {
            seed,
            mutant,
            state: Mutex::new(WorldState {
                rng,
                faults: true,
                start: Instant::now(),
                workers: (1..=workers).map(|id| (id, true)).collect(),
                blipped: Default::default(),
                reachable_since: (1..=workers).map(|id| (id, Instant::now())).collect(),
                desired: None,
                probes: Vec::new(),
                feeds: Vec::new(),
                next_serial: 1,
                leaked: Vec::new(),
                prefilled: Default::default(),
                conditional: Default::default(),
                sessions: Default::default(),
                kv: Default::default(),
                reports: Default::default(),
                stats: SimStats::default(),
                violations: Vec::new(),
                digest: 0,
            }),
            print_trace: std::env::var_os("PREFILL_SIM_TRACE").is_some(),
        })
    }

    /// Run `f` under the lock. Never await or call the router inside.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut WorldState) -> R) -> R {
        f(&mut self.state.lock())
    }

    pub(crate) fn violate(&self, violation: Violation) {
        tracing::warn!(%violation, "simulation oracle violated");
        self.with(|s| s.violations.push(violation));
    }

    /// Simulated milliseconds since the world started.
    pub(crate) fn now_ms(&self) -> u64 {
        let start = self.state.lock().start;
        u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A generator for one decision, keyed by what the decision is about (a request id, a
    /// build number...) rather than drawn from a shared sequence: tokio wakes the waiters of
    /// one channel in an order it randomizes, so decisions must not depend on which of two
    /// simultaneous tasks asks first.
    pub(crate) fn keyed(&self, parts: &[u64]) -> SimRng {
        let mut rng = SimRng::new(self.seed);
        for part in parts {
            rng = SimRng::new(rng.next_u64() ^ part);
        }
        rng
    }

    /// Fold an event into the run's digest: equal digests mean the same events at the same
    /// simulated times. The fold is commutative (a sum of event hashes), so events of one
    /// instant may happen in any order (see [`World::keyed`]).
    pub(crate) fn trace(&self, words: &[u64]) {
        let now = self.now_ms();
        if self.print_trace {
            eprintln!("sim trace {now} {words:?}");
        }
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for w in std::iter::once(now).chain(words.iter().copied()) {
            hash = (hash ^ w).wrapping_mul(0x0100_0000_01b3);
        }
        self.with(|s| s.digest = s.digest.wrapping_add(hash));
    }

    pub(crate) fn digest(&self) -> u64 {
        self.state.lock().digest
    }

    /// A new probe for a binding built for `target` under `build_cancel`.
    pub(crate) fn new_probe(
        &self,
        target: WorkerSetTargetId,
        build_cancel: CancellationToken,
    ) -> Arc<Probe> {
        self.with(|s| {
            let serial = s.next_serial;
            s.next_serial += 1;
            let probe = Arc::new(Probe {
                serial,
                target: target.clone(),
                in_flight: AtomicUsize::new(0),
                build_cancel,
            });
            s.probes.push(ProbeEntry {
                serial,
                target,
                probe: Arc::downgrade(&probe),
                flagged: false,
            });
            s.stats.bindings_built += 1;
            probe
        })
    }

    /// Register a binding's view for discovery deliveries and fill it with the current
    /// instances (a watch lists what exists first).
    pub(crate) fn attach_view(&self, owner: &Arc<Probe>, view: &RoutableView) {
        let up: Vec<InstanceId> = self.with(|s| {
            s.feeds.retain(|f| f.owner.strong_count() > 0);
            s.feeds.push(ViewFeed {
                serial: owner.serial,
                owner: Arc::downgrade(owner),
                view: view.clone(),
            });
            s.workers
                .iter()
                .filter(|(_, up)| **up)
                .map(|(id, _)| *id)
                .collect()
        });
        for id in up {
            view.apply(InstanceEvent::Added(instance(id)));
        }
    }

    /// Whether worker `id` accepts connections: up and not blipped.
    pub(crate) fn reachable(s: &WorldState, id: InstanceId) -> bool {
        s.workers.get(&id).copied().unwrap_or(false) && !s.blipped.contains(&id)
    }

    /// Worker `id`'s connections start failing; its registration stays (a blip).
    pub(crate) fn blip(&self, id: InstanceId) {
        self.with(|s| {
            if s.blipped.insert(id) {
                s.reachable_since.remove(&id);
                s.stats.blips += 1;
            }
        });
        self.trace(&[9, id, 0]);
    }

    /// Worker `id`'s blip ends (unless it crashed meanwhile, which ended the blip).
    pub(crate) fn unblip(&self, id: InstanceId) {
        let now = Instant::now();
        self.with(|s| {
            if s.blipped.remove(&id) && s.workers.get(&id).copied().unwrap_or(false) {
                s.reachable_since.insert(id, now);
            }
        });
        self.trace(&[9, id, 1]);
    }

    /// Oracle: a worker reachable for longer than the probe cap (plus slack) is routable in
    /// every live view that lists it: its breaker closed again.
    pub(crate) fn check_recovered(&self) {
        let now = Instant::now();
        let bound = super::config::timing::HEALTH.max + super::config::timing::HEALTH_SLACK;
        let (recovered, views): (Vec<InstanceId>, Vec<(u64, RoutableView)>) = self.with(|s| {
            s.feeds.retain(|f| f.owner.strong_count() > 0);
            let recovered = s
                .reachable_since
                .iter()
                .filter(|(_, since)| now.duration_since(**since) > bound)
                .map(|(id, _)| *id)
                .collect();
            let views = s.feeds.iter().map(|f| (f.serial, f.view.clone())).collect();
            (recovered, views)
        });
        for (binding, view) in views {
            for &worker in &recovered {
                if let Some(breaker) = view.health(worker) {
                    if !matches!(breaker, prefill_router::health::Breaker::Closed) {
                        self.violate(Violation::RecoveredWorkerUnroutable {
                            worker,
                            binding,
                            at_ms: self.now_ms(),
                        });
                    }
                }
            }
        }
    }

    /// The views of live bindings (for discovery deliveries).
    pub(crate) fn live_views(&self) -> Vec<(u64, RoutableView)> {
        self.with(|s| {
            s.feeds.retain(|f| f.owner.strong_count() > 0);
            s.feeds.iter().map(|f| (f.serial, f.view.clone())).collect()
        })
    }

    /// The level-triggered discovery state: `Added` for every worker up, `Removed` for every
    /// worker down.
    pub(crate) fn resync_events(&self) -> Vec<InstanceEvent> {
        self.with(|s| {
            s.workers
                .iter()
                .map(|(id, up)| {
                    if *up {
                        InstanceEvent::Added(instance(*id))
                    } else {
                        InstanceEvent::Removed(*id)
                    }
                })
                .collect()
        })
    }

    /// Oracle: every live binding is the router's current binding, the held one kept for
    /// reuse, or still serving a request. `current` is the serial of the binding the route
    /// shows (Active); `held` the target the router holds a binding for.
    pub(crate) fn check_bindings(&self, current: Option<u64>, held: Option<&WorkerSetTargetId>) {
        let now = self.now_ms();
        let mut found = Vec::new();
        self.with(|s| {
            s.probes.retain(|e| e.probe.strong_count() > 0);
            // The held binding, when not Active, is the newest live one for the held target.
            let kept = match current {
                Some(serial) => Some(serial),
                None => held.and_then(|h| {
                    s.probes
                        .iter()
                        .filter(|e| &e.target == h)
                        .map(|e| e.serial)
                        .max()
                }),
            };
            for entry in &mut s.probes {
                let Some(probe) = entry.probe.upgrade() else {
                    continue;
                };
                let busy = probe.in_flight.load(Ordering::Relaxed) > 0;
                if busy || Some(entry.serial) == kept || entry.flagged {
                    continue;
                }
                entry.flagged = true;
                found.push(Violation::BindingNotReleased {
                    binding: entry.serial,
                    target: entry.target.clone(),
                    at_ms: now,
                });
            }
        });
        for violation in found {
            self.violate(violation);
        }
    }
}
