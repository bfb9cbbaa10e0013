//! The topology machine's rules, one test each, through a driver of plain values that checks
//! every batch as it carries it out ([`World`], on the shared `checker.rs`); the proptests drive
//! the same world.

use super::checker::{Ledger, Observed};
use super::*;
use std::net::SocketAddr;

mod proptests;

fn ep(component: &str) -> EndpointId {
    EndpointId::new("ns", component, "generate")
}

fn inst(component: &str, id: InstanceId) -> Instance {
    Instance {
        endpoint: ep(component),
        instance_id: id,
        address: SocketAddr::from(([127, 0, 0, 1], 1000 + u16::try_from(id).unwrap())),
    }
}

fn card(block: u32) -> ModelCard {
    ModelCard {
        kv_cache_block_size: block,
        ..ModelCard::named("m")
    }
}

/// The machine under test and the checking driver ([`Ledger`]) that carries out its batches;
/// `apply` fails with the first rule broken.
#[derive(Default)]
pub(super) struct World {
    pub(super) m: Machine,
    pub(super) ledger: Ledger,
}

impl World {
    pub(super) fn new(m: Machine) -> Self {
        World {
            m,
            ledger: Ledger::default(),
        }
    }

    /// Feed one event, carry out its batch and check it.
    pub(super) fn apply(&mut self, event: NamespaceEvent) -> Result<Vec<Action>, String> {
        self.ledger.observe(&event);
        let actions = self.m.handle(event).to_vec();
        self.ledger.carry_out(&actions)?;
        self.ledger.check_state(Observed {
            target: self.m.target(),
            set_count: self.m.set_count(),
            dormant_count: self.m.dormant_count(),
        })?;
        Ok(actions)
    }

    fn up(&mut self, component: &str, id: InstanceId, block: u32) -> Vec<Action> {
        let event = NamespaceEvent::Upserted(inst(component, id), card(block));
        self.apply(event).unwrap()
    }

    fn down(&mut self, component: &str, id: InstanceId) -> Vec<Action> {
        self.apply(NamespaceEvent::Removed(ep(component), id))
            .unwrap()
    }

    fn target(&self) -> Option<&TargetSpec> {
        self.ledger.target.as_ref()
    }

    fn admitted(&self) -> BTreeSet<InstanceId> {
        self.ledger.admissions[&self.target().unwrap().id].clone()
    }
}

fn gen(component: &str, generation: u64) -> GenerationId {
    GenerationId {
        endpoint: ep(component),
        generation,
    }
}

#[test]
fn one_prefill_and_one_decode_set_give_a_target() {
    let mut w = World::default();
    w.up("prefill", 1, 16);
    assert!(w.target().is_none(), "no decode set yet");
    w.up("decode", 9, 16);
    let target = w.target().unwrap();
    assert_eq!(target.id, gen("prefill", 1));
    assert_eq!(target.card.kv_cache_block_size, 16);
    assert_eq!(w.admitted(), BTreeSet::from([1]));
    assert_eq!(w.m.decode_sets(), vec![ep("decode")]);
    assert_eq!(w.m.retargets(), 1);
}

#[test]
fn two_prefill_sets_or_two_decode_sets_give_none() {
    let mut w = World::default();
    w.up("prefill", 1, 16);
    w.up("decode", 9, 16);
    w.up("prefill-green", 2, 16);
    assert!(w.target().is_none(), "two prefill sets");
    w.down("prefill-green", 2);
    assert!(w.target().is_some());
    w.up("decode-b", 8, 16);
    assert!(w.target().is_none(), "two decode sets");
    assert_eq!(w.m.retargets(), 4);
}

#[test]
fn other_components_are_ignored() {
    let mut w = World::default();
    w.up("prefill", 1, 16);
    w.up("decode", 9, 16);
    assert!(w.up("encoder", 5, 16).is_empty());
    assert!(w.target().is_some());
}

#[test]
fn first_card_wins_until_its_set_empties() {
    let mut w = World::default();
    w.up("decode", 9, 16);
    w.up("prefill", 2, 64);
    w.up("prefill", 1, 32); // lower id, later arrival: rejected
    w.up("prefill", 3, 64);
    assert_eq!(w.target().unwrap().card.kv_cache_block_size, 64);
    assert_eq!(w.admitted(), BTreeSet::from([2, 3]));
    // Re-registering the first instance keeps its arrival: still the selection.
    w.up("prefill", 2, 64);
    w.down("prefill", 3);
    assert_eq!(w.target().unwrap().id, gen("prefill", 1));
    // The set's last 64-instance leaves: 32 wins, a new generation.
    w.down("prefill", 2);
    let target = w.target().unwrap();
    assert_eq!(
        (target.id.generation, target.card.kv_cache_block_size),
        (2, 32)
    );
    assert_eq!(w.admitted(), BTreeSet::from([1]));
}

