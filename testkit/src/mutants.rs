//! Deliberately broken code under test, which the fuzz checks must reject on the seed corpus:
//! that shows the checks (and the corpus) can fail.
//!
//! - [`Mutant`]: wraps the real [`Machine`] and corrupts what a driver observes in one way
//!   (judged by [`run_script`]);
//! - [`CARD_MUTANTS`]: broken card resolvers (judged by
//!   [`check_cards_with`](crate::card_fuzz::check_cards_with)).

use crate::branches::BranchSet;
use crate::card_fuzz::Resolver;
use crate::machine_fuzz::{run_script, Checks, MachineScript, Stepper};
use crate::reference::MachineView;
use prefill_router::advert::{resolve, AdvertError, DecodeDefaults, ModelCard, PrefillConfig};
use prefill_router::lifecycle::{Action, Input, Lifecycle, Machine, RetryPolicy};

/// The ways a mutant breaks the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// Publishes a stale build instead of discarding it (breaks I4).
    PublishesStaleBuilds,
    /// Never retires a replaced binding (breaks I5; a leak in a real driver).
    ForgetsRetire,
    /// Never cancels the build in flight on a retarget (breaks I3).
    ForgetsCancel,
    /// Reports Active while a build is in flight (a reader would route on a withdrawn binding).
    ActiveWhileBuilding,
}

impl Mutation {
    /// Every mutation.
    pub const ALL: [Mutation; 4] = [
        Mutation::PublishesStaleBuilds,
        Mutation::ForgetsRetire,
        Mutation::ForgetsCancel,
        Mutation::ActiveWhileBuilding,
    ];

    /// The mutation named `name` (its `Debug` spelling), if any.
    pub fn named(name: &str) -> Option<Mutation> {
        Mutation::ALL.into_iter().find(|m| format!("{m:?}") == name)
    }
}

/// The real machine, observed through a [`Mutation`].
#[derive(Clone, Debug)]
pub struct Mutant {
    machine: Machine<u8>,
    mutation: Mutation,
}

impl Mutant {
    /// A fresh mutant machine.
    pub fn new(mutation: Mutation, policy: RetryPolicy) -> Self {
        Mutant {
            machine: Machine::new(policy),
            mutation,
        }
    }
}

impl Stepper for Mutant {
    fn step(&mut self, input: Input<u8>) -> Vec<Action<u8>> {
        let target = self.machine.desired().copied().unwrap_or(0);
        let actions = self.machine.handle(input).into_iter();
        match self.mutation {
            Mutation::PublishesStaleBuilds => actions
                .map(|a| match a {
                    Action::Discard { build } => Action::Publish { build, target },
                    other => other,
                })
                .collect(),
            Mutation::ForgetsRetire => actions
                .filter(|a| !matches!(a, Action::Retire { .. }))
                .collect(),
            Mutation::ForgetsCancel => actions
                .filter(|a| !matches!(a, Action::CancelBuild { .. }))
                .collect(),
            Mutation::ActiveWhileBuilding => actions.collect(),
        }
    }

    fn view(&self) -> MachineView<u8> {
        let mut view = MachineView::of(&self.machine);
        if self.mutation == Mutation::ActiveWhileBuilding && view.in_flight.is_some() {
            view.lifecycle = Lifecycle::Active;
        }
        view
    }
}

/// Run one decoded script through a [mutant](Mutant) machine; panics when a
/// check fails, which is the point: measures how fast the fuzzer finds a known bug.
pub fn check_script_against_mutant(script: &MachineScript, mutation: Mutation) {
    let mut branches = BranchSet::default();
    let make = |policy| Mutant::new(mutation, policy);
    if let Err(failure) = run_script(script, make, Checks::ALL, &mut branches) {
        panic!("machine_inputs against {mutation:?}: {failure}");
    }
}

/// The ways a health mutant breaks the worker-health machine (judged by
/// [`run_health_script_with`](crate::health_fuzz::run_health_script_with)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthMutation {
    /// Overload counts as a dead worker: an overloaded pool empties itself.
    OverloadOpens,
    /// A stale successful probe closes the breaker (a late answer from an earlier round).
    StaleProbeCloses,
    /// The backoff loses its cap: the delay keeps doubling from the first one.
    Uncapped,
}

impl HealthMutation {
    /// Every health mutation.
    pub const ALL: [HealthMutation; 3] = [
        HealthMutation::OverloadOpens,
        HealthMutation::StaleProbeCloses,
        HealthMutation::Uncapped,
    ];
}

/// The real health machine, observed through a [`HealthMutation`].
pub struct HealthMutant {
    real: prefill_router::health::Machine<u8>,
    policy: prefill_router::health::BackoffPolicy,
    mutation: HealthMutation,
}

impl HealthMutant {
    /// A fresh mutant.
    pub fn new(
        mutation: HealthMutation,
        policy: prefill_router::health::BackoffPolicy,
        seed: u64,
    ) -> Self {
        HealthMutant {
            real: prefill_router::health::Machine::new(policy, seed),
            policy,
            mutation,
        }
    }
}

