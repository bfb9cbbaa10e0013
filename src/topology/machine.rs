//! The pure topology machine: worker sets, first-wins admission, generations and the target
//! rule.
//!
//! [`Machine`] is the third sans-IO core beside the [lifecycle](crate::lifecycle) and
//! [health](crate::health) machines: no tokio, no channel, no clock, no lock. Discovery's
//! [`NamespaceEvent`]s go in; orders come out as [`Action`]s, one inline batch per event
//! ([`Actions`]). It builds without the `runtime` feature. The topology watcher (feature
//! `runtime`) is its driver: it owns one admission channel per generation and the target sink,
//! and carries out the actions in order; the proptests and the `topology_events` fuzz target
//! drive the same code.
//!
//! # Driving it
//!
//! ```
//! use std::collections::BTreeSet;
//! use std::net::SocketAddr;
//! use prefill_router::advert::ModelCard;
//! use prefill_router::discovery::{EndpointId, Instance, NamespaceEvent};
//! use prefill_router::topology::{Action, Machine};
//!
//! let up = |component: &str, id| {
//!     let endpoint = EndpointId::new("ns", component, "generate");
//!     let address = SocketAddr::from(([127, 0, 0, 1], 9000));
//!     NamespaceEvent::Upserted(Instance { endpoint, instance_id: id, address }, ModelCard::named("m"))
//! };
//! let mut m = Machine::new();
//! // A decode set alone: no target yet, nothing to do.
//! assert!(m.handle(up("decode", 9)).is_empty());
//! // A prefill instance: admit it to generation 1, then point the router at that generation.
//! let out = m.handle(up("prefill", 1)).to_vec();
//! let Action::Admission { id, set, grows: true } = &out[0] else { unreachable!() };
//! assert_eq!((id.generation, set), (1, &BTreeSet::from([1])));
//! let Action::SetTarget(Some(target)) = &out[1] else { unreachable!() };
//! assert_eq!(target.id, *id);
//! assert_eq!(m.target(), Some(target));
//! ```
//!
//! # Contract for the driver (the caller MUST)
//!
//! - feed every event of one namespace watch, in the order the watch reports them;
//! - carry out every action of a batch, in order. The machine orders them so that:
//!   admissions that only *grow* come before [`Action::SetTarget`] (a returning pool is
//!   admitted before the router reuses its binding, a new generation before the router builds
//!   for it), admissions that *shrink* come after it (requests already see the new target when
//!   instances leave the old one), then [`Action::Retire`] and [`Action::Forget`]. Hence the
//!   target the driver holds admits at least one instance at every point of a batch, and no
//!   request reaches an instance the new target does not admit;
//! - keep one admission set per [`GenerationId`], created empty at its first mention
//!   (an [`Action::Admission`] or the [`Action::SetTarget`] naming it), until its `Retire` or
//!   `Forget`.
//!
//! Why generations: a target is identified by its prefill set and a generation number minted
//! when the set's selected card changes, never reused within the set. Equal ids then mean
//! equal content (endpoint and card), which the router's retarget machine relies on to reuse a
//! binding; a pool that leaves and comes back with the same card keeps its generation, so its
//! binding is reused, while one that comes back with another card gets a fresh one.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use super::kind::{worker_kind, WorkerKind};
use crate::advert::{ModelCard, SetLink};
use crate::batch::{Batch, IntoIter};
use crate::discovery::{EndpointId, Instance, InstanceId, NamespaceEvent};
use crate::hooks::Seam;

/// Dormant selections (sets whose instances all left) remembered for reuse, at most: a pool that
/// returns with the same card gets its old generation back (so the router reuses its binding);
/// beyond this many, the oldest dormant sets are forgotten (memory stays bounded however many
/// endpoints come and go).
pub const MAX_DORMANT_SETS: usize = 64;

/// One generation of a prefill set: the set's endpoint (its group) and a number that strictly
/// increases within the set. It names the generation's admission set and, as
/// `WorkerSetTargetId { group: endpoint.to_string(), generation }`, the router's target.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GenerationId {
    /// The prefill set.
    pub endpoint: EndpointId,
    /// Its generation, from 1.
    pub generation: u64,
}

impl fmt::Display for GenerationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.endpoint, self.generation)
    }
}

/// What the router is to be pointed at: one generation of a prefill set and its selected card.
/// The driver adds the generation's admission set to make the router's target.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetSpec {
    /// The generation (the target's identity).
    pub id: GenerationId,
    /// The card selected for this generation (first wins).
    pub card: Arc<ModelCard>,
}

