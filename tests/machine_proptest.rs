//! Property-based state-machine test: random input sequences (stale, repeated and unknown
//! BuildIds included) drive the real `Machine` and a small reference model written here from
//! the transition rules; after every step the actions and getters must agree and I1..I6 hold.

use std::time::Duration;

use prefill_router::lifecycle::{Action, BuildId, Input, Lifecycle, Machine, RetryPolicy};
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

type T = u8;

const POLICY: RetryPolicy = RetryPolicy {
    initial: Duration::from_millis(100),
    max: Duration::from_millis(800),
};

/// The reference model: the rules of docs/design.md, restated as plainly as possible.
#[derive(Clone, Debug, Default)]
struct Reference {
    decided: bool,
    desired: Option<T>,
    held: Option<(u64, T)>,
    building: Option<(u64, T)>,
    retry_after: Option<u64>,
    failures: u32,
    last_id: u64,
    stopped: bool,
    /// The actions the last input produced, for comparison with the machine.
    last_actions: Vec<Action<T>>,
}

impl Reference {
    fn lifecycle(&self) -> Lifecycle {
        if !self.decided {
            Lifecycle::Pending
        } else {
            match (self.desired, self.held) {
                (None, _) => Lifecycle::Unavailable,
                (Some(t), Some((_, h))) if t == h => Lifecycle::Active,
                _ => Lifecycle::Pending,
            }
        }
    }

    fn new_build(&mut self, target: T, out: &mut Vec<Action<T>>) {
        self.last_id += 1;
        self.building = Some((self.last_id, target));
        out.push(Action::StartBuild {
            build: BuildId(self.last_id),
            target,
        });
    }

    fn cancel_all(&mut self, out: &mut Vec<Action<T>>) {
        if let Some((b, _)) = self.building.take() {
            out.push(Action::CancelBuild { build: BuildId(b) });
        }
        if let Some(a) = self.retry_after.take() {
            out.push(Action::CancelRetry { after: BuildId(a) });
        }
    }

    fn step(&mut self, input: &Input<T>) {
        let mut out = Vec::new();
        match *input {
            _ if self.stopped => {
                if let Input::BuildSucceeded(b) = *input {
                    out.push(Action::Discard { build: b });
                }
            }
            Input::SetTarget(x) if self.decided && x == self.desired => {}
            Input::SetTarget(x) => {
                self.cancel_all(&mut out);
                self.failures = 0;
                if let Some(x) = x {
                    let reuse = matches!(self.held, Some((_, h)) if h == x);
                    if !reuse {
                        if let Some((b, _)) = self.held.take() {
                            out.push(Action::Retire { build: BuildId(b) });
                        }
                        self.new_build(x, &mut out);
                    }
                }
                self.decided = true;
                self.desired = x;
            }
            Input::BuildSucceeded(BuildId(b)) => match self.building {
                Some((cur, t)) if cur == b => {
                    out.push(Action::Publish {
                        build: BuildId(b),
                        target: t,
                    });
                    self.building = None;
                    self.held = Some((b, t));
                    self.failures = 0;
                }
                _ => out.push(Action::Discard { build: BuildId(b) }),
            },
            Input::BuildFailed(BuildId(b)) => {
                if matches!(self.building, Some((cur, _)) if cur == b) {
                    self.building = None;
                    self.failures += 1;
                    self.retry_after = Some(b);
                    let exp = POLICY.initial.as_millis() as u64 * (1u64 << (self.failures - 1));
                    out.push(Action::ScheduleRetry {
                        after: BuildId(b),
                        delay: Duration::from_millis(exp.min(POLICY.max.as_millis() as u64)),
                        attempt: self.failures,
                    });
                }
            }
            Input::RetryElapsed(BuildId(b)) => {
                if self.retry_after == Some(b) {
                    self.retry_after = None;
                    let t = self.desired.expect("a retry is armed only for a target");
                    self.new_build(t, &mut out);
                }
            }
            Input::Shutdown => {
                self.cancel_all(&mut out);
                if let Some((b, _)) = self.held.take() {
                    out.push(Action::Retire { build: BuildId(b) });
                }
                self.decided = true;
                self.desired = None;
                self.failures = 0;
                self.stopped = true;
            }
        }
        self.last_actions = out;
    }

    /// Ids worth sending: the current build, the armed retry, recent, old and unknown ones.
    fn interesting_ids(&self) -> BoxedStrategy<BuildId> {
        let mut ids = vec![self.last_id, self.last_id + 1, self.last_id + 7];
        ids.extend(self.building.map(|(b, _)| b));
        ids.extend(self.retry_after);
        ids.extend(self.held.map(|(b, _)| b));
        if self.last_id > 1 {
            ids.push(self.last_id - 1);
        }
        let recent = proptest::sample::select(ids);
        let any_old = 0..=self.last_id + 1;
        prop_oneof![4 => recent, 1 => any_old]
            .prop_map(BuildId)
            .boxed()
    }
}

