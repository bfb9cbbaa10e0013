//! The simulated topology and the controller that turns it into `set_target` calls.
//!
//! The *truth* (which generation of the prefill worker set exists, which workers it admits)
//! changes by seeded steps. The controller learns it only through the faulty feed
//! ([`feed`](super::feed)): each change arrives late, twice, out of order or not at all, and
//! a periodic resync delivers the whole truth again. The controller mints one
//! [`WorkerSetTarget`] per generation (equal ids, equal content, as the router requires) and
//! owns each generation's admission channel.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::watch;

use super::feed;
use super::world::{prefill_endpoint, World};
use prefill_router::advert::{ModelCard, RouterConfig, SelectionMode};
use prefill_router::binding::{WorkerSetTarget, WorkerSetTargetId};
use prefill_router::discovery::InstanceId;
use prefill_router::router::PrefillRouter;

use super::binding::SimFactory;

/// The group name of the simulated prefill worker set.
const GROUP: &str = "sim/prefill";

/// One change of the topology, as discovery reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TopoEvent {
    /// The prefill worker set to route to (a generation), or none.
    Target(Option<u64>),
    /// The admission set of a generation.
    Admit(u64, BTreeSet<InstanceId>),
}

/// One generation, as the controller knows it.
struct Generation {
    target: WorkerSetTarget,
    admitted: watch::Sender<BTreeSet<InstanceId>>,
}

/// How many past generations keep their admission channel (bounded memory).
const KEEP_GENERATIONS: usize = 8;

struct Truth {
    latest: u64,
    target: Option<u64>,
    admitted: BTreeMap<u64, BTreeSet<InstanceId>>,
}

struct ControllerState {
    truth: Truth,
    /// Topology events published so far (keys their delivery draws).
    published: u64,
    /// The controller's (possibly stale) belief of the target generation.
    believed: Option<Option<u64>>,
    generations: BTreeMap<u64, Generation>,
}

/// The seeded topology plus the controller.
pub(crate) struct Controller {
    world: Arc<World>,
    router: Arc<PrefillRouter<SimFactory>>,
    state: Mutex<ControllerState>,
}

impl Controller {
    pub(crate) fn new(world: Arc<World>, router: Arc<PrefillRouter<SimFactory>>) -> Arc<Self> {
        Arc::new(Controller {
            world,
            router,
            state: Mutex::new(ControllerState {
                truth: Truth {
                    latest: 0,
                    target: None,
                    admitted: BTreeMap::new(),
                },
                believed: None,
                published: 0,
                generations: BTreeMap::new(),
            }),
        })
    }

    /// The truth's target id (what the router must converge to).
    pub(crate) fn truth_target(&self) -> Option<WorkerSetTargetId> {
        self.state
            .lock()
            .truth
            .target
            .map(|g| WorkerSetTargetId::new(GROUP, g))
    }

    /// The truth's admission set of its target generation.
    pub(crate) fn truth_admitted(&self) -> BTreeSet<InstanceId> {
        let state = self.state.lock();
        state
            .truth
            .target
            .and_then(|g| state.truth.admitted.get(&g).cloned())
            .unwrap_or_default()
    }

    /// A new generation with a freshly drawn card and admission set becomes the target; the
    /// previous generation's admission empties (its workers moved on).
    pub(crate) fn new_generation(self: &Arc<Self>) {
        let (card, admitted) = self.world.with(|s| {
            let mode = match s.rng.below(3) {
                0 => SelectionMode::RoundRobin,
                1 => SelectionMode::Random,
                _ => SelectionMode::KV,
            };
            let card = ModelCard {
                name: "sim-model".to_owned(),
                kv_cache_block_size: [16, 32, 64][s.rng.below(3) as usize],
                router_config: s.rng.percent(80).then(|| RouterConfig {
                    router_mode: mode,
                    ..RouterConfig::default()
                }),
                ..ModelCard::default()
            };
            (card, draw_subset(s, false))
        });
        let (generation, previous) = {
            let mut state = self.state.lock();
            let truth = &mut state.truth;
            truth.latest += 1;
            let generation = truth.latest;
            let previous = truth.target.replace(generation);
            truth.admitted.insert(generation, admitted.clone());
            if let Some(p) = previous {
                truth.admitted.insert(p, BTreeSet::new());
            }
            // The controller mints the target as soon as the generation exists (discovery
            // has the card); only the decision to route to it travels through the feed.
            let (tx, rx) = watch::channel(BTreeSet::new());
            let id = WorkerSetTargetId::new(GROUP, generation);
            let target = WorkerSetTarget::new(id, prefill_endpoint(), Arc::new(card), rx);
            state.generations.insert(
                generation,
                Generation {
                    target,
                    admitted: tx,
                },
            );
            while state.generations.len() > KEEP_GENERATIONS {
                state.generations.pop_first();
                state.truth.admitted.pop_first();
            }
            (generation, previous)
        };
        self.world.trace(&[10, generation]);
        let mut events = vec![
            TopoEvent::Admit(generation, admitted),
            TopoEvent::Target(Some(generation)),
        ];
        if let Some(p) = previous {
            events.push(TopoEvent::Admit(p, BTreeSet::new()));
        }
        self.publish_shuffled(events);
    }

