//! The prefill handoff model: the real `Handoff` machine satisfies every property over the whole
//! bounded world, and each mutant yields a counterexample of the property that should catch it
//! (the "caught mutant" column of docs/properties.md, "Prefill handoff").

use std::collections::BTreeSet;

use prefill_router_model::handoff::*;
use stateright::{Checker, HasDiscoveries, Model};

/// Unique states of [`HandoffConfig::STANDARD`] with the real machine, pinned so that a silently
/// truncated or changed search fails (update it, with the reason, when the model changes).
const STANDARD_HANDOFF_STATES: usize = 63;

#[test]
fn real_handoff_machine_satisfies_every_property() {
    let checker = HandoffModel::<RealHandoff>::new(HandoffConfig::STANDARD)
        .checker()
        .spawn_bfs()
        .join();
    assert!(checker.is_done());
    checker.assert_properties();
    assert_eq!(checker.unique_state_count(), STANDARD_HANDOFF_STATES);
}

#[test]
fn dfs_agrees_with_bfs() {
    let checker = HandoffModel::<RealHandoff>::new(HandoffConfig::STANDARD)
        .checker()
        .spawn_dfs()
        .join();
    checker.assert_properties();
    assert_eq!(checker.unique_state_count(), STANDARD_HANDOFF_STATES);
}

/// The shortest counterexample of `property` for mutant `H`: BFS with a growing depth bound
/// (one unbounded run may report a longer path), as the steps' descriptions, one a line.
fn counterexample<H: Subject>(property: &'static str) -> String {
    for depth in 1..=16 {
        let checker = HandoffModel::<H>::new(HandoffConfig::STANDARD)
            .checker()
            .target_max_depth(depth)
            .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
            .spawn_bfs()
            .join();
        if let Some(path) = checker.discovery(property) {
            return path
                .into_actions()
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n");
        }
    }
    panic!("mutant {} escaped property {property:?}", H::NAME)
}

/// The names of the always-properties mutant `H` breaks (the full verdict).
fn broken<H: Subject>() -> BTreeSet<&'static str> {
    let checker = HandoffModel::<H>::new(HandoffConfig::STANDARD)
        .checker()
        .spawn_bfs()
        .join();
    checker
        .model()
        .properties()
        .into_iter()
        .filter(|p| p.expectation == stateright::Expectation::Always)
        .filter(|p| checker.discovery(p.name).is_some())
        .map(|p| p.name)
        .collect()
}

#[test]
fn resending_after_a_failure_breaks_ho1() {
    let t = counterexample::<ResendAfterFailure>(HANDOFF_CARRIED_AT_MOST_ONCE);
    println!("{t}");
    assert_eq!(t.matches("sends a decode attempt").count(), 2, "{t}");
    assert!(
        t.contains("after it left") || t.contains("mid-request"),
        "{t}"
    );
}

#[test]
fn a_silent_client_gone_breaks_ho2() {
    let t = counterexample::<SilentClientGone>(EVERY_HANDOFF_ENDS_COUNTED_EXACTLY_ONCE);
    assert!(t.contains("with a handle"), "{t}");
    println!("{t}");
    assert!(t.contains("cancels") || t.contains("deadline"), "{t}");
}

#[test]
fn counting_the_ending_again_when_the_client_goes_breaks_ho2() {
    let t = counterexample::<DoubleCount>(EVERY_HANDOFF_ENDS_COUNTED_EXACTLY_ONCE);
    println!("{t}");
    assert!(t.contains("cancels") || t.contains("deadline"), "{t}");
}

#[test]
fn a_copied_handoff_sends_after_abandon_and_breaks_ho3() {
    let t = counterexample::<SendAfterAbandon>(NO_DECODE_AFTER_ABANDON);
    println!("{t}");
    let gone = t.find("the client cancels").expect(&t);
    let sent = t.rfind("sends a decode attempt").expect(&t);
    assert!(gone < sent, "{t}");
}

