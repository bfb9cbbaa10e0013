//! The migration model: the real `Migration` machine satisfies every property over the whole
//! bounded world and reaches every witness, and each mutant yields a counterexample of the
//! property that should catch it (docs/properties.md, "Migration").

use std::collections::{BTreeSet, HashSet};

use prefill_router_model::migration::*;
use stateright::{Checker, Expectation, HasDiscoveries, Model};

/// Unique states of [`MigrationModelConfig::STANDARD`] with the real machine, pinned so that a
/// silently truncated or changed search fails (update it, with the reason, when the model
/// changes).
const STANDARD_MIGRATION_STATES: usize = 33_369;

fn model(variant: Variant) -> MigrationModel {
    MigrationModel::new(MigrationModelConfig::STANDARD, variant)
}

#[test]
fn real_migration_machine_satisfies_every_property() {
    let checker = model(Variant::Real).checker().spawn_bfs().join();
    assert!(checker.is_done());
    checker.assert_properties();
    assert_eq!(checker.unique_state_count(), STANDARD_MIGRATION_STATES);
}

#[test]
fn dfs_agrees_with_bfs() {
    let checker = model(Variant::Real).checker().spawn_dfs().join();
    checker.assert_properties();
    assert_eq!(checker.unique_state_count(), STANDARD_MIGRATION_STATES);
}

#[test]
fn the_reference_tokens_are_distinct() {
    // MG2 reads "twice" as "the same value twice": true only if the engine's own output has
    // no repeated value.
    let m = model(Variant::Real);
    let distinct: HashSet<u32> = m.reference.iter().copied().collect();
    assert_eq!(distinct.len(), m.reference.len());
}

/// The shortest counterexample of `property` for `variant`, one step a line.
fn counterexample(variant: Variant, property: &'static str) -> String {
    for depth in 1..=24 {
        let checker = model(variant)
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
    panic!("mutant {} escaped property {property:?}", variant.name())
}

/// The always-properties `variant` breaks (the full verdict).
fn broken(variant: Variant) -> BTreeSet<&'static str> {
    let checker = model(variant).checker().spawn_bfs().join();
    checker
        .model()
        .properties()
        .into_iter()
        .filter(|p| p.expectation == Expectation::Always)
        .filter(|p| checker.discovery(p.name).is_some())
        .map(|p| p.name)
        .collect()
}

#[test]
fn accepting_a_dead_workers_late_token_emits_it_twice() {
    let t = counterexample(Variant::AcceptsStale, NO_TOKEN_EMITTED_TWICE);
    println!("{t}");
    assert!(t.contains("dies"), "{t}");
    assert!(t.contains("late token"), "{t}");
}

#[test]
fn a_continuation_without_the_last_token_emits_it_twice() {
    let t = counterexample(Variant::ForgetsLastToken, NO_TOKEN_EMITTED_TWICE);
    println!("{t}");
    assert!(
        t.find("streams a token").unwrap() < t.find("dies").unwrap(),
        "{t}"
    );
}

#[test]
fn a_limit_off_by_one_migrates_once_too_often() {
    let t = counterexample(Variant::LimitOffByOne, AT_MOST_LIMIT_MIGRATIONS);
    println!("{t}");
    assert_eq!(t.matches("dies").count(), 3, "{t}");
}

#[test]
fn a_cancel_the_machine_never_heard_lets_a_late_break_continue() {
    let t = counterexample(
        Variant::ContinuesAfterCancel,
        CANCEL_STOPS_EVERY_CONTINUATION,
    );
    println!("{t}");
    assert!(
        t.find("cancels").unwrap() < t.find("late break").unwrap(),
        "{t}"
    );
}

#[test]
fn a_continuation_keeping_the_handoff_reuses_it() {
    let t = counterexample(Variant::ReusesHandoff, HANDOFF_NEVER_REUSED);
    println!("{t}");
    assert_eq!(t.lines().count(), 1, "{t}");
}