    /// The prefill pool disappears: the target clears and its admission empties, the two
    /// reported in a seeded order (the watcher may deliver either one first).
    pub(crate) fn clear(self: &Arc<Self>) {
        let current = {
            let mut state = self.state.lock();
            let current = state.truth.target.take();
            if let Some(g) = current {
                state.truth.admitted.insert(g, BTreeSet::new());
            }
            current
        };
        let mut events = vec![TopoEvent::Target(None)];
        if let Some(g) = current {
            events.push(TopoEvent::Admit(g, BTreeSet::new()));
        }
        self.world.trace(&[11]);
        self.publish_shuffled(events);
    }

    /// The pool comes back as its latest generation (the held binding may be reused).
    pub(crate) fn restore(self: &Arc<Self>) {
        let admitted = self.world.with(|s| draw_subset(s, false));
        let generation = {
            let mut state = self.state.lock();
            let latest = state.truth.latest;
            if latest == 0 || !state.generations.contains_key(&latest) {
                None
            } else {
                state.truth.target = Some(latest);
                state.truth.admitted.insert(latest, admitted.clone());
                Some(latest)
            }
        };
        match generation {
            None => self.new_generation(),
            Some(g) => {
                self.world.trace(&[12, g]);
                self.publish_shuffled(vec![
                    TopoEvent::Admit(g, admitted),
                    TopoEvent::Target(Some(g)),
                ]);
            }
        }
    }

    /// The current generation's admission set changes (possibly to empty).
    pub(crate) fn readmit(self: &Arc<Self>) {
        let admitted = self.world.with(|s| draw_subset(s, true));
        let generation = {
            let mut state = self.state.lock();
            let g = state.truth.target;
            if let Some(g) = g {
                state.truth.admitted.insert(g, admitted.clone());
            }
            g
        };
        if let Some(g) = generation {
            self.world.trace(&[13, g, admitted.len() as u64]);
            self.publish(TopoEvent::Admit(g, admitted));
        }
    }

    /// Deliver the whole truth to the controller at once (level-triggered resync).
    pub(crate) fn resync(self: &Arc<Self>) {
        let events: Vec<TopoEvent> = {
            let state = self.state.lock();
            let mut events: Vec<TopoEvent> = state
                .truth
                .admitted
                .iter()
                .map(|(g, set)| TopoEvent::Admit(*g, set.clone()))
                .collect();
            events.push(TopoEvent::Target(state.truth.target));
            events
        };
        for event in events {
            self.apply(event);
        }
    }

    fn publish_shuffled(self: &Arc<Self>, mut events: Vec<TopoEvent>) {
        self.world.with(|s| {
            // Fisher-Yates with the world's RNG: the report order is part of the scenario.
            for i in (1..events.len()).rev() {
                let j = s.rng.below(i as u64 + 1) as usize;
                events.swap(i, j);
            }
        });
        for event in events {
            self.publish(event);
        }
    }

    fn publish(self: &Arc<Self>, event: TopoEvent) {
        let n = {
            let mut state = self.state.lock();
            state.published += 1;
            state.published
        };
        let delivery = feed::plan(&self.world, &[feed::FEED_TOPOLOGY, n]);
        let this = Arc::clone(self);
        feed::deliver(delivery, move || this.apply(event.clone()));
    }

    /// The controller hears of one change.
    fn apply(&self, event: TopoEvent) {
        match event {
            TopoEvent::Admit(g, set) => {
                let state = self.state.lock();
                if let Some(generation) = state.generations.get(&g) {
                    generation.admitted.send_if_modified(|current| {
                        let changed = *current != set;
                        *current = set;
                        changed
                    });
                }
            }
            TopoEvent::Target(g) => {
                let target = {
                    let mut state = self.state.lock();
                    if state.believed == Some(g) {
                        return;
                    }
                    let target = match g {
                        None => {
                            // Which order this clear took: did the admission set of the
                            // generation being cleared empty before the clear arrived?
                            let emptied_first = match state.believed {
                                Some(Some(current)) => state
                                    .generations
                                    .get(&current)
                                    .is_some_and(|g| g.admitted.borrow().is_empty()),
                                _ => false,
                            };
                            self.world.with(|s| {
                                if emptied_first {
                                    s.stats.clears_after_admission_emptied += 1;
                                } else {
                                    s.stats.clears_before_admission_emptied += 1;
                                }
                            });
                            None
                        }
                        Some(g) => match state.generations.get(&g) {
                            Some(generation) => Some(generation.target.clone()),
                            // Forgotten (too old): a stale report, ignore it.
                            None => return,
                        },
                    };
                    state.believed = Some(g);
                    target
                };
                super::sink::set_target_checked(&self.world, &self.router, target);
            }
        }
    }
}

/// A random subset of the workers that are up (or of all workers when none is up), non-empty
/// unless `allow_empty`.
fn draw_subset(s: &mut super::world::WorldState, allow_empty: bool) -> BTreeSet<InstanceId> {
    let ids: Vec<InstanceId> = s.workers.keys().copied().collect();
    if allow_empty && s.rng.percent(15) {
        return BTreeSet::new();
    }
    let mut set: BTreeSet<InstanceId> = ids.iter().copied().filter(|_| s.rng.percent(60)).collect();
    if set.is_empty() && !ids.is_empty() {
        set.insert(ids[s.rng.below(ids.len() as u64) as usize]);
    }
    set
}
