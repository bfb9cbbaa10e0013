//! The health machine's unit tests, one per transition and named after the property each
//! guards, then a proptest against a reference model written independently here.

use super::*;
use Action::*;
use Input::*;

const A: &str = "a";
const B: &str = "b";

fn policy() -> BackoffPolicy {
    BackoffPolicy {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(8),
    }
}

fn machine() -> Machine<&'static str> {
    Machine::new(policy(), 42)
}

fn step(m: &mut Machine<&'static str>, input: Input<&'static str>) -> Vec<Action<&'static str>> {
    m.handle(input).to_vec()
}

fn fail(m: &mut Machine<&'static str>, instance: &'static str) -> Vec<Action<&'static str>> {
    step(
        m,
        Failed {
            instance,
            class: FailureClass::ConnectionRefused,
        },
    )
}

fn timer_of(actions: &[Action<&'static str>]) -> TimerId {
    match actions.last() {
        Some(ArmTimer { timer, .. }) => *timer,
        other => panic!("expected an armed timer last, got {other:?}"),
    }
}

fn probe_of(actions: &[Action<&'static str>]) -> ProbeId {
    match actions {
        [StartProbe { probe, .. }] => *probe,
        other => panic!("expected one started probe, got {other:?}"),
    }
}

/// A machine with `A` and `B` in discovery and `A`'s breaker open (timer returned).
fn open_on_a() -> (Machine<&'static str>, TimerId) {
    let mut m = machine();
    let _ = m.handle(Added(A));
    let _ = m.handle(Added(B));
    let out = fail(&mut m, A);
    let timer = timer_of(&out);
    (m, timer)
}

/// As [`open_on_a`], with the timer fired and the probe under way (probe returned).
fn probing_a() -> (Machine<&'static str>, ProbeId) {
    let (mut m, timer) = open_on_a();
    let probe = probe_of(&step(&mut m, TimerFired { instance: A, timer }));
    (m, probe)
}

#[test]
fn only_connection_level_failures_count_against_health() {
    use FailureClass::*;
    for class in FailureClass::ALL {
        let expected = matches!(class, ConnectionRefused | ConnectionReset | StreamDead);
        assert_eq!(class.counts_against_health(), expected, "{class}");
    }
}

#[test]
fn only_a_gone_or_busy_worker_is_retried_elsewhere() {
    use FailureClass::*;
    for class in FailureClass::ALL {
        let expected = matches!(
            class,
            ConnectionRefused | ConnectionReset | StreamDead | Overloaded
        );
        assert_eq!(class.retry_elsewhere(), expected, "{class}");
    }
}

#[test]
fn failure_class_labels_are_distinct_snake_case() {
    let labels: std::collections::BTreeSet<&str> =
        FailureClass::ALL.iter().map(|c| c.as_str()).collect();
    assert_eq!(labels.len(), FailureClass::ALL.len());
    assert_eq!(
        FailureClass::ConnectionRefused.as_str(),
        "connection_refused"
    );
    assert_eq!(FailureClass::ConnectionReset.as_str(), "connection_reset");
    assert_eq!(FailureClass::StreamDead.as_str(), "stream_dead");
    assert_eq!(FailureClass::Rejected.as_str(), "rejected");
    assert_eq!(FailureClass::Deadline.as_str(), "deadline");
    assert_eq!(FailureClass::Overloaded.as_str(), "overloaded");
}

#[test]
fn an_added_instance_starts_healthy_and_routable() {
    let mut m = machine();
    assert!(step(&mut m, Added(A)).is_empty());
    assert!(m.is_routable(&A));
    assert_eq!(m.breaker(&A), Some(Breaker::Closed));
    assert_eq!((m.len(), m.open_count(), m.is_empty()), (1, 0, false));
}

#[test]
fn an_instance_not_in_discovery_is_never_routable() {
    let mut m = machine();
    assert!(!m.is_routable(&A));
    assert!(m.is_empty());
    // A failure of an unknown instance tracks nothing (bounded memory) and orders nothing.
    assert!(fail(&mut m, A).is_empty());
    assert_eq!((m.len(), m.breaker(&A), m.open_count()), (0, None, 0));
    assert!(!m.is_routable(&A));
}

#[test]
fn a_counting_failure_opens_the_breaker_and_arms_a_capped_timer() {
    let mut m = machine();
    let _ = m.handle(Added(A));
    let _ = m.handle(Added(B));
    let out = fail(&mut m, A);
    let timer = TimerId(1);
    let delay = policy().delay(1, mix(42 ^ 1));
    assert_eq!(
        out,
        vec![
            Open { instance: A },
            ArmTimer {
                instance: A,
                timer,
                delay,
                attempt: 1
            }
        ]
    );
    assert!(delay <= Duration::from_secs(1) && delay >= Duration::from_millis(500));
    assert!(!m.is_routable(&A));
    assert!(
        m.is_routable(&B),
        "one instance's failure leaves the others alone"
    );
    assert_eq!(m.breaker(&A), Some(Breaker::Open { failures: 1, timer }));
    assert_eq!(m.open_count(), 1);
    assert_eq!(m.next_id(), 2);
}

#[test]
fn non_counting_failures_never_open_a_breaker() {
    let mut m = machine();
    let _ = m.handle(Added(A));
    for class in FailureClass::ALL
        .into_iter()
        .filter(|c| !c.counts_against_health())
    {
        for _ in 0..100 {
            assert!(step(&mut m, Failed { instance: A, class }).is_empty());
        }
    }
    assert!(m.is_routable(&A));
    assert_eq!(m.open_count(), 0);
}

#[test]
fn failures_while_open_or_probing_do_not_lengthen_the_backoff() {
    let (mut m, timer) = open_on_a();
    assert!(fail(&mut m, A).is_empty());
    assert_eq!(m.breaker(&A), Some(Breaker::Open { failures: 1, timer }));
    let probe = probe_of(&step(&mut m, TimerFired { instance: A, timer }));
    assert!(fail(&mut m, A).is_empty());
    assert_eq!(m.breaker(&A), Some(Breaker::Probing { failures: 1, probe }));
    assert_eq!(m.open_count(), 1);
}

#[test]
fn the_current_timer_starts_a_probe() {
    let (mut m, timer) = open_on_a();
    let out = step(&mut m, TimerFired { instance: A, timer });
    let probe = ProbeId(2);
    assert_eq!(out, vec![StartProbe { instance: A, probe }]);
    assert_eq!(m.breaker(&A), Some(Breaker::Probing { failures: 1, probe }));
    assert!(!m.is_routable(&A), "half-open is not routable");
    assert_eq!(m.open_count(), 1);
}

#[test]
fn a_stale_or_foreign_timer_is_ignored() {
    let (mut m, timer) = open_on_a();
    let stale = TimerId(timer.0 + 7);
    assert!(step(
        &mut m,
        TimerFired {
            instance: A,
            timer: stale
        }
    )
    .is_empty());
    // The right id for another instance, or for an unknown one, is not this timer.
    assert!(step(&mut m, TimerFired { instance: B, timer }).is_empty());
    assert!(step(
        &mut m,
        TimerFired {
            instance: "c",
            timer
        }
    )
    .is_empty());
    assert_eq!(m.breaker(&A), Some(Breaker::Open { failures: 1, timer }));
    assert_eq!(m.breaker(&B), Some(Breaker::Closed));
    // A repeated firing once probing starts no second probe.
    let _ = step(&mut m, TimerFired { instance: A, timer });
    assert!(step(&mut m, TimerFired { instance: A, timer }).is_empty());
}

#[test]
fn a_successful_probe_closes_the_breaker() {
    let (mut m, probe) = probing_a();
    let out = step(
        &mut m,
        ProbeResult {
            instance: A,
            probe,
            ok: true,
        },
    );
    assert_eq!(out, vec![Close { instance: A }]);
    assert!(m.is_routable(&A));
    assert_eq!(m.open_count(), 0);
    // The backoff restarts from the first step after a close.
    let out = fail(&mut m, A);
    assert!(matches!(out[1], ArmTimer { attempt: 1, .. }), "{out:?}");
}

#[test]
fn a_failed_probe_rearms_with_a_longer_delay_up_to_the_cap() {
    let (mut m, mut probe) = probing_a();
    for attempt in 2..=12u32 {
        let out = step(
            &mut m,
            ProbeResult {
                instance: A,
                probe,
                ok: false,
            },
        );
        let timer = TimerId(m.next_id() - 1);
        match out.as_slice() {
            [ArmTimer {
                instance: A,
                timer: t,
                delay,
                attempt: a,
            }] => {
                assert_eq!((*t, *a), (timer, attempt));
                assert!(*delay <= policy().max, "attempt {attempt}: {delay:?}");
                assert!(*delay >= policy().base(attempt) / 2, "{delay:?}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            m.breaker(&A),
            Some(Breaker::Open {
                failures: attempt,
                timer
            })
        );
        probe = probe_of(&step(&mut m, TimerFired { instance: A, timer }));
    }
    assert_eq!(m.open_count(), 1);
}

#[test]
fn a_stale_probe_result_is_ignored() {
    let (mut m, probe) = probing_a();
    for ok in [true, false] {
        let stale = ProbeId(probe.0 + 1);
        assert!(step(
            &mut m,
            ProbeResult {
                instance: A,
                probe: stale,
                ok
            }
        )
        .is_empty());
        assert!(step(
            &mut m,
            ProbeResult {
                instance: B,
                probe,
                ok
            }
        )
        .is_empty());
    }
    assert_eq!(m.breaker(&A), Some(Breaker::Probing { failures: 1, probe }));
    assert!(m.is_routable(&B));
    // A result for an open (not probing) breaker is stale too.
    let (mut m, timer) = open_on_a();
    let guess = ProbeId(timer.0);
    assert!(step(
        &mut m,
        ProbeResult {
            instance: A,
            probe: guess,
            ok: true
        }
    )
    .is_empty());
    assert!(!m.is_routable(&A));
}

#[test]
fn removed_forgets_an_open_instance_and_cancels_its_timer() {
    let (mut m, timer) = open_on_a();
    assert_eq!(
        step(&mut m, Removed(A)),
        vec![CancelTimer { instance: A, timer }]
    );
    assert_eq!((m.breaker(&A), m.len(), m.open_count()), (None, 1, 0));
    assert!(!m.is_routable(&A));
    // The cancelled timer, fired late anyway, is ignored.
    assert!(step(&mut m, TimerFired { instance: A, timer }).is_empty());
    assert_eq!(m.len(), 1);
}

#[test]
fn removed_forgets_a_probing_instance_and_its_late_result() {
    let (mut m, probe) = probing_a();
    assert!(step(&mut m, Removed(A)).is_empty());
    assert_eq!((m.breaker(&A), m.open_count()), (None, 0));
    assert!(step(
        &mut m,
        ProbeResult {
            instance: A,
            probe,
            ok: true
        }
    )
    .is_empty());
    assert!(
        !m.is_routable(&A),
        "a late probe result cannot re-add an instance"
    );
}

#[test]
fn removed_forgets_a_healthy_instance() {
    let mut m = machine();
    let _ = m.handle(Added(A));
    assert!(step(&mut m, Removed(A)).is_empty());
    assert!(!m.is_routable(&A));
    assert!(m.is_empty());
    // Removing an unknown instance is a no-op.
    assert!(step(&mut m, Removed(B)).is_empty());
}

#[test]
fn re_added_instance_starts_healthy_and_ignores_its_old_probe() {
    let (mut m, probe) = probing_a();
    let _ = m.handle(Removed(A));
    assert!(step(&mut m, Added(A)).is_empty());
    assert!(m.is_routable(&A));
    // The previous incarnation's probe failing cannot open the new one.
    assert!(step(
        &mut m,
        ProbeResult {
            instance: A,
            probe,
            ok: false
        }
    )
    .is_empty());
    assert!(m.is_routable(&A));
    assert_eq!(m.open_count(), 0);
}

#[test]
fn a_repeated_added_keeps_the_breaker() {
    let (mut m, timer) = open_on_a();
    assert!(step(&mut m, Added(A)).is_empty());
    assert_eq!(m.breaker(&A), Some(Breaker::Open { failures: 1, timer }));
    assert_eq!(m.open_count(), 1);
}

#[test]
fn accessors_report_every_instance_in_order() {
    let (m, timer) = open_on_a();
    let all: Vec<_> = m.instances().map(|(i, b)| (*i, b)).collect();
    assert_eq!(
        all,
        vec![
            (A, Breaker::Open { failures: 1, timer }),
            (B, Breaker::Closed)
        ]
    );
    assert_eq!(m.policy(), policy());
    assert_eq!(Breaker::Closed.to_string(), "healthy");
    assert_eq!(Breaker::Open { failures: 1, timer }.to_string(), "open");
    assert_eq!(
        Breaker::Probing {
            failures: 1,
            probe: ProbeId(2)
        }
        .to_string(),
        "probing"
    );
}

#[test]
fn actions_and_classes_read_well() {
    let shown: Vec<String> = [
        Open { instance: A },
        Close { instance: A },
        ArmTimer {
            instance: A,
            timer: TimerId(3),
            delay: Duration::from_secs(1),
            attempt: 2,
        },
        CancelTimer {
            instance: A,
            timer: TimerId(3),
        },
        StartProbe {
            instance: A,
            probe: ProbeId(4),
        },
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    assert_eq!(
        shown,
        vec![
            "open breaker of \"a\"",
            "close breaker of \"a\"",
            "arm timer #3 for \"a\" in 1s (attempt 2)",
            "cancel timer #3 for \"a\"",
            "start probe #4 of \"a\"",
        ]
    );
    let classes: Vec<String> = FailureClass::ALL.iter().map(ToString::to_string).collect();
    assert_eq!(
        classes,
        vec![
            "connection refused",
            "connection reset",
            "dead stream",
            "rejected request",
            "client deadline",
            "overloaded"
        ]
    );
}

#[test]
fn backoff_base_doubles_then_stays_at_the_cap() {
    let p = policy();
    let secs: Vec<u64> = (1..=6).map(|a| p.base(a).as_secs()).collect();
    assert_eq!(secs, vec![1, 2, 4, 8, 8, 8]);
    assert_eq!(
        p.base(0),
        Duration::from_secs(1),
        "attempt 0 reads as the first"
    );
    // Huge attempts saturate at the cap instead of overflowing.
    assert_eq!(p.base(u32::MAX), p.max);
    let odd = BackoffPolicy {
        initial: Duration::from_nanos(3),
        max: Duration::MAX,
    };
    assert_eq!(odd.base(3), Duration::from_nanos(12));
    assert_eq!(odd.base(200), Duration::MAX);
    let zero = BackoffPolicy {
        initial: Duration::ZERO,
        max: Duration::from_secs(1),
    };
    assert_eq!(zero.base(5), Duration::ZERO);
}

#[test]
fn jitter_stays_within_half_the_base_and_the_cap() {
    let p = policy();
    for attempt in 1..=6 {
        let base = p.base(attempt);
        assert_eq!(p.delay(attempt, 0), base, "no jitter is the base");
        // The largest jitter takes off just under half.
        let least = p.delay(attempt, u64::MAX);
        assert!(least >= base / 2 && least < base, "{least:?} vs {base:?}");
        // Only the low 32 bits count.
        assert_eq!(p.delay(attempt, 1 << 32), base);
        assert_eq!(
            p.delay(attempt, 1 << 31),
            base - base / 4,
            "mid jitter is three quarters"
        );
    }
    let huge = BackoffPolicy {
        initial: Duration::MAX,
        max: Duration::MAX,
    };
    assert!(huge.delay(1, u64::MAX) <= Duration::MAX);
}

#[test]
fn jitter_is_deterministic_per_seed_and_differs_across_seeds() {
    let run = |seed| {
        let mut m = Machine::new(policy(), seed);
        let _ = m.handle(Added(A));
        fail(&mut m, A)
    };
    assert_eq!(run(1), run(1));
    let delays: std::collections::BTreeSet<Duration> = (0..16)
        .map(|seed| match run(seed)[1] {
            ArmTimer { delay, .. } => delay,
            _ => unreachable!(),
        })
        .collect();
    assert!(delays.len() > 8, "jitter spreads: {delays:?}");
    assert_eq!(mix(0), 0xe220_a839_7b1d_cdaf, "SplitMix64's first output");
}

mod proptests;

#[test]
fn only_a_refused_connection_proves_a_request_unsent() {
    for class in FailureClass::ALL {
        assert_eq!(
            class.request_unsent(),
            class == FailureClass::ConnectionRefused,
            "{class}"
        );
    }
}