/// An order to the driver, returned by [`Machine::handle`].
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Publish `set` as the instances admitted to generation `id` (create its admission set,
    /// empty, if it is new). `grows`: the new set only adds instances to the last one
    /// published (a grow comes before the batch's `SetTarget`, a shrink after it).
    Admission {
        /// The generation whose admission set changes.
        id: GenerationId,
        /// The admitted instances: live, and carrying the generation's card.
        set: BTreeSet<InstanceId>,
        /// Whether `set` is a superset of the last set published for `id`.
        grows: bool,
    },
    /// Point the router at this target, or at none (the hop bypasses).
    SetTarget(Option<TargetSpec>),
    /// The generation was replaced by a new one of its set: publish an empty admission set
    /// (its bindings then fail fast on new requests, never freeze) and drop it.
    Retire(GenerationId),
    /// The generation's set was dormant (its admission set already empty) and is forgotten to
    /// bound memory: drop its admission set.
    Forget(GenerationId),
}

/// The orders for one event, in the order the driver must carry them out.
pub type Actions = Batch<Action>;

/// Owning iterator over [`Actions`].
pub type ActionsIntoIter = IntoIter<Action>;

/// A deliberate mutant of the machine (see `crate::hooks`).
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TopologyMutant {
    /// Every admission change is ordered before `SetTarget`, shrinks included: the old target
    /// is left pointing at an empty admission set while the batch is applied (caught by
    /// `the_ordering_check_catches_shrinks_before_the_target` and the proptest).
    ShrinksBeforeTarget,
}

/// The selected card of a prefill set and the admission set last published for it.
#[derive(Clone, Debug, PartialEq)]
struct CardChoice {
    generation: u64,
    card: Arc<ModelCard>,
    published: BTreeSet<InstanceId>,
}

/// One worker set: the live instances of one endpoint.
#[derive(Clone, Debug, PartialEq)]
struct WorkerSet {
    kind: WorkerKind,
    /// Live instances: card and arrival number (first-wins is by arrival).
    instances: BTreeMap<InstanceId, (Arc<ModelCard>, u64)>,
    /// Prefill sets only: the card admission compares against.
    selection: Option<CardChoice>,
    /// The last generation handed out for this group (never reused).
    generations: u64,
    /// Instances already logged as rejected (one log line per rejection).
    rejected: BTreeSet<InstanceId>,
    /// When the set last lost its final instance (orders dormant sets for eviction).
    dormant_since: Option<u64>,
}

/// Worker sets of one namespace, first-wins admission, and the target rule. The driving
/// contract is in the module docs of `src/topology/machine.rs`.
#[derive(Debug, Default)]
pub struct Machine {
    sets: BTreeMap<EndpointId, WorkerSet>,
    arrivals: u64,
    events: u64,
    /// The target last ordered (`SetTarget`), `None` before the first.
    target: Option<TargetSpec>,
    /// `SetTarget` orders so far.
    retargets: u64,
    /// The highest generation of any forgotten set: a new set's generations start above it, so
    /// a group forgotten and seen again never reuses a generation (which would let the router
    /// reuse a binding built for another card), in one word of memory.
    generation_floor: u64,
    /// Where the ordering mutant breaks the batch; zero-sized in normal builds.
    mutant: Seam<TopologyMutant>,
}

const _: () = assert!(crate::hooks::ARMABLE || std::mem::size_of::<Seam<TopologyMutant>>() == 0);

impl Machine {
    /// An empty topology: no set, no target.
    pub fn new() -> Self {
        Machine::default()
    }

    /// The machine running a deliberate mutant (tests only).
    #[cfg(test)]
    pub(crate) fn with_mutant(mut self, mutant: TopologyMutant) -> Self {
        self.mutant = Seam::on(mutant);
        self
    }

    /// Apply one discovery event of the namespace; returns the actions the driver must carry
    /// out, in order.
    pub fn handle(&mut self, event: NamespaceEvent) -> Actions {
        self.events += 1;
        let mut out = Actions::default();
        let endpoint = match event {
            NamespaceEvent::Upserted(instance, card) => self.upsert(instance, card),
            NamespaceEvent::Removed(endpoint, id) => {
                let Some(set) = self.sets.get_mut(&endpoint) else {
                    return out;
                };
                set.instances.remove(&id);
                set.rejected.remove(&id);
                Some(endpoint)
            }
        };
        let mut admission = None;
        let mut retired = None;
        if let Some(endpoint) = endpoint {
            (admission, retired) = self.reselect(&endpoint);
        }
        let forgotten = self.evict_dormant();
        let target = self.compute_target();
        let retarget = (target.as_ref().map(|t| &t.id) != self.target.as_ref().map(|t| &t.id))
            .then_some(target);
        // Grows first, shrinks after the target (module docs); the mutant ignores the split.
        let (before, after) = match admission {
            Some(a @ Action::Admission { grows: true, .. }) => (Some(a), None),
            Some(a) if self.mutant.is(TopologyMutant::ShrinksBeforeTarget) => (Some(a), None),
            a => (None, a),
        };
        if let Some(admission) = before {
            out.push(admission);
        }
        if let Some(target) = retarget {
            self.target = target.clone();
            self.retargets += 1;
            out.push(Action::SetTarget(target));
        }
        if let Some(admission) = after {
            out.push(admission);
        }
        if let Some(id) = retired {
            out.push(Action::Retire(id));
        }
        if let Some(id) = forgotten {
            out.push(Action::Forget(id));
        }
        out
    }

