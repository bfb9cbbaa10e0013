//! Fuzz target `machine_inputs`: a sequence of inputs through [`Machine`], checked after every
//! step against the [`Reference`] model (actions and every getter) and the [`Ledger`] (I1..I6).
//!
//! Inputs are not raw [`Input`]s: a random 64-bit BuildId almost never names the build in
//! flight, so the fuzzer would see only "unknown build" paths. A [`Step`] picks its BuildId
//! relative to the machine's state instead (the build in flight, the armed retry, the held
//! binding, the latest, an older or a not-yet-issued one, or a raw value), and its target from a
//! small alphabet so that targets repeat and bindings get reused.

use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};

use crate::branches::{Branch, BranchSet};
use crate::ledger::Ledger;
use crate::reference::{MachineView, Reference};
use prefill_router::lifecycle::{Action, BuildId, Input, Machine, RetryPolicy};

/// Targets are small integers; [`TargetPick::Other`] folds onto this many of them.
pub const TARGET_ALPHABET: u8 = 4;

/// The retry policy of a run.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicySeed {
    /// [`RetryPolicy::default`] (1 s doubling to 30 s).
    Default,
    /// [`RetryPolicy::fixed`], upstream's behaviour.
    Fixed {
        /// The flat delay, in milliseconds.
        delay_ms: u16,
    },
    /// Doubling from `initial_ms` up to `initial_ms * 2^(doublings % 48)`.
    Backoff {
        /// The first delay, in milliseconds.
        initial_ms: u16,
        /// How many doublings reach the cap, folded below 48.
        doublings: u8,
    },
}

impl PolicySeed {
    /// The policy this seed stands for.
    ///
    /// Caps reach up to 2^47 times the first delay, so that backoff keeps doubling past
    /// attempt 32 (where `RetryPolicy::delay` once saturated its factor: see the regression
    /// test `rule6_delay_keeps_doubling_past_32_attempts`).
    pub fn policy(self) -> RetryPolicy {
        match self {
            PolicySeed::Default => RetryPolicy::default(),
            PolicySeed::Fixed { delay_ms } => {
                RetryPolicy::fixed(Duration::from_millis(delay_ms.into()))
            }
            PolicySeed::Backoff {
                initial_ms,
                doublings,
            } => {
                let initial = Duration::from_millis(initial_ms.into());
                let nanos = initial.as_nanos() << (doublings % 48);
                RetryPolicy {
                    initial,
                    // At most 65,535 ms * 2^47: far inside a Duration.
                    max: Duration::new(
                        (nanos / 1_000_000_000) as u64,
                        (nanos % 1_000_000_000) as u32,
                    ),
                }
            }
        }
    }
}

/// Which target a `SetTarget` names.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetPick {
    /// The desired target again (rule 1: nothing to do), else target 0.
    Desired,
    /// The target of the held binding (rule 3: reuse), else target 0.
    Held,
    /// Target `n % TARGET_ALPHABET`.
    Other(u8),
}

/// Which BuildId a completion or retry names, relative to the machine's state.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdPick {
    /// The build in flight, else the latest started.
    InFlight,
    /// The build the armed retry follows, else the latest started.
    RetryArmed,
    /// The build of the held binding, else the latest started.
    Held,
    /// The latest build started (`#0` before any).
    Latest,
    /// `n + 1` builds before the latest (down to `#0`, never issued).
    Older(u8),
    /// `n` builds after the latest: not issued yet.
    Unknown(u8),
    /// Any id at all.
    Raw(u64),
}

/// One step of a script.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// `Input::SetTarget`.
    SetTarget(Option<TargetPick>),
    /// `Input::BuildSucceeded`.
    Succeed(IdPick),
    /// `Input::BuildFailed`.
    Fail(IdPick),
    /// `Input::RetryElapsed`.
    RetryFires(IdPick),
    /// `Input::Shutdown`.
    Shutdown,
}

/// A whole fuzz input: a policy and the steps to feed.
#[derive(Arbitrary, Clone, Debug, PartialEq, Eq)]
pub struct MachineScript {
    /// The machine's retry policy.
    pub policy: PolicySeed,
    /// The inputs, each resolved against the state it is fed to.
    pub steps: Vec<Step>,
}