#[test]
fn admission_follows_membership_without_a_new_generation() {
    let mut w = World::default();
    w.up("decode", 9, 16);
    w.up("prefill", 1, 64);
    w.up("prefill", 2, 64);
    assert_eq!(w.admitted(), BTreeSet::from([1, 2]));
    w.down("prefill", 1);
    assert_eq!(w.admitted(), BTreeSet::from([2]));
    assert_eq!(w.target().unwrap().id.generation, 1);
}

#[test]
fn card_change_after_the_old_card_leaves_is_a_new_generation() {
    let mut w = World::default();
    w.up("decode", 9, 16);
    w.up("prefill", 1, 64);
    w.up("prefill", 2, 32); // rejected while 1 holds the selection
    assert_eq!(w.target().unwrap().id.generation, 1);
    let actions = w.down("prefill", 1);
    let target = w.target().unwrap();
    assert_eq!(
        (target.id.generation, target.card.kv_cache_block_size),
        (2, 32)
    );
    assert_eq!(w.admitted(), BTreeSet::from([2]));
    // Generation 2 admitted, then targeted; generation 1 retired last (the driver empties it).
    assert_eq!(
        actions,
        vec![
            Action::Admission {
                id: gen("prefill", 2),
                set: BTreeSet::from([2]),
                grows: true
            },
            Action::SetTarget(Some(target.clone())),
            Action::Retire(gen("prefill", 1)),
        ]
    );
}

#[test]
fn a_returning_pool_gets_its_generation_back() {
    let mut w = World::default();
    w.up("decode", 9, 16);
    w.up("prefill", 1, 64);
    let before = w.target().unwrap().id.clone();
    w.down("prefill", 1);
    assert!(w.target().is_none(), "pool vanished");
    assert_eq!(w.ledger.admissions[&before], BTreeSet::new(), "kept, empty");
    let actions = w.up("prefill", 4, 64);
    assert_eq!(w.target().unwrap().id, before, "same id: the router reuses");
    assert_eq!(w.admitted(), BTreeSet::from([4]));
    assert!(!actions.iter().any(|a| matches!(a, Action::Retire(_))));
}

#[test]
fn a_pool_that_returns_with_another_card_is_a_new_generation() {
    let mut w = World::default();
    w.up("decode", 9, 16);
    w.up("prefill", 1, 64);
    w.down("prefill", 1);
    let actions = w.up("prefill", 1, 32);
    assert_eq!(w.target().unwrap().id.generation, 2);
    assert!(actions.contains(&Action::Retire(gen("prefill", 1))));
}

#[test]
fn admission_grows_before_the_target_and_shrinks_after() {
    let mut w = World::default();
    w.up("decode", 9, 16);
    // A grow that makes the target: the admission first.
    let actions = w.up("prefill", 1, 64);
    assert!(matches!(
        actions.as_slice(),
        [
            Action::Admission { grows: true, .. },
            Action::SetTarget(Some(_))
        ]
    ));
    // A shrink that clears the target: the target first.
    let actions = w.down("prefill", 1);
    assert!(matches!(
        actions.as_slice(),
        [
            Action::SetTarget(None),
            Action::Admission { grows: false, .. }
        ]
    ));
    // A returning pool: admitted before the router is pointed back at its generation.
    let actions = w.up("prefill", 2, 64);
    assert!(matches!(
        actions.as_slice(),
        [
            Action::Admission { grows: true, .. },
            Action::SetTarget(Some(_))
        ]
    ));
}

#[test]
fn the_ordering_check_catches_shrinks_before_the_target() {
    let mut w = World::new(Machine::new().with_mutant(TopologyMutant::ShrinksBeforeTarget));
    w.up("decode", 9, 16);
    w.up("prefill", 1, 64);
    let err = w
        .apply(NamespaceEvent::Removed(ep("prefill"), 1))
        .unwrap_err();
    assert!(err.contains("admits no instance"), "{err}");
}

#[test]
fn dormant_sets_stay_bounded() {
    let mut w = World::default();
    for i in 0..(MAX_DORMANT_SETS as u64 + 10) {
        let component = format!("prefill-{i}");
        w.up(&component, i, 16);
        let actions = w.down(&component, i);
        let forgets = actions
            .iter()
            .filter(|a| matches!(a, Action::Forget(_)))
            .count();
        assert_eq!(
            forgets,
            usize::from(i >= MAX_DORMANT_SETS as u64),
            "i = {i}"
        );
    }
    assert_eq!(w.m.set_count(), MAX_DORMANT_SETS);
    assert_eq!(
        w.ledger.admissions.len(),
        MAX_DORMANT_SETS,
        "the driver's too"
    );
    // The oldest went first.
    assert_eq!(w.m.generations(&ep("prefill-0")), None);
    assert!(w.m.generations(&ep("prefill-73")).is_some());
}