    fn upsert(&mut self, instance: Instance, card: ModelCard) -> Option<EndpointId> {
        let Some(kind) = worker_kind(&instance.endpoint) else {
            tracing::debug!(endpoint = %instance.endpoint, "not a prefill or decode component; ignored");
            return None;
        };
        let floor = self.generation_floor;
        let set = self
            .sets
            .entry(instance.endpoint.clone())
            .or_insert_with(|| WorkerSet {
                kind,
                instances: BTreeMap::new(),
                selection: None,
                generations: floor,
                rejected: BTreeSet::new(),
                dormant_since: None,
            });
        let arrival = match set.instances.get(&instance.instance_id) {
            // An upsert keeps its place in the arrival order (a card change is not a new
            // arrival, or re-registration could steal the first-wins selection).
            Some((_, arrival)) => *arrival,
            None => {
                self.arrivals += 1;
                self.arrivals
            }
        };
        // A changed card is judged afresh.
        set.rejected.remove(&instance.instance_id);
        set.instances
            .insert(instance.instance_id, (Arc::new(card), arrival));
        Some(instance.endpoint)
    }

    /// Recompute a set's selection and admitted ids after a change: the admission to publish,
    /// and the generation the change retired.
    fn reselect(&mut self, endpoint: &EndpointId) -> (Option<Action>, Option<GenerationId>) {
        let events = self.events;
        let Some(set) = self.sets.get_mut(endpoint) else {
            return (None, None);
        };
        set.dormant_since = if set.instances.is_empty() {
            set.dormant_since.or(Some(events))
        } else {
            None
        };
        if set.kind != WorkerKind::Prefill {
            if set.instances.is_empty() {
                self.sets.remove(endpoint);
            }
            return (None, None);
        }
        let compatible = |card: &ModelCard, selected: &ModelCard| card == selected;
        // Keep the selection while one live instance still carries its card, or while the set
        // is empty (dormant: the pool may come back with the same card and reuse it).
        let keep = match &set.selection {
            Some(sel) => {
                set.instances.is_empty()
                    || set
                        .instances
                        .values()
                        .any(|(c, _)| compatible(c, &sel.card))
            }
            None => false,
        };
        let mut retired = None;
        if !keep && !set.instances.is_empty() {
            // First wins: the card of the earliest arrival among the live instances.
            let first = set
                .instances
                .values()
                .min_by_key(|(_, arrival)| *arrival)
                .map(|(c, _)| Arc::clone(c));
            if let Some(card) = first {
                set.generations += 1;
                let previous = set.selection.replace(CardChoice {
                    generation: set.generations,
                    card,
                    published: BTreeSet::new(),
                });
                tracing::info!(
                    group = %endpoint,
                    generation = set.generations,
                    "prefill set selected a card (new generation)"
                );
                retired = previous.map(|old| GenerationId {
                    endpoint: endpoint.clone(),
                    generation: old.generation,
                });
            }
        }
        let Some(sel) = &mut set.selection else {
            return (None, retired);
        };
        let mut admitted = BTreeSet::new();
        for (id, (card, _)) in &set.instances {
            if compatible(card, &sel.card) {
                admitted.insert(*id);
            } else if set.rejected.insert(*id) {
                tracing::warn!(
                    group = %endpoint,
                    instance = id,
                    generation = sel.generation,
                    "prefill instance rejected: its card differs from the set's selected card (first wins)"
                );
            }
        }
        if sel.published == admitted {
            return (None, retired);
        }
        let grows = admitted.is_superset(&sel.published);
        sel.published.clone_from(&admitted);
        let admission = Action::Admission {
            id: GenerationId {
                endpoint: endpoint.clone(),
                generation: sel.generation,
            },
            set: admitted,
            grows,
        };
        (Some(admission), retired)
    }