impl crate::health_fuzz::HealthSubject for HealthMutant {
    fn handle(
        &mut self,
        input: prefill_router::health::Input<u8>,
    ) -> Vec<prefill_router::health::Action<u8>> {
        use prefill_router::health::{Action, Breaker, FailureClass, Input};
        let input = match (self.mutation, input) {
            (
                HealthMutation::OverloadOpens,
                Input::Failed {
                    instance,
                    class: FailureClass::Overloaded,
                },
            ) => Input::Failed {
                instance,
                class: FailureClass::ConnectionRefused,
            },
            (
                HealthMutation::StaleProbeCloses,
                Input::ProbeResult {
                    instance, ok: true, ..
                },
            ) if matches!(self.real.breaker(&instance), Some(Breaker::Probing { .. })) => {
                let Some(Breaker::Probing { probe, .. }) = self.real.breaker(&instance) else {
                    unreachable!("matched just above")
                };
                Input::ProbeResult {
                    instance,
                    probe,
                    ok: true,
                }
            }
            (_, input) => input,
        };
        let mut actions = self.real.handle(input).to_vec();
        if self.mutation == HealthMutation::Uncapped {
            for action in &mut actions {
                if let Action::ArmTimer { delay, attempt, .. } = action {
                    let doublings = attempt.saturating_sub(1).min(20);
                    *delay = self.policy.initial.saturating_mul(1 << doublings);
                }
            }
        }
        actions
    }
    fn breaker(&self, instance: &u8) -> Option<prefill_router::health::Breaker> {
        self.real.breaker(instance)
    }
    fn is_routable(&self, instance: &u8) -> bool {
        self.real.is_routable(instance)
    }
    fn tracked(&self) -> std::collections::BTreeSet<u8> {
        self.real.instances().map(|(i, _)| *i).collect()
    }
    fn open_count(&self) -> usize {
        self.real.open_count()
    }
    fn next_id(&self) -> u64 {
        self.real.next_id()
    }
}

/// Broken card resolvers, by name.
pub const CARD_MUTANTS: &[(&str, Resolver)] = &[
    ("last card wins", last_card_wins),
    ("keeps active-block tracking", keeps_active_block_tracking),
    ("identical cards disagree", identical_cards_disagree),
    ("no card resolves to defaults", no_card_resolves_to_defaults),
];

fn last_card_wins(
    cards: &[ModelCard],
    decode: &DecodeDefaults,
) -> Result<PrefillConfig, AdvertError> {
    let reversed: Vec<ModelCard> = cards.iter().rev().cloned().collect();
    resolve(&reversed, decode)
}

fn keeps_active_block_tracking(
    cards: &[ModelCard],
    decode: &DecodeDefaults,
) -> Result<PrefillConfig, AdvertError> {
    resolve(cards, decode).map(|mut cfg| {
        if let (true, Some(kv)) = (cfg.advertised, cfg.kv_router_config.as_mut()) {
            kv.router_track_active_blocks = true;
        }
        cfg
    })
}

fn identical_cards_disagree(
    cards: &[ModelCard],
    decode: &DecodeDefaults,
) -> Result<PrefillConfig, AdvertError> {
    resolve(cards, decode).map(|cfg| PrefillConfig {
        disagreeing_cards: cfg.total_cards - 1,
        ..cfg
    })
}

fn no_card_resolves_to_defaults(
    cards: &[ModelCard],
    decode: &DecodeDefaults,
) -> Result<PrefillConfig, AdvertError> {
    if cards.is_empty() {
        return resolve(&[ModelCard::default()], decode);
    }
    resolve(cards, decode)
}

pub use control::{ControlMutant, ControlMutation};

mod control {
    use std::cell::RefCell;
    use std::sync::Arc;

    use crate::control_fuzz::{ControlApi, TestBinding, TestSnapshot};
    use prefill_router::control::{Control, ControlStatus, Effect};
    use prefill_router::lifecycle::{BuildId, RetryPolicy};
    use prefill_router::snapshot::Route;