impl ReferenceStateMachine for Reference {
    type State = Reference;
    type Transition = Input<T>;

    fn init_state() -> BoxedStrategy<Self::State> {
        Just(Reference::default()).boxed()
    }

    fn transitions(state: &Self::State) -> BoxedStrategy<Self::Transition> {
        let target = proptest::option::weighted(0.8, 0u8..3).prop_map(Input::SetTarget);
        let ids = state.interesting_ids();
        prop_oneof![
            4 => target,
            4 => ids.clone().prop_map(Input::BuildSucceeded),
            3 => ids.clone().prop_map(Input::BuildFailed),
            3 => ids.prop_map(Input::RetryElapsed),
            1 => Just(Input::Shutdown),
        ]
        .boxed()
    }

    fn apply(mut state: Self::State, transition: &Self::Transition) -> Self::State {
        state.step(transition);
        state
    }
}

/// The machine under test plus the bookkeeping the history invariants need.
struct Sut {
    machine: Machine<T>,
    open_builds: Vec<BuildId>,
    published: Vec<BuildId>,
    retired: Vec<BuildId>,
    last_start: BuildId,
}

struct MachineTest;

impl StateMachineTest for MachineTest {
    type SystemUnderTest = Sut;
    type Reference = Reference;

    fn init_test(_: &Reference) -> Sut {
        Sut {
            machine: Machine::new(POLICY),
            open_builds: Vec::new(),
            published: Vec::new(),
            retired: Vec::new(),
            last_start: BuildId(0),
        }
    }

    fn apply(mut sut: Sut, reference: &Reference, input: Input<T>) -> Sut {
        let before = sut.machine.clone();
        let current = before.in_flight().map(|(b, _)| b);
        let actions: Vec<_> = sut.machine.handle(input.clone()).into_iter().collect();
        assert_eq!(
            actions, reference.last_actions,
            "actions differ on {input:?}"
        );

        // I3: a result handled as current answers its build.
        if let Input::BuildSucceeded(b) | Input::BuildFailed(b) = input {
            if Some(b) == current {
                sut.open_builds.retain(|x| *x != b);
            }
        }
        for a in &actions {
            match a {
                Action::StartBuild { build, target } => {
                    assert!(*build > sut.last_start, "I6: BuildIds strictly increase");
                    sut.last_start = *build;
                    assert_eq!(Some(target), sut.machine.desired());
                    sut.open_builds.push(*build);
                }
                Action::CancelBuild { build } => {
                    assert!(
                        sut.open_builds.contains(build),
                        "I3: cancel of no open build"
                    );
                    sut.open_builds.retain(|x| x != build);
                }
                Action::Publish { build, target } => {
                    assert_eq!(before.in_flight(), Some((*build, target)), "I4");
                    assert_eq!(before.desired(), Some(target), "I4");
                    sut.published.push(*build);
                }
                Action::Retire { build } => {
                    assert!(sut.published.contains(build), "I5: retired unpublished");
                    assert!(!sut.retired.contains(build), "I5: retired twice");
                    sut.retired.push(*build);
                }
                _ => {}
            }
        }
        assert!(
            sut.open_builds.len() <= 1,
            "I3: at most one build in flight"
        );
        sut
    }

    fn check_invariants(sut: &Sut, reference: &Reference) {
        let m = &sut.machine;
        // Agreement with the reference model.
        assert_eq!(m.lifecycle(), reference.lifecycle());
        assert_eq!(m.desired().copied(), reference.desired);
        assert_eq!(m.held().map(|(b, t)| (b.0, *t)), reference.held);
        assert_eq!(m.in_flight().map(|(b, t)| (b.0, *t)), reference.building);
        assert_eq!(m.retry_armed().map(|b| b.0), reference.retry_after);
        assert_eq!(m.failures(), reference.failures);
        // I1
        if m.lifecycle() == Lifecycle::Active {
            assert_eq!(m.held().map(|(_, t)| t), m.desired(), "I1");
        }
        // I2
        if let Some((_, t)) = m.in_flight() {
            assert_eq!(Some(t), m.desired(), "I2");
            assert!(m.held().is_none() && m.retry_armed().is_none(), "I2");
        }
        // I3: the open build is exactly the one in flight.
        assert_eq!(
            sut.open_builds.first().copied(),
            m.in_flight().map(|(b, _)| b)
        );
        // I5: held binding is published and not retired; after shutdown all are retired.
        if let Some((b, _)) = m.held() {
            assert!(
                sut.published.contains(&b) && !sut.retired.contains(&b),
                "I5"
            );
        }
        if m.is_shut_down() {
            assert_eq!(sut.published.len(), sut.retired.len(), "I5 at shutdown");
        }
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig {
        cases: 4000,
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    #[test]
    fn machine_agrees_with_reference_and_keeps_i1_to_i6(sequential 1..60 => MachineTest);
}
