//! The topology core's rules, one test each.

use super::*;
use std::net::SocketAddr;

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

fn up(t: &mut Topology, component: &str, id: InstanceId, block: u32) -> Changes {
    let changes = t.apply(NamespaceEvent::Upserted(inst(component, id), card(block)));
    apply_all(changes)
}

fn down(t: &mut Topology, component: &str, id: InstanceId) -> Changes {
    apply_all(t.apply(NamespaceEvent::Removed(ep(component), id)))
}

/// Apply admissions as the watcher does; return what was left (retired senders).
fn apply_all(mut changes: Changes) -> Changes {
    for a in changes.admissions.drain(..) {
        a.apply();
    }
    changes
}

fn admitted(t: &Topology) -> BTreeSet<InstanceId> {
    t.target().unwrap().admitted.borrow().clone()
}

#[test]
fn one_prefill_and_one_decode_set_give_a_target() {
    let mut t = Topology::new();
    up(&mut t, "prefill", 1, 16);
    assert!(t.target().is_none(), "no decode set yet");
    up(&mut t, "decode", 9, 16);
    let target = t.target().unwrap();
    assert_eq!(
        (target.id.group.as_str(), target.id.generation),
        ("ns/prefill/generate", 1)
    );
    assert_eq!(target.card.kv_cache_block_size, 16);
    assert_eq!(admitted(&t), BTreeSet::from([1]));
    assert_eq!(t.view().decode, Some(ep("decode")));
}

#[test]
fn two_prefill_sets_or_two_decode_sets_give_none() {
    let mut t = Topology::new();
    up(&mut t, "prefill", 1, 16);
    up(&mut t, "decode", 9, 16);
    up(&mut t, "prefill-green", 2, 16);
    assert!(t.target().is_none(), "two prefill sets");
    down(&mut t, "prefill-green", 2);
    assert!(t.target().is_some());
    up(&mut t, "decode-b", 8, 16);
    assert!(t.target().is_none(), "two decode sets");
    assert_eq!(t.view().decode, None);
}

#[test]
fn other_components_are_ignored() {
    let mut t = Topology::new();
    up(&mut t, "prefill", 1, 16);
    up(&mut t, "decode", 9, 16);
    up(&mut t, "encoder", 5, 16);
    assert!(t.target().is_some());
}

#[test]
fn first_wins_admission_rejects_incompatible_cards() {
    let mut t = Topology::new();
    up(&mut t, "decode", 9, 16);
    up(&mut t, "prefill", 2, 64);
    up(&mut t, "prefill", 1, 32); // lower id, later arrival: rejected
    up(&mut t, "prefill", 3, 64);
    let target = t.target().unwrap();
    assert_eq!(target.card.kv_cache_block_size, 64);
    assert_eq!(admitted(&t), BTreeSet::from([2, 3]));
}

#[test]
fn admission_follows_membership_without_a_new_generation() {
    let mut t = Topology::new();
    up(&mut t, "decode", 9, 16);
    up(&mut t, "prefill", 1, 64);
    let rx = t.target().unwrap().admitted;
    up(&mut t, "prefill", 2, 64);
    assert_eq!(*rx.borrow(), BTreeSet::from([1, 2]));
    down(&mut t, "prefill", 1);
    assert_eq!(*rx.borrow(), BTreeSet::from([2]));
    assert_eq!(t.target().unwrap().id.generation, 1);
}

#[test]
fn card_change_after_the_old_card_leaves_is_a_new_generation() {
    let mut t = Topology::new();
    up(&mut t, "decode", 9, 16);
    up(&mut t, "prefill", 1, 64);
    let old = t.target().unwrap().admitted;
    up(&mut t, "prefill", 2, 32); // rejected while 1 holds the selection
    assert_eq!(t.target().unwrap().id.generation, 1);
    let changes = down(&mut t, "prefill", 1);
    let target = t.target().unwrap();
    assert_eq!(
        (target.id.generation, target.card.kv_cache_block_size),
        (2, 32)
    );
    assert_eq!(*target.admitted.borrow(), BTreeSet::from([2]));
    assert_eq!(
        changes.retired.len(),
        1,
        "generation 1's admission is retired"
    );
    assert_eq!(
        *old.borrow(),
        BTreeSet::from([1]),
        "the watcher, not the core, empties it"
    );
}

#[test]
fn a_pool_that_returns_with_the_same_card_keeps_its_generation() {
    let mut t = Topology::new();
    up(&mut t, "decode", 9, 16);
    up(&mut t, "prefill", 1, 64);
    let before = t.target().unwrap();
    down(&mut t, "prefill", 1);
    assert!(t.target().is_none(), "pool vanished");
    assert!(before.admitted.borrow().is_empty());
    up(&mut t, "prefill", 4, 64);
    let after = t.target().unwrap();
    assert_eq!(
        after.id.generation, before.id.generation,
        "same id: the router reuses"
    );
    assert_eq!(*before.admitted.borrow(), BTreeSet::from([4]));
}

#[test]
fn a_pool_that_returns_with_another_card_is_a_new_generation() {
    let mut t = Topology::new();
    up(&mut t, "decode", 9, 16);
    up(&mut t, "prefill", 1, 64);
    down(&mut t, "prefill", 1);
    let changes = up(&mut t, "prefill", 1, 32);
    assert_eq!(t.target().unwrap().id.generation, 2);
    assert_eq!(changes.retired.len(), 1);
}

#[test]
fn grows_and_shrinks_are_classified() {
    let mut t = Topology::new();
    up(&mut t, "decode", 9, 16);
    let c = t.apply(NamespaceEvent::Upserted(inst("prefill", 1), card(64)));
    assert!(c.admissions.iter().all(AdmissionChange::grows));
    apply_all(c);
    let c = t.apply(NamespaceEvent::Removed(ep("prefill"), 1));
    assert!(c.admissions.iter().all(|a| !a.grows()));
}

#[test]
fn dormant_sets_are_bounded() {
    let mut t = Topology::new();
    for i in 0..(MAX_DORMANT_SETS as u64 + 10) {
        let component = format!("prefill-{i}");
        up(&mut t, &component, i, 16);
        down(&mut t, &component, i);
    }
    assert!(t.sets.len() <= MAX_DORMANT_SETS);
}
