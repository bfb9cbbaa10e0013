//! The topology core: worker sets, first-wins admission, generations and the target rule.
//! Synchronous and deterministic: the watcher task feeds it discovery events and applies what
//! it returns.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tokio::sync::watch;

use super::kind::{worker_kind, WorkerKind};
use crate::advert::ModelCard;
use crate::binding::{WorkerSetTarget, WorkerSetTargetId};
use crate::discovery::{EndpointId, Instance, InstanceId, NamespaceEvent};

/// Dormant selections (sets whose instances all left) remembered for reuse, at most: a pool that
/// returns with the same card gets its old generation back (so the router reuses its binding);
/// beyond this many, the oldest dormant sets are forgotten (memory stays bounded however many
/// endpoints come and go).
pub const MAX_DORMANT_SETS: usize = 64;

/// The selected card of a prefill set and everything a target is made of.
#[derive(Debug)]
struct CardChoice {
    generation: u64,
    card: Arc<ModelCard>,
    admitted: watch::Sender<BTreeSet<InstanceId>>,
}

/// One worker set: the live instances of one endpoint.
#[derive(Debug)]
struct WorkerSet {
    kind: WorkerKind,
    /// Live instances: card and arrival number (first-wins is by arrival).
    instances: BTreeMap<InstanceId, (Arc<ModelCard>, u64)>,
    /// Prefill sets only: the card admission compares against.
    selection: Option<CardChoice>,
    /// Generations handed out so far for this group (never reused).
    generations: u64,
    /// Instances already logged as rejected (one log line per rejection).
    rejected: BTreeSet<InstanceId>,
    /// When the set last lost its final instance (orders dormant sets for eviction).
    dormant_since: Option<u64>,
}

/// The topology as the watcher publishes it after every change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopologySnapshot {
    /// The prefill target's identity, if the rule gives one.
    pub target: Option<WorkerSetTargetId>,
    /// Prefill sets with at least one admitted instance.
    pub prefill_sets: Vec<EndpointId>,
    /// Decode sets with at least one instance.
    pub decode_sets: Vec<EndpointId>,
    /// The decode endpoint when there is exactly one decode set.
    pub decode: Option<EndpointId>,
    /// Target changes so far (`set_target` calls the watcher made; 0 in [`Topology::view`],
    /// which the watcher fills in).
    pub retargets: u64,
}

/// An admission change to apply: grows before the target is set, shrinks after (so no request
/// is sent to an instance the new target does not admit, and a returning pool is admitted
/// before the router reuses its binding).
#[derive(Debug)]
pub struct AdmissionChange {
    sender: watch::Sender<BTreeSet<InstanceId>>,
    set: BTreeSet<InstanceId>,
    grows: bool,
}

impl AdmissionChange {
    /// Whether the new set only adds instances.
    pub fn grows(&self) -> bool {
        self.grows
    }

    /// Publish the new set to the bindings following it.
    pub fn apply(self) {
        self.sender.send_replace(self.set);
    }
}

/// What one event changed.
#[derive(Debug, Default)]
pub struct Changes {
    /// Admission sets to update.
    pub admissions: Vec<AdmissionChange>,
    /// Retired generations' admission senders: the watcher publishes an empty set and drops
    /// them after the target moved on (so retired bindings fail fast, never freeze).
    pub retired: Vec<watch::Sender<BTreeSet<InstanceId>>>,
}

/// Worker sets of one namespace, first-wins admission, and the target rule.
#[derive(Debug, Default)]
pub struct Topology {
    sets: BTreeMap<EndpointId, WorkerSet>,
    arrivals: u64,
    events: u64,
}

impl Topology {
    /// An empty topology.
    pub fn new() -> Self {
        Topology::default()
    }

