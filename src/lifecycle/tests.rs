//! One test per transition row (rules 1-8 of docs/design.md) and per invariant (I1-I6).

use super::*;
use Action::*;
use Input::*;

const A: &str = "a";
const B: &str = "b";

fn machine() -> Machine<&'static str> {
    Machine::new(RetryPolicy::default())
}

fn step(m: &mut Machine<&'static str>, input: Input<&'static str>) -> Vec<Action<&'static str>> {
    m.handle(input).into_iter().collect()
}

/// A machine that built and published `A` with build 1.
fn active_on_a() -> Machine<&'static str> {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(BuildSucceeded(BuildId(1)));
    assert_eq!(m.lifecycle(), Lifecycle::Active);
    m
}

// ---- derived lifecycle ----

#[test]
fn fresh_machine_is_pending_with_nothing_held() {
    let m = machine();
    assert_eq!(m.lifecycle(), Lifecycle::Pending);
    assert_eq!(m.desired(), None);
    assert!(!m.is_targeted());
    assert_eq!(m.held(), None);
    assert_eq!(m.in_flight(), None);
    assert_eq!(m.failures(), 0);
    assert_eq!(m.next_build_id(), BuildId(1));
}

// ---- rule 1: same decision is a no-op ----

#[test]
fn rule1_same_target_is_a_no_op() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let before = m.clone();
    assert!(step(&mut m, SetTarget(Some(A))).is_empty());
    assert_eq!(m, before);
}

#[test]
fn rule1_repeated_none_is_a_no_op() {
    let mut m = active_on_a();
    let _ = m.handle(SetTarget(None));
    let before = m.clone();
    assert!(step(&mut m, SetTarget(None)).is_empty());
    assert_eq!(m, before);
}

#[test]
fn rule1_first_none_decides_unavailable_without_actions() {
    let mut m = machine();
    assert!(step(&mut m, SetTarget(None)).is_empty());
    assert_eq!(m.lifecycle(), Lifecycle::Unavailable);
    assert!(m.is_targeted());
}

#[test]
fn rule1_same_target_while_retrying_keeps_the_retry() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(BuildFailed(BuildId(1)));
    assert!(step(&mut m, SetTarget(Some(A))).is_empty());
    assert_eq!(m.retry_armed(), Some(BuildId(1)));
    assert_eq!(m.failures(), 1);
}

// ---- rule 2: clearing ----

#[test]
fn rule2_clear_keeps_the_held_binding_for_reuse() {
    let mut m = active_on_a();
    assert!(step(&mut m, SetTarget(None)).is_empty());
    assert_eq!(m.lifecycle(), Lifecycle::Unavailable);
    assert_eq!(m.held(), Some((BuildId(1), &A)));
}

#[test]
fn rule2_clear_cancels_the_build_in_flight() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    assert_eq!(
        step(&mut m, SetTarget(None)),
        vec![CancelBuild { build: BuildId(1) }]
    );
    assert_eq!(m.in_flight(), None);
    assert_eq!(m.lifecycle(), Lifecycle::Unavailable);
}

#[test]
fn rule2_clear_cancels_the_armed_retry_and_resets_failures() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(BuildFailed(BuildId(1)));
    assert_eq!(
        step(&mut m, SetTarget(None)),
        vec![CancelRetry { after: BuildId(1) }]
    );
    assert_eq!(m.retry_armed(), None);
    assert_eq!(m.failures(), 0);
}

// ---- rule 3: reuse ----

#[test]
fn rule3_returning_target_reuses_the_held_binding_without_a_build() {
    let mut m = active_on_a();
    let _ = m.handle(SetTarget(None));
    assert!(step(&mut m, SetTarget(Some(A))).is_empty());
    assert_eq!(m.lifecycle(), Lifecycle::Active);
    assert_eq!(m.held(), Some((BuildId(1), &A)));
    assert_eq!(m.next_build_id(), BuildId(2));
}