    /// Forget the oldest dormant prefill set when there are more than [`MAX_DORMANT_SETS`] (one
    /// is enough: an event makes at most one set dormant); returns its generation.
    fn evict_dormant(&mut self) -> Option<GenerationId> {
        let dormant: Vec<(u64, EndpointId)> = self
            .sets
            .iter()
            .filter_map(|(e, s)| s.dormant_since.map(|t| (t, e.clone())))
            .collect();
        if dormant.len() <= MAX_DORMANT_SETS {
            return None;
        }
        debug_assert_eq!(
            dormant.len(),
            MAX_DORMANT_SETS + 1,
            "one event makes at most one set dormant"
        );
        // One over the bound: the oldest goes.
        let (_, endpoint) = dormant.into_iter().min()?;
        let set = self.sets.remove(&endpoint)?;
        self.generation_floor = self.generation_floor.max(set.generations);
        set.selection.map(|sel| GenerationId {
            endpoint,
            generation: sel.generation,
        })
    }

    /// Prefill sets with at least one admitted instance (live, card-compatible).
    fn live_prefill(&self) -> impl Iterator<Item = (&EndpointId, &WorkerSet)> {
        self.sets.iter().filter(|(_, s)| {
            s.kind == WorkerKind::Prefill
                && s.selection
                    .as_ref()
                    .is_some_and(|sel| s.instances.values().any(|(c, _)| **c == *sel.card))
        })
    }

    fn live_decode(&self) -> impl Iterator<Item = &EndpointId> {
        self.sets
            .iter()
            .filter(|(_, s)| s.kind == WorkerKind::Decode && !s.instances.is_empty())
            .map(|(e, _)| e)
    }

    /// The target rule: exactly one live prefill set and exactly one live decode set give that
    /// prefill set's selection; anything else (none, or two of either, e.g. a blue/green
    /// rollout) gives `None`, and the hop bypasses.
    fn compute_target(&self) -> Option<TargetSpec> {
        let mut prefill = self.live_prefill();
        let (endpoint, set) = prefill.next()?;
        if prefill.next().is_some() || self.live_decode().count() != 1 {
            return None;
        }
        let sel = set.selection.as_ref()?;
        Some(TargetSpec {
            id: GenerationId {
                endpoint: endpoint.clone(),
                generation: sel.generation,
            },
            card: Arc::clone(&sel.card),
        })
    }

    /// The target last ordered by [`Action::SetTarget`] (`None` before the first).
    pub fn target(&self) -> Option<&TargetSpec> {
        self.target.as_ref()
    }

    /// `SetTarget` orders so far.
    pub fn retargets(&self) -> u64 {
        self.retargets
    }

    /// Prefill sets with at least one admitted instance.
    pub fn prefill_sets(&self) -> Vec<EndpointId> {
        self.live_prefill().map(|(e, _)| e.clone()).collect()
    }

    /// How the instances of the set `endpoint` are reached, from their cards (`None` for an
    /// unknown or empty set): all over our request plane, all by one engine protocol, or a
    /// mix, which a frontend refuses to route to.
    pub fn set_link(&self, endpoint: &EndpointId) -> Option<SetLink> {
        let set = self.sets.get(endpoint)?;
        let mut cards = set.instances.values().map(|(card, _)| card);
        let first = cards.next()?;
        let link = SetLink::of(first);
        Some(if cards.all(|c| SetLink::of(c) == link) {
            link
        } else {
            SetLink::Mixed
        })
    }

    /// Decode sets with at least one instance.
    pub fn decode_sets(&self) -> Vec<EndpointId> {
        self.live_decode().cloned().collect()
    }

    /// The admission set last published for a prefill set's current generation, with that
    /// generation (`None` for an unknown or a decode set).
    pub fn admitted(&self, endpoint: &EndpointId) -> Option<(u64, &BTreeSet<InstanceId>)> {
        let sel = self.sets.get(endpoint)?.selection.as_ref()?;
        Some((sel.generation, &sel.published))
    }

    /// Generations minted so far for a prefill set still remembered (live or dormant).
    pub fn generations(&self, endpoint: &EndpointId) -> Option<u64> {
        let set = self.sets.get(endpoint)?;
        (set.kind == WorkerKind::Prefill).then_some(set.generations)
    }

    /// Sets remembered (live, and dormant prefill sets).
    pub fn set_count(&self) -> usize {
        self.sets.len()
    }

    /// Dormant prefill sets remembered (at most [`MAX_DORMANT_SETS`]).
    pub fn dormant_count(&self) -> usize {
        self.sets
            .values()
            .filter(|s| s.dormant_since.is_some())
            .count()
    }
}

#[cfg(test)]
mod checker;
#[cfg(test)]
mod tests;