    /// Apply one discovery event of the namespace.
    pub fn apply(&mut self, event: NamespaceEvent) -> Changes {
        self.events += 1;
        let mut changes = Changes::default();
        let endpoint = match event {
            NamespaceEvent::Upserted(instance, card) => self.upsert(instance, card),
            NamespaceEvent::Removed(endpoint, id) => {
                let Some(set) = self.sets.get_mut(&endpoint) else {
                    return changes;
                };
                set.instances.remove(&id);
                set.rejected.remove(&id);
                Some(endpoint)
            }
        };
        if let Some(endpoint) = endpoint {
            self.reselect(&endpoint, &mut changes);
        }
        self.evict_dormant();
        changes
    }

    fn upsert(&mut self, instance: Instance, card: ModelCard) -> Option<EndpointId> {
        let Some(kind) = worker_kind(&instance.endpoint) else {
            tracing::debug!(endpoint = %instance.endpoint, "not a prefill or decode component; ignored");
            return None;
        };
        let set = self
            .sets
            .entry(instance.endpoint.clone())
            .or_insert_with(|| WorkerSet {
                kind,
                instances: BTreeMap::new(),
                selection: None,
                generations: 0,
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

    /// Recompute a set's selection and admitted ids after a change.
    fn reselect(&mut self, endpoint: &EndpointId, changes: &mut Changes) {
        let events = self.events;
        let Some(set) = self.sets.get_mut(endpoint) else {
            return;
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
            return;
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
        if !keep && !set.instances.is_empty() {
            // First wins: the card of the earliest arrival among the live instances.
            let first = set
                .instances
                .values()
                .min_by_key(|(_, arrival)| *arrival)
                .map(|(c, _)| Arc::clone(c));
            if let Some(card) = first {
                set.generations += 1;
                let (admitted, _) = watch::channel(BTreeSet::new());
                let previous = set.selection.replace(CardChoice {
                    generation: set.generations,
                    card,
                    admitted,
                });
                tracing::info!(
                    group = %endpoint,
                    generation = set.generations,
                    "prefill set selected a card (new generation)"
                );
                if let Some(old) = previous {
                    changes.retired.push(old.admitted);
                }
            }
        }
        let Some(sel) = &set.selection else {
            return;
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
        let current = sel.admitted.borrow().clone();
        if current != admitted {
            changes.admissions.push(AdmissionChange {
                sender: sel.admitted.clone(),
                grows: admitted.is_superset(&current),
                set: admitted,
            });
        }
    }

    /// Forget the oldest dormant prefill sets beyond [`MAX_DORMANT_SETS`].
    fn evict_dormant(&mut self) {
        let mut dormant: Vec<(u64, EndpointId)> = self
            .sets
            .iter()
            .filter_map(|(e, s)| s.dormant_since.map(|t| (t, e.clone())))
            .collect();
        if dormant.len() <= MAX_DORMANT_SETS {
            return;
        }
        dormant.sort();
        let excess = dormant.len() - MAX_DORMANT_SETS;
        for (_, endpoint) in dormant.into_iter().take(excess) {
            self.sets.remove(&endpoint);
        }
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
    pub fn target(&self) -> Option<WorkerSetTarget> {
        let mut prefill = self.live_prefill();
        let (endpoint, set) = prefill.next()?;
        if prefill.next().is_some() || self.live_decode().count() != 1 {
            return None;
        }
        let sel = set.selection.as_ref()?;
        Some(WorkerSetTarget {
            id: WorkerSetTargetId {
                group: endpoint.to_string(),
                generation: sel.generation,
            },
            endpoint: endpoint.clone(),
            card: Arc::clone(&sel.card),
            admitted: sel.admitted.subscribe(),
        })
    }

    /// The view the watcher publishes.
    pub fn view(&self) -> TopologySnapshot {
        let decode_sets: Vec<EndpointId> = self.live_decode().cloned().collect();
        TopologySnapshot {
            target: self.target().map(|t| t.id),
            prefill_sets: self.live_prefill().map(|(e, _)| e.clone()).collect(),
            decode: (decode_sets.len() == 1).then(|| decode_sets[0].clone()),
            decode_sets,
            retargets: 0,
        }
    }
}

#[cfg(test)]
mod tests;
