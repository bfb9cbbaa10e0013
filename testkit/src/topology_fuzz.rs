//! Fuzz target `topology_events`: a sequence of discovery events through the topology
//! [`Machine`], each batch carried out in order by a driver
//! of plain values that checks it as it goes, and the state checked after every event.
//!
//! The checks are listed in the checker's docs (`src/topology/machine/checker.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use arbitrary::{Arbitrary, Unstructured};

use prefill_router::advert::ModelCard;
use prefill_router::discovery::{EndpointId, Instance, InstanceId, NamespaceEvent};
use prefill_router::topology::{
    worker_kind, Action, GenerationId, Machine, TargetSpec, WorkerKind, MAX_DORMANT_SETS,
};

/// Fixed components a step names most of the time (the rest are `prefill-<k>` sets, enough of
/// them to push dormant sets past `MAX_DORMANT_SETS`).
const COMPONENTS: [&str; 5] = ["prefill", "prefill-green", "decode", "decode-b", "encoder"];

/// Components in all: the fixed ones, then `prefill-0` .. `prefill-79`.
const COMPONENT_ALPHABET: u8 = COMPONENTS.len() as u8 + 80;

/// Instances per set.
pub const INSTANCE_ALPHABET: u8 = 4;

/// Distinct cards (by block size).
pub const CARD_ALPHABET: u8 = 3;

/// One step of a script.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopologyStep {
    /// An instance of a component registers (or changes its card).
    Up {
        /// Folded onto the components.
        component: u8,
        /// Folded onto [`INSTANCE_ALPHABET`].
        instance: u8,
        /// Folded onto [`CARD_ALPHABET`].
        card: u8,
    },
    /// An instance of a component leaves.
    Down {
        /// Folded onto the components.
        component: u8,
        /// Folded onto [`INSTANCE_ALPHABET`].
        instance: u8,
    },
}

/// A run: the events.
#[derive(Arbitrary, Clone, Debug, PartialEq, Eq)]
pub struct TopologyScript {
    /// The steps, in order.
    pub steps: Vec<TopologyStep>,
}

/// Decode raw fuzz bytes the way libfuzzer-sys does for a typed target.
pub fn decode(bytes: &[u8]) -> Option<TopologyScript> {
    TopologyScript::arbitrary_take_rest(Unstructured::new(bytes)).ok()
}

fn endpoint(component: u8) -> EndpointId {
    let c = component % COMPONENT_ALPHABET;
    let name = match COMPONENTS.get(usize::from(c)) {
        Some(name) => (*name).to_owned(),
        None => format!("prefill-{}", usize::from(c) - COMPONENTS.len()),
    };
    EndpointId::new("ns", name, "generate")
}

/// The discovery event of a step.
pub fn event_of(step: TopologyStep) -> NamespaceEvent {
    match step {
        TopologyStep::Up {
            component,
            instance,
            card,
        } => {
            let instance_id = InstanceId::from(instance % INSTANCE_ALPHABET);
            let instance = Instance {
                endpoint: endpoint(component),
                instance_id,
                address: SocketAddr::from(([127, 0, 0, 1], 9000 + instance_id as u16)),
            };
            let card = ModelCard {
                kv_cache_block_size: 16 << (card % CARD_ALPHABET),
                ..ModelCard::named("m")
            };
            NamespaceEvent::Upserted(instance, card)
        }
        TopologyStep::Down {
            component,
            instance,
        } => NamespaceEvent::Removed(
            endpoint(component),
            InstanceId::from(instance % INSTANCE_ALPHABET),
        ),
    }
}

/// A topology machine under test: the real one, or a broken variant of it
/// ([`ShrinksFirst`]) that the checks must reject.
pub trait TopologySubject {
    /// Apply one event; the actions in order.
    fn handle(&mut self, event: NamespaceEvent) -> Vec<Action>;
    /// The target last ordered.
    fn target(&self) -> Option<&TargetSpec>;
    /// Sets remembered.
    fn set_count(&self) -> usize;
    /// Dormant sets remembered.
    fn dormant_count(&self) -> usize;
}