#[test]
fn rule3_reuse_resets_failures() {
    let mut m = active_on_a();
    let _ = m.handle(SetTarget(Some(B))); // retires a, builds b (#2)
    let _ = m.handle(BuildFailed(BuildId(2)));
    assert_eq!(m.failures(), 1);
    let _ = m.handle(SetTarget(None));
    let _ = m.handle(SetTarget(Some(B)));
    let _ = m.handle(BuildSucceeded(BuildId(3)));
    let _ = m.handle(SetTarget(None));
    assert!(step(&mut m, SetTarget(Some(B))).is_empty());
    assert_eq!(m.failures(), 0);
}

// ---- rule 4: rebuild ----

#[test]
fn rule4_new_target_starts_a_build_and_is_pending() {
    let mut m = machine();
    assert_eq!(
        step(&mut m, SetTarget(Some(A))),
        vec![StartBuild {
            build: BuildId(1),
            target: A
        }]
    );
    assert_eq!(m.lifecycle(), Lifecycle::Pending);
    assert_eq!(m.in_flight(), Some((BuildId(1), &A)));
}

#[test]
fn rule4_other_target_retires_the_held_binding_then_builds() {
    let mut m = active_on_a();
    assert_eq!(
        step(&mut m, SetTarget(Some(B))),
        vec![
            Retire { build: BuildId(1) },
            StartBuild {
                build: BuildId(2),
                target: B
            }
        ]
    );
    assert_eq!(m.held(), None);
    assert_eq!(m.lifecycle(), Lifecycle::Pending);
}

#[test]
fn rule4_retarget_mid_build_cancels_then_starts() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    assert_eq!(
        step(&mut m, SetTarget(Some(B))),
        vec![
            CancelBuild { build: BuildId(1) },
            StartBuild {
                build: BuildId(2),
                target: B
            }
        ]
    );
}

#[test]
fn rule4_retarget_while_retrying_cancels_retry_and_resets_failures() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(BuildFailed(BuildId(1)));
    assert_eq!(
        step(&mut m, SetTarget(Some(B))),
        vec![
            CancelRetry { after: BuildId(1) },
            StartBuild {
                build: BuildId(2),
                target: B
            }
        ]
    );
    assert_eq!(m.failures(), 0);
}

#[test]
fn rule4_held_binding_for_other_target_after_clear_is_retired() {
    let mut m = active_on_a();
    let _ = m.handle(SetTarget(None));
    assert_eq!(
        step(&mut m, SetTarget(Some(B))),
        vec![
            Retire { build: BuildId(1) },
            StartBuild {
                build: BuildId(2),
                target: B
            }
        ]
    );
}

// ---- rule 5: build success and stale-build rejection ----

#[test]
fn rule5_current_build_success_publishes_and_activates() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    assert_eq!(
        step(&mut m, BuildSucceeded(BuildId(1))),
        vec![Publish {
            build: BuildId(1),
            target: A
        }]
    );
    assert_eq!(m.lifecycle(), Lifecycle::Active);
    assert_eq!(m.held(), Some((BuildId(1), &A)));
    assert_eq!(m.in_flight(), None);
}

#[test]
fn stale_build_is_never_published() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(SetTarget(Some(B)));
    assert_eq!(
        step(&mut m, BuildSucceeded(BuildId(1))),
        vec![Discard { build: BuildId(1) }]
    );
    assert_eq!(m.in_flight(), Some((BuildId(2), &B)));
    assert_eq!(m.lifecycle(), Lifecycle::Pending);
}

#[test]
fn rule5_cancelled_build_success_is_discarded() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(SetTarget(None));
    assert_eq!(
        step(&mut m, BuildSucceeded(BuildId(1))),
        vec![Discard { build: BuildId(1) }]
    );
    assert_eq!(m.held(), None);
}

#[test]
fn rule5_repeated_success_is_discarded() {
    let mut m = active_on_a();
    let before = m.clone();
    assert_eq!(
        step(&mut m, BuildSucceeded(BuildId(1))),
        vec![Discard { build: BuildId(1) }]
    );
    assert_eq!(m, before);
}

