//! Property-based state-machine test: random input sequences (stale, repeated and unknown
//! BuildIds included) drive the real `Machine` and the testkit's reference model (one copy,
//! shared with the fuzz target `machine_inputs`); after every step the actions and every getter
//! must agree, and the ledger checks I1..I6.

use std::time::Duration;

use prefill_router::lifecycle::{Action, BuildId, Input, Machine, RetryPolicy};
use prefill_router_testkit::ledger::Ledger;
use prefill_router_testkit::{MachineView, Reference};
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

type T = u8;

const POLICY: RetryPolicy = RetryPolicy {
    initial: Duration::from_millis(100),
    max: Duration::from_millis(800),
};

/// The reference model plus the actions its last step produced, for comparison.
#[derive(Clone, Debug)]
struct RefState {
    model: Reference<T>,
    last_actions: Vec<Action<T>>,
}

impl RefState {
    /// Ids worth sending: the current build, the armed retry, recent, old and unknown ones.
    fn interesting_ids(&self) -> BoxedStrategy<BuildId> {
        let view = self.model.view();
        let last_id = view.latest_build().0;
        let mut ids = vec![last_id, last_id + 1, last_id + 7];
        ids.extend(view.in_flight.map(|(b, _)| b.0));
        ids.extend(view.retry_armed.map(|b| b.0));
        ids.extend(view.held.map(|(b, _)| b.0));
        if last_id > 1 {
            ids.push(last_id - 1);
        }
        let recent = proptest::sample::select(ids);
        let any_old = 0..=last_id + 1;
        prop_oneof![4 => recent, 1 => any_old]
            .prop_map(BuildId)
            .boxed()
    }
}

impl ReferenceStateMachine for RefState {
    type State = RefState;
    type Transition = Input<T>;

    fn init_state() -> BoxedStrategy<Self::State> {
        Just(RefState {
            model: Reference::new(POLICY),
            last_actions: Vec::new(),
        })
        .boxed()
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
        state.last_actions = state.model.step(transition);
        state
    }
}

/// The machine under test plus the ledger of its history.
struct Sut {
    machine: Machine<T>,
    ledger: Ledger,
}

struct MachineTest;

impl StateMachineTest for MachineTest {
    type SystemUnderTest = Sut;
    type Reference = RefState;

    fn init_test(_: &RefState) -> Sut {
        Sut {
            machine: Machine::new(POLICY),
            ledger: Ledger::new(),
        }
    }

    fn apply(mut sut: Sut, reference: &RefState, input: Input<T>) -> Sut {
        let before = MachineView::of(&sut.machine);
        let actions: Vec<_> = sut.machine.handle(input.clone()).into_iter().collect();
        assert_eq!(
            actions, reference.last_actions,
            "actions differ on {input:?}"
        );
        let after = MachineView::of(&sut.machine);
        if let Err(violation) = sut.ledger.observe(&before, &input, &actions, &after) {
            panic!("{violation} (on {input:?})");
        }
        sut
    }

    fn check_invariants(sut: &Sut, reference: &RefState) {
        assert_eq!(MachineView::of(&sut.machine), reference.model.view());
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