#[test]
fn usage_from_the_last_attempt_counts_tokens_twice() {
    let t = counterexample(Variant::UsageOfLastAttempt, USAGE_COUNTS_EACH_TOKEN_ONCE);
    println!("{t}");
    assert!(t.contains("dies"), "{t}");
}

#[test]
fn a_swallowed_limit_error_leaves_the_stream_hanging() {
    let t = counterexample(Variant::NoEndAtLimit, STREAM_ENDS_EXACTLY_ONCE);
    println!("{t}");
    assert_eq!(t.matches("dies").count(), 3, "{t}");
}

#[test]
fn each_mutant_breaks_exactly_the_documented_properties() {
    // The "breaks" column of docs/properties.md, "Migration".
    let expected: [(Variant, &[&str]); 7] = [
        (
            Variant::AcceptsStale,
            &[EMITTED_IS_A_PREFIX, NO_TOKEN_EMITTED_TWICE],
        ),
        (
            Variant::ForgetsLastToken,
            &[EMITTED_IS_A_PREFIX, NO_TOKEN_EMITTED_TWICE],
        ),
        (Variant::LimitOffByOne, &[AT_MOST_LIMIT_MIGRATIONS]),
        // The continuation it starts after the cancel ends the stream a second time.
        (
            Variant::ContinuesAfterCancel,
            &[CANCEL_STOPS_EVERY_CONTINUATION, STREAM_ENDS_EXACTLY_ONCE],
        ),
        (Variant::ReusesHandoff, &[HANDOFF_NEVER_REUSED]),
        (Variant::UsageOfLastAttempt, &[USAGE_COUNTS_EACH_TOKEN_ONCE]),
        (Variant::NoEndAtLimit, &[STREAM_ENDS_EXACTLY_ONCE]),
    ];
    for (variant, props) in expected {
        let props: BTreeSet<&str> = props.iter().copied().collect();
        assert_eq!(broken(variant), props, "{}", variant.name());
    }
}

#[test]
fn every_safety_property_is_broken_by_some_mutant() {
    let caught: BTreeSet<&str> = Variant::ALL[1..].iter().flat_map(|&v| broken(v)).collect();
    for p in model(Variant::Real).properties() {
        assert!(
            p.expectation == Expectation::Sometimes || caught.contains(p.name),
            "property {:?} has no mutant that breaks it",
            p.name
        );
    }
}

/// Every state reachable with the real machine, by a plain search over the model's own steps.
fn reachable() -> Vec<World> {
    let model = model(Variant::Real);
    let mut seen = HashSet::new();
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

/// A rank every step strictly decreases: each spends a token, a death, a late event, the
/// cancel, time's pass or the timer.
fn rank(s: &World) -> u32 {
    let attempts: u32 = s
        .attempts
        .iter()
        .map(|a| match a.state {
            AttemptState::Live => 4 * (a.left + 1) + 2,
            AttemptState::Dead { late } | AttemptState::Dropped { late } => u32::from(late),
            AttemptState::Done => 0,
        })
        .sum();
    // A death turns a live attempt into a continuation (at most `max_tokens` + 1 more
    // weight) and spends one of few deaths: weigh deaths above any attempt.
    u32::from(s.deaths_left) * 100
        + attempts
        + u32::from(!s.cancelled)
        + u32::from(!s.past_deadline) * 2
        + u32::from(!s.timer_fired)
}

#[test]
fn paths_are_acyclic_and_every_end_has_ended_the_stream() {
    let model = model(Variant::Real);
    let all = reachable();
    assert_eq!(all.len(), STANDARD_MIGRATION_STATES);
    for s in &all {
        let mut steps = Vec::new();
        model.actions(s, &mut steps);
        if steps.is_empty() {
            assert!(s.ending.is_some(), "{s:?}");
        }
        for step in steps {
            let n = model.next_state(s, step).unwrap();
            assert!(
                rank(&n) < rank(s),
                "{step} does not decrease the rank: {s:?}"
            );
        }
    }
}