#[test]
fn rule5_unknown_build_success_is_discarded() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let before = m.clone();
    assert_eq!(
        step(&mut m, BuildSucceeded(BuildId(99))),
        vec![Discard { build: BuildId(99) }]
    );
    assert_eq!(m, before);
}

#[test]
fn rule5_same_target_aba_does_not_publish_the_older_build() {
    // a (#1), b (#2), a again (#3): the late result of #1 is for the right target but stale.
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(SetTarget(Some(B)));
    let _ = m.handle(SetTarget(Some(A)));
    assert_eq!(
        step(&mut m, BuildSucceeded(BuildId(1))),
        vec![Discard { build: BuildId(1) }]
    );
    assert_eq!(m.in_flight(), Some((BuildId(3), &A)));
}

// ---- rule 6: build failure ----

#[test]
fn rule6_failure_schedules_retry_with_doubling_capped_delay() {
    let policy = RetryPolicy {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(5),
    };
    let mut m = Machine::new(policy);
    let _ = m.handle(SetTarget(Some(A)));
    let mut delays = Vec::new();
    for attempt in 1..=5u32 {
        let failed = m.in_flight().expect("a build in flight").0;
        let out = step(&mut m, BuildFailed(failed));
        match out.as_slice() {
            [ScheduleRetry {
                after,
                delay,
                attempt: a,
            }] => {
                assert_eq!((*after, *a), (failed, attempt));
                delays.push(delay.as_secs());
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(m.lifecycle(), Lifecycle::Pending);
        assert_eq!(m.failures(), attempt);
        let _ = m.handle(RetryElapsed(failed));
    }
    assert_eq!(delays, vec![1, 2, 4, 5, 5]);
}

#[test]
fn rule6_failure_of_a_stale_build_is_ignored() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(SetTarget(Some(B)));
    let before = m.clone();
    assert!(step(&mut m, BuildFailed(BuildId(1))).is_empty());
    assert_eq!(m, before);
}

#[test]
fn rule6_fixed_policy_is_flat() {
    let p = RetryPolicy::fixed(Duration::from_secs(1));
    assert!((1..40).all(|n| p.delay(n) == Duration::from_secs(1)));
}

#[test]
fn rule6_delay_saturates_instead_of_overflowing() {
    let p = RetryPolicy {
        initial: Duration::from_secs(u64::MAX / 2),
        max: Duration::MAX,
    };
    assert_eq!(p.delay(u32::MAX), Duration::MAX);
    assert_eq!(RetryPolicy::default().delay(1000), Duration::from_secs(30));
}

// ---- rule 7: retry timer ----

#[test]
fn rule7_retry_elapsed_starts_a_fresh_build_for_the_desired_target() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(BuildFailed(BuildId(1)));
    assert_eq!(
        step(&mut m, RetryElapsed(BuildId(1))),
        vec![StartBuild {
            build: BuildId(2),
            target: A
        }]
    );
    assert_eq!(m.retry_armed(), None);
    assert_eq!(m.failures(), 1, "failures count until a success");
}

#[test]
fn rule7_unknown_or_cancelled_retry_is_ignored() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(BuildFailed(BuildId(1)));
    assert!(step(&mut m, RetryElapsed(BuildId(7))).is_empty());
    let _ = m.handle(SetTarget(None)); // cancels the retry
    let before = m.clone();
    assert!(step(&mut m, RetryElapsed(BuildId(1))).is_empty());
    assert_eq!(m, before);
}

#[test]
fn rule7_success_after_retry_resets_failures() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(BuildFailed(BuildId(1)));
    let _ = m.handle(RetryElapsed(BuildId(1)));
    let _ = m.handle(BuildSucceeded(BuildId(2)));
    assert_eq!(m.failures(), 0);
    assert_eq!(m.lifecycle(), Lifecycle::Active);
}

// ---- rule 8: shutdown ----

