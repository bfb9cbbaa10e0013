//! One test per transition row: rules 1-8 of docs/design.md, and the order of a batch.

use super::*;

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
