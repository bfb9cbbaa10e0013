//! Random input sequences against a reference written independently: a map of instance to
//! a small state, plus the invariants the request path relies on.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

const NAMES: [&str; 3] = ["a", "b", "c"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ref {
    Healthy,
    Waiting { failures: u32, timer: u64 },
    Probing { failures: u32, probe: u64 },
}

/// An abstract input; ids are picked from what the machine issued, so most are current.
#[derive(Clone, Debug)]
enum Op {
    Add(usize),
    Remove(usize),
    Fail(usize, usize),
    Fire(usize, u8),
    Probe(usize, u8, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..3usize).prop_map(Op::Add),
        1 => (0..3usize).prop_map(Op::Remove),
        4 => (0..3usize, 0..6usize).prop_map(|(i, c)| Op::Fail(i, c)),
        3 => (0..3usize, any::<u8>()).prop_map(|(i, k)| Op::Fire(i, k)),
        3 => (0..3usize, any::<u8>(), any::<bool>()).prop_map(|(i, k, ok)| Op::Probe(i, k, ok)),
    ]
}

/// An id for instance `i`: mostly its current one, else a recent or an unknown one.
fn pick(current: Option<u64>, issued: u64, k: u8) -> u64 {
    match (k % 4, current) {
        (0 | 1, Some(c)) => c,
        (2, _) => issued.saturating_sub(u64::from(k >> 2) % 4),
        _ => issued + 1 + u64::from(k),
    }
}

fn check(
    m: &Machine<&'static str>,
    reference: &BTreeMap<&'static str, Ref>,
) -> Result<(), TestCaseError> {
    for name in NAMES {
        let want = reference.get(name).map(|r| match *r {
            Ref::Healthy => Breaker::Closed,
            Ref::Waiting { failures, timer } => Breaker::Open {
                failures,
                timer: TimerId(timer),
            },
            Ref::Probing { failures, probe } => Breaker::Probing {
                failures,
                probe: ProbeId(probe),
            },
        });
        prop_assert_eq!(m.breaker(&name), want);
        prop_assert_eq!(
            m.is_routable(&name),
            reference.get(name) == Some(&Ref::Healthy)
        );
    }
    let open = reference.values().filter(|r| **r != Ref::Healthy).count();
    prop_assert_eq!(m.open_count(), open);
    prop_assert_eq!(m.len(), reference.len());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn machine_agrees_with_the_reference(ops in prop::collection::vec(op(), 0..80), seed in any::<u64>()) {
        let p = policy();
        let mut m = Machine::new(p, seed);
        let mut reference: BTreeMap<&'static str, Ref> = BTreeMap::new();
        let mut issued = 0u64;
        for op in ops {
            let (input, expected): (Input<&'static str>, Vec<Action<&'static str>>) = match op {
                Op::Add(i) => {
                    reference.entry(NAMES[i]).or_insert(Ref::Healthy);
                    (Added(NAMES[i]), vec![])
                }
                Op::Remove(i) => {
                    let expected = match reference.remove(NAMES[i]) {
                        Some(Ref::Waiting { timer, .. }) => vec![CancelTimer { instance: NAMES[i], timer: TimerId(timer) }],
                        _ => vec![],
                    };
                    (Removed(NAMES[i]), expected)
                }
                Op::Fail(i, c) => {
                    let class = FailureClass::ALL[c];
                    let mut expected = vec![];
                    if class.counts_against_health() && reference.get(NAMES[i]) == Some(&Ref::Healthy) {
                        issued += 1;
                        reference.insert(NAMES[i], Ref::Waiting { failures: 1, timer: issued });
                        expected.push(Open { instance: NAMES[i] });
                        expected.push(ArmTimer { instance: NAMES[i], timer: TimerId(issued), delay: p.delay(1, mix(seed ^ issued)), attempt: 1 });
                    }
                    (Failed { instance: NAMES[i], class }, expected)
                }
                Op::Fire(i, k) => {
                    let current = match reference.get(NAMES[i]) { Some(Ref::Waiting { timer, .. }) => Some(*timer), _ => None };
                    let timer = pick(current, issued, k);
                    let mut expected = vec![];
                    if let Some(Ref::Waiting { failures, timer: t }) = reference.get(NAMES[i]).copied() {
                        if t == timer {
                            issued += 1;
                            reference.insert(NAMES[i], Ref::Probing { failures, probe: issued });
                            expected.push(StartProbe { instance: NAMES[i], probe: ProbeId(issued) });
                        }
                    }
                    (TimerFired { instance: NAMES[i], timer: TimerId(timer) }, expected)
                }
                Op::Probe(i, k, ok) => {
                    let current = match reference.get(NAMES[i]) { Some(Ref::Probing { probe, .. }) => Some(*probe), _ => None };
                    let probe = pick(current, issued, k);
                    let mut expected = vec![];
                    if let Some(Ref::Probing { failures, probe: q }) = reference.get(NAMES[i]).copied() {
                        if q == probe {
                            if ok {
                                reference.insert(NAMES[i], Ref::Healthy);
                                expected.push(Close { instance: NAMES[i] });
                            } else {
                                issued += 1;
                                reference.insert(NAMES[i], Ref::Waiting { failures: failures + 1, timer: issued });
                                expected.push(ArmTimer { instance: NAMES[i], timer: TimerId(issued), delay: p.delay(failures + 1, mix(seed ^ issued)), attempt: failures + 1 });
                            }
                        }
                    }
                    (ProbeResult { instance: NAMES[i], probe: ProbeId(probe), ok }, expected)
                }
            };
            let out = m.handle(input).to_vec();
            prop_assert_eq!(&out, &expected);
            for action in &out {
                if let ArmTimer { delay, .. } = action {
                    prop_assert!(*delay <= p.max, "delay {:?} above the cap", delay);
                }
            }
            prop_assert_eq!(m.next_id(), issued + 1);
            check(&m, &reference)?;
        }
    }

    #[test]
    fn a_poisoned_request_replayed_any_number_of_times_cannot_empty_the_routable_set(
        replays in prop::collection::vec((0..3usize, 0..3usize), 0..300),
        blips in prop::collection::vec(0..3usize, 0..2),
    ) {
        // The pool: three instances; at most two genuinely fail (blips), so one stays up.
        let non_counting: Vec<FailureClass> =
            FailureClass::ALL.into_iter().filter(|c| !c.counts_against_health()).collect();
        let mut m = Machine::new(policy(), 9);
        for name in NAMES {
            let _ = m.handle(Added(name));
        }
        for i in &blips {
            let _ = m.handle(Failed { instance: NAMES[*i], class: FailureClass::StreamDead });
        }
        let blipped: std::collections::BTreeSet<usize> = blips.iter().copied().collect();
        for (i, c) in replays {
            let out = m.handle(Failed { instance: NAMES[i], class: non_counting[c] });
            prop_assert!(out.is_empty());
            let routable = NAMES.iter().filter(|n| m.is_routable(n)).count();
            prop_assert_eq!(routable, 3 - blipped.len());
            prop_assert!(routable > 0);
        }
    }

    #[test]
    fn every_delay_stays_within_the_cap(initial in 0u64..10_000_000_000, max in 0u64..100_000_000_000, attempt in any::<u32>(), jitter in any::<u64>()) {
        let p = BackoffPolicy { initial: Duration::from_nanos(initial), max: Duration::from_nanos(max) };
        let d = p.delay(attempt, jitter);
        prop_assert!(d <= p.max);
        prop_assert!(d <= p.base(attempt) && d >= p.base(attempt) / 2);
    }
}
