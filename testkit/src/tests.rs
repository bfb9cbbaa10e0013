//! Self-checks of the testkit: the pieces other checks rely on.

use std::time::Duration;

use crate::branches::{Branch, BranchSet};
use crate::health_fuzz::{
    run_health_script, run_health_script_with, HealthScript, HealthStep, IdPick as HealthPick,
};
use crate::machine_fuzz::{
    run_script, Checks, IdPick, MachineScript, PolicySeed, Step, TargetPick,
};
use crate::mutants::{HealthMutant, HealthMutation, Mutant, Mutation};
use crate::reference::{documented_delay, MachineView};
use prefill_router::health::FailureClass;
use prefill_router::lifecycle::{BuildId, Machine, RetryPolicy};

#[test]
fn branch_list_matches_the_enum_order() {
    // BranchSet indexes counters by discriminant; ALL must list them in that order.
    for (i, b) in Branch::ALL.iter().enumerate() {
        assert_eq!(*b as usize, i, "{b:?}");
    }
}

#[test]
fn documented_delay_doubles_exactly_and_caps() {
    let p = RetryPolicy {
        initial: Duration::from_millis(100),
        max: Duration::from_millis(800),
    };
    let got: Vec<_> = (1..=5)
        .map(|a| documented_delay(p, a).as_millis())
        .collect();
    assert_eq!(got, vec![100, 200, 400, 800, 800]);
    let huge = RetryPolicy {
        initial: Duration::from_nanos(1),
        max: Duration::MAX,
    };
    assert_eq!(documented_delay(huge, 40), Duration::from_nanos(1 << 39));
    assert_eq!(documented_delay(huge, u32::MAX), Duration::MAX);
}

/// For every generated policy (caps up to 2^47 times the first delay) the machine's backoff must
/// equal the documented formula for any attempt.
#[test]
fn generated_policies_stay_where_the_machine_follows_its_documented_backoff() {
    let seeds = [
        PolicySeed::Default,
        PolicySeed::Fixed { delay_ms: 0 },
        PolicySeed::Fixed { delay_ms: u16::MAX },
        PolicySeed::Backoff {
            initial_ms: 1,
            doublings: 30,
        },
        PolicySeed::Backoff {
            initial_ms: u16::MAX,
            doublings: 255,
        },
        PolicySeed::Backoff {
            initial_ms: 7,
            doublings: 61,
        },
        PolicySeed::Backoff {
            initial_ms: 1,
            doublings: 47,
        },
    ];
    for seed in seeds {
        let p = seed.policy();
        for attempt in 1..=200 {
            assert_eq!(
                p.delay(attempt),
                documented_delay(p, attempt),
                "{seed:?} attempt {attempt}"
            );
        }
    }
}

#[test]
fn id_picks_resolve_relative_to_the_state() {
    let mut m = Machine::new(RetryPolicy::default());
    let _ = m.handle(prefill_router::lifecycle::Input::SetTarget(Some(2u8)));
    let _ = m.handle(prefill_router::lifecycle::Input::SetTarget(Some(3u8)));
    let view = MachineView::of(&m);
    assert_eq!(view.in_flight, Some((BuildId(2), 3)));
    let resolve = |pick| match Step::Succeed(pick).resolve(&view) {
        prefill_router::lifecycle::Input::BuildSucceeded(b) => b.0,
        other => panic!("{other:?}"),
    };
    assert_eq!(resolve(IdPick::InFlight), 2);
    assert_eq!(resolve(IdPick::Latest), 2);
    assert_eq!(resolve(IdPick::Older(0)), 1);
    assert_eq!(resolve(IdPick::Older(9)), 0);
    assert_eq!(resolve(IdPick::Unknown(0)), 3);
    assert_eq!(resolve(IdPick::RetryArmed), 2);
    assert_eq!(
        Step::SetTarget(Some(TargetPick::Other(9))).resolve(&view),
        prefill_router::lifecycle::Input::SetTarget(Some(1))
    );
}

/// A hand-written script through every mutant: each check alone must reject each mutant.
#[test]
fn a_short_story_catches_every_mutant_with_each_check_alone() {
    use IdPick::*;
    let script = MachineScript {
        policy: PolicySeed::Default,
        steps: vec![
            Step::SetTarget(Some(TargetPick::Other(1))),
            Step::Succeed(Older(0)), // stale (#0): discarded
            Step::Succeed(InFlight), // published
            Step::SetTarget(Some(TargetPick::Other(2))), // retires #1, starts #2
            Step::SetTarget(Some(TargetPick::Other(3))), // cancels #2, starts #3
            Step::Succeed(InFlight),
            Step::Shutdown,
        ],
    };
    let mut branches = BranchSet::default();
    run_script(&script, Machine::new, Checks::ALL, &mut branches).expect("the real machine passes");
    for mutation in Mutation::ALL {
        for (reference, invariants) in [(true, false), (false, true)] {
            let checks = Checks {
                reference,
                invariants,
            };
            let result = run_script(
                &script,
                |p| Mutant::new(mutation, p),
                checks,
                &mut BranchSet::default(),
            );
            assert!(result.is_err(), "{mutation:?} passes with {checks:?}");
        }
    }
}

fn class_index(class: FailureClass) -> u8 {
    FailureClass::ALL.iter().position(|c| *c == class).unwrap() as u8
}

/// Each kept health mutant breaks one rule the ledger states, on a script the real machine
/// passes: the ledger can fail, and fails for each bug it is meant to see.
#[test]
fn the_ledger_catches_every_health_mutant() {
    use HealthPick::*;
    use HealthStep::*;
    let refused = class_index(FailureClass::ConnectionRefused);
    let script = |steps: Vec<HealthStep>| HealthScript {
        initial_ms: 100,
        max_ms: 150,
        seed: 7,
        steps,
    };
    for mutation in HealthMutation::ALL {
        let (steps, rule) = match mutation {
            HealthMutation::OverloadOpens => (
                vec![Add(0), Fail(0, class_index(FailureClass::Overloaded))],
                "without a counting failure",
            ),
            HealthMutation::StaleProbeCloses => (
                vec![
                    Add(0),
                    Fail(0, refused),
                    Fire(0, Current),
                    Answer(0, Current, false),
                    Fire(0, Current),
                    Answer(0, Older(1), true),
                ],
                "without a successful current probe",
            ),
            HealthMutation::Uncapped => (
                vec![
                    Add(0),
                    Fail(0, refused),
                    Fire(0, Current),
                    Answer(0, Current, false),
                ],
                "above the cap",
            ),
        };
        let script = script(steps);
        run_health_script(&script).unwrap_or_else(|e| panic!("real machine, {mutation:?}: {e}"));
        let caught = run_health_script_with(&script, |policy, seed| {
            HealthMutant::new(mutation, policy, seed)
        });
        match caught {
            Err(e) => assert!(
                e.contains(rule),
                "{mutation:?} caught for another reason: {e}"
            ),
            Ok(()) => panic!("{mutation:?} passed the ledger"),
        }
    }
}