#[test]
fn rule8_shutdown_cancels_and_retires() {
    let mut m = active_on_a();
    let _ = m.handle(SetTarget(None));
    let _ = m.handle(SetTarget(Some(B))); // retire #1, build #2
    let _ = m.handle(BuildSucceeded(BuildId(2)));
    let _ = m.handle(SetTarget(None)); // keeps #2 held
    assert_eq!(step(&mut m, Shutdown), vec![Retire { build: BuildId(2) }]);
    assert_eq!(m.lifecycle(), Lifecycle::Unavailable);
    assert!(m.is_shut_down());
    assert_eq!(m.held(), None);
}

#[test]
fn rule8_shutdown_mid_build_cancels_it() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    assert_eq!(
        step(&mut m, Shutdown),
        vec![CancelBuild { build: BuildId(1) }]
    );
}

#[test]
fn rule8_after_shutdown_only_success_is_answered_with_discard() {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(Shutdown);
    let before = m.clone();
    assert!(step(&mut m, SetTarget(Some(B))).is_empty());
    assert!(step(&mut m, BuildFailed(BuildId(1))).is_empty());
    assert!(step(&mut m, RetryElapsed(BuildId(1))).is_empty());
    assert!(step(&mut m, Shutdown).is_empty());
    assert_eq!(
        step(&mut m, BuildSucceeded(BuildId(1))),
        vec![Discard { build: BuildId(1) }]
    );
    assert_eq!(m, before);
    assert_eq!(m.lifecycle(), Lifecycle::Unavailable);
}

#[test]
fn rule8_shutdown_of_a_fresh_machine_is_unavailable() {
    let mut m = machine();
    assert!(step(&mut m, Shutdown).is_empty());
    assert_eq!(m.lifecycle(), Lifecycle::Unavailable);
}

// ---- actions order ----

#[test]
fn actions_come_out_cancellations_then_retirements_then_starts() {
    // A cancellation and a retirement never share a batch (I2: a build in flight means nothing
    // is held), so the order shows as cancel-before-start and retire-before-start.
    let mut m = active_on_a();
    assert_eq!(
        step(&mut m, SetTarget(Some(B))),
        vec![
            Retire { build: BuildId(1) },
            StartBuild {
                build: BuildId(2),
                target: B
            }
        ]
    );
    assert_eq!(
        step(&mut m, SetTarget(Some("c"))),
        vec![
            CancelBuild { build: BuildId(2) },
            StartBuild {
                build: BuildId(3),
                target: "c"
            }
        ]
    );
}

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
fn display_renders_traces() {
    let a: Action<&str> = ScheduleRetry {
        after: BuildId(3),
        delay: Duration::from_secs(2),
        attempt: 2,
    };
    assert_eq!(a.to_string(), "retry after #3 in 2s (attempt 2)");
    assert_eq!(Lifecycle::Active.to_string(), "active");
}

#[test]
fn rule6_delay_keeps_doubling_past_32_attempts() {
    // Found by the machine_inputs fuzz target: the factor used to saturate at 2^32 - 1.
    let p = RetryPolicy {
        initial: Duration::from_nanos(1),
        max: Duration::from_secs(1000),
    };
    assert_eq!(p.delay(33), Duration::from_nanos(1 << 32));
    assert_eq!(p.delay(34), Duration::from_nanos(1 << 33));
    assert_eq!(p.delay(200), Duration::from_secs(1000));
    assert_eq!(RetryPolicy::fixed(Duration::ZERO).delay(5), Duration::ZERO);
}

#[test]
fn policy_returns_the_policy_the_machine_was_built_with() {
    let policy = RetryPolicy {
        initial: Duration::from_millis(3),
        max: Duration::from_millis(70),
    };
    assert_ne!(policy, RetryPolicy::default());
    assert_eq!(Machine::<&str>::new(policy).policy(), policy);
    assert_eq!(machine().policy(), RetryPolicy::default());
}

#[test]
fn lifecycles_and_build_ids_render_as_trace_labels() {
    assert_eq!(Lifecycle::Pending.to_string(), "pending");
    assert_eq!(Lifecycle::Active.to_string(), "active");
    assert_eq!(Lifecycle::Unavailable.to_string(), "unavailable");
    assert_eq!(BuildId(42).to_string(), "#42");
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