#[test]
fn each_mutant_breaks_exactly_the_documented_properties() {
    // The "breaks" column of docs/properties.md, "Prefill handoff".
    assert_eq!(
        broken::<ResendAfterFailure>(),
        BTreeSet::from([
            HANDOFF_CARRIED_AT_MOST_ONCE,
            EVERY_HANDOFF_ENDS_COUNTED_EXACTLY_ONCE
        ])
    );
    assert_eq!(
        broken::<SilentClientGone>(),
        BTreeSet::from([EVERY_HANDOFF_ENDS_COUNTED_EXACTLY_ONCE])
    );
    assert_eq!(
        broken::<DoubleCount>(),
        BTreeSet::from([EVERY_HANDOFF_ENDS_COUNTED_EXACTLY_ONCE])
    );
    assert_eq!(
        broken::<SendAfterAbandon>(),
        BTreeSet::from([
            EVERY_HANDOFF_ENDS_COUNTED_EXACTLY_ONCE,
            NO_DECODE_AFTER_ABANDON
        ])
    );
}

#[test]
fn every_safety_property_is_broken_by_some_mutant() {
    let caught: BTreeSet<&str> = [
        HANDOFF_CARRIED_AT_MOST_ONCE,
        EVERY_HANDOFF_ENDS_COUNTED_EXACTLY_ONCE,
        NO_DECODE_AFTER_ABANDON,
    ]
    .into();
    let model = HandoffModel::<RealHandoff>::new(HandoffConfig::STANDARD);
    for p in model.properties() {
        assert!(
            p.expectation == stateright::Expectation::Sometimes || caught.contains(p.name),
            "property {:?} has no mutant that breaks it",
            p.name
        );
    }
}

/// Every state reachable with the real machine, by a plain search over the model's own steps.
fn reachable() -> Vec<World<RealHandoff>> {
    let model = HandoffModel::<RealHandoff>::new(HandoffConfig::STANDARD);
    let mut seen = std::collections::HashSet::new();
    let mut todo = model.init_states();
    let mut all = Vec::new();
    while let Some(s) = todo.pop() {
        if !seen.insert(s.clone()) {
            continue;
        }
        let mut steps = Vec::new();
        model.actions(&s, &mut steps);
        todo.extend(steps.into_iter().filter_map(|a| model.next_state(&s, a)));
        all.push(s);
    }
    all
}

/// A rank every step strictly decreases: a send spends an attempt, every other step moves the
/// phase forward (an attempt's end goes back to Idle, below InFlight) or the client goes.
fn rank(s: &World<RealHandoff>) -> u32 {
    let phase = match s.phase {
        Phase::Prefill => 4,
        Phase::InFlight => 3,
        Phase::Idle => 2,
        Phase::Streaming => 1,
        Phase::Over => 0,
    };
    u32::from(s.attempts_left) * 10 + phase + if s.client_gone { 0 } else { 100 }
}

#[test]
fn paths_are_acyclic_and_only_the_end_is_terminal() {
    // So HO2's "when the request is over" is checked at the end of every path: stateright's
    // terminal checks are sound here, and a state without a step is a request that is over.
    let model = HandoffModel::<RealHandoff>::new(HandoffConfig::STANDARD);
    let all = reachable();
    assert_eq!(all.len(), STANDARD_HANDOFF_STATES);
    for s in &all {
        let mut steps = Vec::new();
        model.actions(s, &mut steps);
        assert_eq!(steps.is_empty(), s.phase == Phase::Over, "{s:?}");
        for step in steps {
            let n = model.next_state(s, step).unwrap();
            assert!(
                rank(&n) < rank(s),
                "{step} does not decrease the rank: {s:?}"
            );
        }
    }
}

#[test]
fn a_client_leaving_mid_attempt_counts_a_maybe_carried_handoff_as_abandoned() {
    // A finding, not a property: `handle_abandon` while Sending ends the handoff
    // `Abandoned(ClientGone)` although the attempt in flight may have reached the decode worker
    // (which may pull the blocks). The ledger cannot tell "never left" from "maybe left".
    let maybe_carried = reachable().into_iter().any(|s| {
        s.cancelled_in_flight
            && s.left_carrying == 1
            && s.ledger
                .abandoned(prefill_router::handoff::AbandonReason::ClientGone)
                == 1
    });
    assert!(maybe_carried);
}