impl TopologySubject for Machine {
    fn handle(&mut self, event: NamespaceEvent) -> Vec<Action> {
        Machine::handle(self, event).to_vec()
    }
    fn target(&self) -> Option<&TargetSpec> {
        Machine::target(self)
    }
    fn set_count(&self) -> usize {
        Machine::set_count(self)
    }
    fn dormant_count(&self) -> usize {
        Machine::dormant_count(self)
    }
}

/// A broken driver's view of the machine: every admission change is carried out before the
/// batch's `SetTarget`, shrinks included (the ordering rule ignored).
#[derive(Debug, Default)]
pub struct ShrinksFirst(pub Machine);

impl TopologySubject for ShrinksFirst {
    fn handle(&mut self, event: NamespaceEvent) -> Vec<Action> {
        let mut actions = self.0.handle(event).to_vec();
        // Stable: admissions first, the rest in their order.
        actions.sort_by_key(|a| !matches!(a, Action::Admission { .. }));
        actions
    }
    fn target(&self) -> Option<&TargetSpec> {
        self.0.target()
    }
    fn set_count(&self) -> usize {
        self.0.set_count()
    }
    fn dormant_count(&self) -> usize {
        self.0.dormant_count()
    }
}

/// The checking driver: the very file the machine's unit tests use (see its docs), compiled
/// here against this crate's copy of the library.
#[path = "../../src/topology/machine/checker.rs"]
mod checker;
use checker::{Ledger, Observed};

/// Runs a script through the real machine; `Err` names the first broken check.
pub fn run_topology_script(script: &TopologyScript) -> Result<(), String> {
    run_topology_script_with(script, Machine::new())
}

/// Runs a script through `m`.
pub fn run_topology_script_with<S: TopologySubject>(
    script: &TopologyScript,
    mut m: S,
) -> Result<(), String> {
    let mut ledger = Ledger::default();
    for (n, step) in script.steps.iter().enumerate() {
        let event = event_of(*step);
        ledger.observe(&event);
        let actions = m.handle(event);
        ledger
            .carry_out(&actions)
            .and_then(|()| {
                ledger.check_state(Observed {
                    target: m.target(),
                    set_count: m.set_count(),
                    dormant_count: m.dormant_count(),
                })
            })
            .map_err(|e| format!("step {n} ({step:?}): {e}"))?;
    }
    Ok(())
}

/// Run one decoded script; panics when a check fails.
pub fn check_topology_script(script: &TopologyScript) {
    if let Err(e) = run_topology_script(script) {
        panic!("topology_events: {e}");
    }
}

/// The `topology_events` harness.
pub fn topology_events(bytes: &[u8]) {
    if let Some(script) = decode(bytes) {
        check_topology_script(&script);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TopologyStep::*;

    fn up(component: u8, instance: u8, card: u8) -> TopologyStep {
        Up {
            component,
            instance,
            card,
        }
    }

    fn down(component: u8, instance: u8) -> TopologyStep {
        Down {
            component,
            instance,
        }
    }

    #[test]
    fn a_script_through_first_wins_generations_and_eviction_passes_the_checks() {
        let mut steps = vec![
            up(2, 9, 0),
            up(0, 1, 1),
            up(0, 2, 2),
            up(1, 3, 1),
            down(1, 3),
            down(0, 1),
            down(0, 2),
            up(0, 1, 2),
            up(4, 0, 0),
            up(3, 1, 0),
            down(3, 1),
        ];
        for k in 0..70u8 {
            steps.push(up(COMPONENTS.len() as u8 + k, 0, 0));
            steps.push(down(COMPONENTS.len() as u8 + k, 0));
        }
        steps.push(up(0, 3, 0));
        run_topology_script(&TopologyScript { steps }).unwrap();
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(decode(&bytes), decode(&bytes));
    }

    /// The broken driver passes no script where a shrink and a retarget meet.
    #[test]
    fn the_checks_catch_a_driver_that_shrinks_before_the_target() {
        let script = TopologyScript {
            steps: vec![up(2, 9, 0), up(0, 1, 0), down(0, 1)],
        };
        run_topology_script(&script).unwrap();
        let err = run_topology_script_with(&script, ShrinksFirst::default()).unwrap_err();
        assert!(err.contains("admits no instance"), "{err}");
    }
}