#[test]
fn a_forgotten_group_seen_again_never_reuses_a_generation() {
    let mut w = World::default();
    w.up("decode", 9, 16);
    w.up("prefill", 1, 64);
    w.down("prefill", 1);
    // Enough other sets go dormant after it for `prefill` to be forgotten.
    for i in 0..MAX_DORMANT_SETS as u64 {
        let component = format!("prefill-{i}");
        w.up(&component, 100 + i, 16);
        w.down(&component, 100 + i);
    }
    assert_eq!(w.m.generations(&ep("prefill")), None, "forgotten");
    // Back with another card: generation 1 would name another card's binding.
    w.up("prefill", 1, 32);
    assert_eq!(w.target().unwrap().id, gen("prefill", 2));
}

#[test]
fn a_generation_is_shown_as_its_endpoint_at_its_number() {
    // Logs and the watcher's errors name generations this way.
    let id = gen("prefill", 3);
    assert_eq!(id.to_string(), format!("{}@3", ep("prefill")));
}

#[test]
fn dormant_sets_are_forgotten_oldest_first_whatever_their_names() {
    let mut w = World::default();
    // The oldest dormant set sorts last by name: only its age can pick it.
    w.up("prefill-zz", 1, 16);
    w.down("prefill-zz", 1);
    assert!(
        w.m.generations(&ep("prefill-zz")).is_some(),
        "remembered, dormant"
    );
    for i in 0..MAX_DORMANT_SETS as u64 {
        let component = format!("prefill-{i}");
        w.up(&component, 100 + i, 16);
        w.down(&component, 100 + i);
    }
    assert_eq!(w.m.generations(&ep("prefill-zz")), None, "the oldest went");
    assert!(w.m.generations(&ep("prefill-0")).is_some());
}

#[test]
fn a_reselection_takes_the_earliest_arrival_not_the_lowest_id() {
    let mut w = World::default();
    w.up("decode", 9, 16);
    w.up("prefill", 7, 16);
    w.up("prefill", 5, 32); // second arrival
    w.up("prefill", 3, 64); // third arrival, lowest id
    w.down("prefill", 7);
    let target = w.target().unwrap();
    assert_eq!(
        (target.id.generation, target.card.kv_cache_block_size),
        (2, 32)
    );
    assert_eq!(w.admitted(), BTreeSet::from([5]));
}

#[test]
fn the_status_accessors_report_the_sets_and_what_was_published() {
    // The watcher's status and metrics read these; the rules above only read the target.
    let mut w = World::default();
    w.up("decode", 9, 16);
    w.up("prefill", 2, 16);
    w.up("prefill", 3, 16);
    w.up("prefill", 4, 32); // another card: not admitted
    assert_eq!(w.m.prefill_sets(), vec![ep("prefill")]);
    let (generation, admitted) = w.m.admitted(&ep("prefill")).unwrap();
    assert_eq!((generation, admitted), (1, &BTreeSet::from([2, 3])));
    assert_eq!(w.m.admitted(&ep("decode")), None);
    assert_eq!(w.m.dormant_count(), 0);
    for id in [2, 3, 4] {
        w.down("prefill", id);
    }
    assert_eq!(
        w.m.dormant_count(),
        1,
        "the emptied set is remembered, dormant"
    );
}

fn engine_card(block: u32) -> ModelCard {
    ModelCard {
        engine: Some(crate::advert::EngineCard {
            protocol: crate::advert::EngineProtocol::Vllm,
        }),
        ..card(block)
    }
}

#[test]
fn a_set_is_reached_as_its_cards_say_and_a_mix_is_refused() {
    let mut w = World::default();
    assert_eq!(w.m.set_link(&ep("decode")), None, "an unknown set");
    w.up("decode", 100, 16);
    assert_eq!(w.m.set_link(&ep("decode")), Some(SetLink::RequestPlane));
    w.down("decode", 100);
    assert_eq!(w.m.set_link(&ep("decode")), None, "an empty set");
    w.apply(NamespaceEvent::Upserted(
        inst("decode", 101),
        engine_card(32),
    ))
    .unwrap();
    w.apply(NamespaceEvent::Upserted(
        inst("decode", 102),
        engine_card(32),
    ))
    .unwrap();
    assert_eq!(
        w.m.set_link(&ep("decode")),
        Some(SetLink::Engine {
            protocol: crate::advert::EngineProtocol::Vllm,
            block_size: 32
        })
    );
    w.up("decode", 103, 32);
    assert_eq!(w.m.set_link(&ep("decode")), Some(SetLink::Mixed));
}