impl IdPick {
    fn resolve(self, m: &MachineView<u8>) -> BuildId {
        let latest = m.latest_build();
        match self {
            IdPick::InFlight => m.in_flight.map_or(latest, |(b, _)| b),
            IdPick::RetryArmed => m.retry_armed.unwrap_or(latest),
            IdPick::Held => m.held.map_or(latest, |(b, _)| b),
            IdPick::Latest => latest,
            IdPick::Older(n) => BuildId(latest.0.saturating_sub(u64::from(n) + 1)),
            IdPick::Unknown(n) => BuildId(m.next_build.0.saturating_add(n.into())),
            IdPick::Raw(id) => BuildId(id),
        }
    }
}

impl Step {
    /// The input this step stands for, in state `m`.
    pub fn resolve(self, m: &MachineView<u8>) -> Input<u8> {
        match self {
            Step::SetTarget(pick) => Input::SetTarget(pick.map(|p| match p {
                TargetPick::Desired => m.desired.unwrap_or(0),
                TargetPick::Held => m.held.map_or(0, |(_, t)| t),
                TargetPick::Other(n) => n % TARGET_ALPHABET,
            })),
            Step::Succeed(id) => Input::BuildSucceeded(id.resolve(m)),
            Step::Fail(id) => Input::BuildFailed(id.resolve(m)),
            Step::RetryFires(id) => Input::RetryElapsed(id.resolve(m)),
            Step::Shutdown => Input::Shutdown,
        }
    }
}

/// A machine under test: the real one, or a broken variant of it.
pub trait Stepper {
    /// Feed one input; the actions in order.
    fn step(&mut self, input: Input<u8>) -> Vec<Action<u8>>;
    /// The observable state.
    fn view(&self) -> MachineView<u8>;
}

impl Stepper for Machine<u8> {
    fn step(&mut self, input: Input<u8>) -> Vec<Action<u8>> {
        self.handle(input).into_iter().collect()
    }

    fn view(&self) -> MachineView<u8> {
        MachineView::of(self)
    }
}

/// Where and how a run went wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Index of the failing step.
    pub step: usize,
    /// The input fed at that step.
    pub input: Input<u8>,
    /// What broke.
    pub reason: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "step {} ({:?}): {}", self.step, self.input, self.reason)
    }
}

/// Which checks a run applies (all of them, except when a test shows that one alone bites).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checks {
    /// Compare actions and state with the [`Reference`] model after every step.
    pub reference: bool,
    /// Check I1..I6 with a [`Ledger`] after every step.
    pub invariants: bool,
}

impl Checks {
    /// Every check.
    pub const ALL: Checks = Checks {
        reference: true,
        invariants: true,
    };
}

/// Run `script` through the machine `make` builds, checking every step; records the branches of
/// `Machine::handle` the steps took into `branches`.
pub fn run_script<S: Stepper>(
    script: &MachineScript,
    make: impl FnOnce(RetryPolicy) -> S,
    checks: Checks,
    branches: &mut BranchSet,
) -> Result<(), Failure> {
    let policy = script.policy.policy();
    let mut sut = make(policy);
    let mut reference = Reference::new(policy);
    let mut ledger = Ledger::new();
    let mut before = sut.view();
    for (index, step) in script.steps.iter().enumerate() {
        let input = step.resolve(&before);
        let fail = |reason: String| Failure {
            step: index,
            input: input.clone(),
            reason,
        };
        let actions = sut.step(input.clone());
        let expected = reference.step(&input);
        if checks.reference && actions != expected {
            return Err(fail(format!(
                "actions {actions:?}, reference model says {expected:?}"
            )));
        }
        let after = sut.view();
        let model = reference.view();
        if checks.reference && after != model {
            return Err(fail(format!(
                "state {after:?}, reference model says {model:?}"
            )));
        }
        if checks.invariants {
            ledger
                .observe(&before, &input, &actions, &after)
                .map_err(fail)?;
        }
        branches.record_all(Branch::classify(&before, &input, &actions, policy));
        before = after;
    }
    Ok(())
}

/// Decode raw fuzz bytes the way libfuzzer-sys does for a typed target.
pub fn decode(bytes: &[u8]) -> Option<MachineScript> {
    MachineScript::arbitrary_take_rest(Unstructured::new(bytes)).ok()
}

/// The `machine_inputs` harness: panics with the failing step when a check fails.
pub fn machine_inputs(bytes: &[u8]) {
    if let Some(script) = decode(bytes) {
        check_script(&script);
    }
}

/// Run one decoded script through the real machine; panics when a check fails.
pub fn check_script(script: &MachineScript) {
    let mut branches = BranchSet::default();
    if let Err(failure) = run_script(script, Machine::new, Checks::ALL, &mut branches) {
        panic!("machine_inputs: {failure}\npolicy: {:?}", script.policy);
    }
}
