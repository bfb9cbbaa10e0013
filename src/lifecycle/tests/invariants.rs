//! The invariants I1-I6, each on a scripted history that stresses it, and the bounds every
//! reachable state keeps.

use super::*;

// ---- invariants, each on a scripted history that stresses it ----

/// A history touching every rule, including stale, repeated and unknown ids.
fn stress_history() -> Vec<Input<&'static str>> {
    vec![
        SetTarget(Some(A)),
        BuildFailed(BuildId(1)),
        SetTarget(Some(B)),
        RetryElapsed(BuildId(1)),
        BuildSucceeded(BuildId(1)),
        BuildSucceeded(BuildId(2)),
        SetTarget(None),
        SetTarget(Some(B)),
        SetTarget(Some(A)),
        BuildFailed(BuildId(3)),
        RetryElapsed(BuildId(3)),
        SetTarget(Some(B)),
        BuildSucceeded(BuildId(4)),
        BuildSucceeded(BuildId(5)),
        SetTarget(Some(A)),
        BuildSucceeded(BuildId(6)),
        BuildSucceeded(BuildId(6)),
        SetTarget(None),
        SetTarget(Some(A)),
        Shutdown,
        BuildSucceeded(BuildId(6)),
    ]
}

#[test]
fn i1_active_implies_held_binding_serves_desired() {
    let mut m = machine();
    for input in stress_history() {
        let _ = m.handle(input);
        if m.lifecycle() == Lifecycle::Active {
            let desired = m.desired().expect("I1: Active has a desired target");
            assert_eq!(m.held().map(|(_, t)| t), Some(desired));
        }
    }
}

#[test]
fn i2_build_in_flight_is_for_desired_with_nothing_held_and_no_retry() {
    let mut m = machine();
    for input in stress_history() {
        let _ = m.handle(input);
        if let Some((_, t)) = m.in_flight() {
            assert_eq!(Some(t), m.desired());
            assert_eq!(m.held(), None);
            assert_eq!(m.retry_armed(), None);
        }
    }
}

#[test]
fn i3_every_started_build_is_answered_once_by_result_or_cancel() {
    let mut m = machine();
    let mut open: Vec<BuildId> = Vec::new();
    let mut answered: Vec<BuildId> = Vec::new();
    for input in stress_history() {
        let current = m.in_flight().map(|(b, _)| b);
        let result_for = match &input {
            BuildSucceeded(b) | BuildFailed(b) if Some(*b) == current => Some(*b),
            _ => None,
        };
        let out = step(&mut m, input);
        if let Some(b) = result_for {
            open.retain(|x| *x != b);
            answered.push(b);
        }
        for a in &out {
            match a {
                StartBuild { build, .. } => open.push(*build),
                CancelBuild { build } => {
                    assert!(open.contains(build), "cancel of a build not open");
                    open.retain(|x| x != build);
                    answered.push(*build);
                }
                _ => {}
            }
        }
        assert!(open.len() <= 1, "I3: at most one build in flight");
    }
    let mut sorted = answered.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), answered.len(), "a build answered twice");
}

#[test]
fn i4_publish_names_only_the_in_flight_build_of_the_desired_target() {
    let mut m = machine();
    for input in stress_history() {
        let before = m.clone();
        for a in step(&mut m, input) {
            if let Publish { build, target } = a {
                assert_eq!(before.in_flight(), Some((build, &target)));
                assert_eq!(before.desired(), Some(&target));
            }
        }
    }
}

#[test]
fn i5_every_published_binding_is_retired_exactly_once() {
    let mut m = machine();
    let mut published: Vec<BuildId> = Vec::new();
    let mut retired: Vec<BuildId> = Vec::new();
    for input in stress_history() {
        for a in step(&mut m, input) {
            match a {
                Publish { build, .. } => published.push(build),
                Retire { build } => {
                    assert!(published.contains(&build), "retired an unpublished binding");
                    assert!(!retired.contains(&build), "retired twice");
                    retired.push(build);
                }
                _ => {}
            }
        }
    }
    assert!(m.is_shut_down());
    published.sort();
    retired.sort();
    assert_eq!(
        published, retired,
        "after shutdown every binding is retired"
    );
}

#[test]
fn i6_build_ids_strictly_increase() {
    let mut m = machine();
    let mut last = BuildId(0);
    for input in stress_history() {
        for a in step(&mut m, input) {
            if let StartBuild { build, .. } = a {
                assert!(build > last);
                last = build;
            }
        }
    }
    assert!(last >= BuildId(5));
}

#[test]
fn action_batches_never_exceed_three() {
    let mut m = machine();
    for input in stress_history() {
        assert!(m.handle(input).len() <= 3);
    }
}

#[test]
fn held_binding_is_for_the_desired_target_in_every_reachable_state() {
    // The invariant that makes `lifecycle()`'s `h == t` guard always true when it is reached
    // (.cargo/mutants.toml excludes that mutant as equivalent): explored over every state
    // reachable with at most four builds, deduplicated, so the search is finite and small (67
    // states).
    // The state cap keeps a broken machine whose ids stop increasing (an unbounded search)
    // from spinning: it fails here instead.
    const STATE_CAP: usize = 1_000;
    let ids = || (1..=5).map(BuildId);
    let mut inputs = vec![
        SetTarget(None),
        SetTarget(Some(A)),
        SetTarget(Some(B)),
        Shutdown,
    ];
    for id in ids() {
        inputs.extend([BuildSucceeded(id), BuildFailed(id), RetryElapsed(id)]);
    }
    let mut seen = std::collections::HashSet::new();
    let mut frontier = vec![machine()];
    while let Some(m) = frontier.pop() {
        if !seen.insert(m.clone()) {
            continue;
        }
        assert!(seen.len() <= STATE_CAP, "the search did not close");
        if let (Some(desired), Some((_, held))) = (m.desired(), m.held()) {
            assert_eq!(held, desired, "{m:?}");
        }
        for input in &inputs {
            let mut next = m.clone();
            let _ = next.handle(input.clone());
            if next.next_build_id() <= BuildId(5) {
                frontier.push(next);
            }
        }
    }
    assert!(
        seen.len() > 50,
        "the search reached only {} states",
        seen.len()
    );
}