    /// The ways a control mutant breaks the core.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum ControlMutation {
        /// Readers load the snapshot from before the last call (a publish that lags the call).
        StaleSnapshot,
        /// Keeps a reference to every binding a request was routed on (retired ones leak).
        LeaksBindings,
        /// Loses the cancellation of a superseded build.
        DropsCancel,
    }

    impl ControlMutation {
        /// Every control mutation.
        pub const ALL: [ControlMutation; 3] = [
            ControlMutation::StaleSnapshot,
            ControlMutation::LeaksBindings,
            ControlMutation::DropsCancel,
        ];
    }

    /// The real core, observed through a [`ControlMutation`].
    pub struct ControlMutant {
        inner: Control<u8, TestBinding>,
        mutation: ControlMutation,
        previous: RefCell<Option<Arc<TestSnapshot>>>,
        leaked: RefCell<Vec<Arc<TestBinding>>>,
    }

    impl ControlMutant {
        /// A fresh mutant core.
        pub fn new(mutation: ControlMutation, policy: RetryPolicy) -> Self {
            ControlMutant {
                inner: Control::new(policy),
                mutation,
                previous: RefCell::new(None),
                leaked: RefCell::new(Vec::new()),
            }
        }

        fn call(
            &self,
            f: impl FnOnce(&Control<u8, TestBinding>) -> Vec<Effect<u8>>,
        ) -> Vec<Effect<u8>> {
            if self.mutation == ControlMutation::StaleSnapshot {
                *self.previous.borrow_mut() = Some(ControlApi::snapshot(&self.inner));
            }
            let mut effects = f(&self.inner);
            if self.mutation == ControlMutation::DropsCancel {
                effects.retain(|e| !matches!(e, Effect::CancelBuild { .. }));
            }
            effects
        }
    }

    impl ControlApi for ControlMutant {
        fn set_target(&self, target: Option<u8>) -> Vec<Effect<u8>> {
            self.call(|c| ControlApi::set_target(c, target))
        }
        fn build_succeeded(&self, build: BuildId, binding: TestBinding) -> Vec<Effect<u8>> {
            self.call(|c| ControlApi::build_succeeded(c, build, binding))
        }
        fn build_failed(&self, build: BuildId, error: &str) -> Vec<Effect<u8>> {
            self.call(|c| ControlApi::build_failed(c, build, error))
        }
        fn retry_elapsed(&self, after: BuildId) -> Vec<Effect<u8>> {
            self.call(|c| ControlApi::retry_elapsed(c, after))
        }
        fn shutdown(&self) -> Vec<Effect<u8>> {
            self.call(ControlApi::shutdown)
        }
        fn snapshot(&self) -> Arc<TestSnapshot> {
            match &*self.previous.borrow() {
                Some(stale) => Arc::clone(stale),
                None => ControlApi::snapshot(&self.inner),
            }
        }
        fn route(&self) -> Route<TestBinding> {
            let route = ControlApi::route(&self.inner);
            if let (ControlMutation::LeaksBindings, Some(b)) = (self.mutation, route.binding()) {
                self.leaked.borrow_mut().push(Arc::clone(b));
            }
            route
        }
        fn status(&self) -> ControlStatus<u8> {
            ControlApi::status(&self.inner)
        }
    }
}

/// Broken payload decoders, by name (judged by
/// [`check_frame_script_with`](crate::frame_fuzz::check_frame_script_with)).
pub const FRAME_MUTANTS: &[(&str, crate::frame_fuzz::Decoder)] = &[
    ("reserves a whole frame up front", frame::greedy),
    ("drops the session key", frame::lossy),
];

mod frame {
    use prefill_router::transport::{decode_frame, Frame, FrameError, DEFAULT_MAX_FRAME_LEN};

    /// Reserves more than the frame limit before decoding (a decoder trusting a length field).
    pub(super) fn greedy(payload: &[u8]) -> Result<Frame, FrameError> {
        let reserve: Vec<u8> = Vec::with_capacity(DEFAULT_MAX_FRAME_LEN + 1);
        let frame = decode_frame(payload);
        drop(std::hint::black_box(reserve));
        frame
    }

    /// Loses a field (a decoder out of step with the encoder).
    pub(super) fn lossy(payload: &[u8]) -> Result<Frame, FrameError> {
        decode_frame(payload).map(|frame| match frame {
            Frame::Request {
                id,
                timeout_ms,
                mut request,
            } => {
                request.session = None;
                Frame::Request {
                    id,
                    timeout_ms,
                    request,
                }
            }
            other => other,
        })
    }
}

/// Broken record readers, by name (judged by
/// [`check_record_script`](crate::record_fuzz::check_record_script)).
pub const RECORD_MUTANTS: &[(&str, crate::record_fuzz::Reader)] = &[
    ("accepts a record under any key", record::any_key),
    (
        "drops the advertised router config",
        record::forgets_router_config,
    ),
];

mod record {
    use prefill_router::advert::ModelCard;
    use prefill_router::discovery::{decode_record, Instance, RecordError};

    /// Trusts the document over the key it was found under.
    pub(super) fn any_key(key: &str, bytes: &[u8]) -> Result<(Instance, ModelCard), RecordError> {
        match decode_record(key, bytes) {
            Err(RecordError::KeyMismatch { expected, .. }) => decode_record(&expected, bytes),
            other => other,
        }
    }

    /// Loses the card's routing configuration.
    pub(super) fn forgets_router_config(
        key: &str,
        bytes: &[u8],
    ) -> Result<(Instance, ModelCard), RecordError> {
        decode_record(key, bytes).map(|(instance, card)| {
            (
                instance,
                ModelCard {
                    router_config: None,
                    ..card
                },
            )
        })
    }
}
