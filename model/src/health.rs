//! A small stateright model of the worker-health machine ([`prefill_router::health::Machine`],
//! the real one) in a world of discrete time: instances blip (become unreachable and reachable
//! again, their discovery entry unchanged), leave and rejoin discovery, and fail requests of
//! every [`FailureClass`]; timers fire when due; probes answer by the instance's reachability at
//! that moment. Time advances one tick at a time, never past a due timer or an unanswered probe
//! (a probe takes less than one tick), and 1 tick is 1 second of backoff.
//!
//! The liveness claim "an instance that is reachable and stays in discovery is routable again
//! within the cap" becomes a safety property over a counter: the ticks an instance spent
//! reachable, in discovery and unroutable in a row never exceed the cap (H1). Mutants
//! ([`NeverCloses`], [`NoCap`]) show the check bites (`model/tests/health.rs`).

use std::fmt;
use std::hash::Hash;
use std::time::Duration;

use prefill_router::health::{
    Action, BackoffPolicy, FailureClass, Input, Machine, ProbeId, TimerId,
};
use stateright::{Model, Property};

/// Instance ids of the model.
pub type Instance = u8;

/// The cap of the model's backoff, in ticks (seconds).
pub const CAP_TICKS: u8 = 2;

/// The model's backoff: 1 s doubling up to the cap.
pub fn policy() -> BackoffPolicy {
    BackoffPolicy {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(u64::from(CAP_TICKS)),
    }
}

/// Seed of the machine's jitter (any value; fixed so that the search is reproducible).
pub const SEED: u64 = 0x5eed;

/// A health machine the model can check: the real one or a deliberately broken one.
pub trait Breakers: Clone + fmt::Debug + Hash + Eq + Send + Sync + 'static {
    /// Name used in reports.
    const NAME: &'static str;
    /// A machine tracking nothing.
    fn fresh() -> Self;
    /// Apply one input.
    fn handle(&mut self, input: Input<Instance>) -> Vec<Action<Instance>>;
    /// Whether the request path may route to `instance`.
    fn is_routable(&self, instance: Instance) -> bool;
}

/// The real machine under the model's policy.
pub type RealHealth = Machine<Instance>;

impl Breakers for RealHealth {
    const NAME: &'static str = "real";
    fn fresh() -> Self {
        Machine::new(policy(), SEED)
    }
    fn handle(&mut self, input: Input<Instance>) -> Vec<Action<Instance>> {
        Machine::handle(self, input).to_vec()
    }
    fn is_routable(&self, instance: Instance) -> bool {
        Machine::is_routable(self, &instance)
    }
}

/// Mutant: a breaker that never closes (every probe reads as failed), the bug class of "open
/// until discovery re-adds it". Breaks H1.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NeverCloses(RealHealth);

impl Breakers for NeverCloses {
    const NAME: &'static str = "never-closes";
    fn fresh() -> Self {
        NeverCloses(RealHealth::fresh())
    }
    fn handle(&mut self, input: Input<Instance>) -> Vec<Action<Instance>> {
        let input = match input {
            Input::ProbeResult {
                instance, probe, ..
            } => Input::ProbeResult {
                instance,
                probe,
                ok: false,
            },
            other => other,
        };
        self.0.handle(input).to_vec()
    }
    fn is_routable(&self, instance: Instance) -> bool {
        self.0.is_routable(&instance)
    }
}

/// Mutant: exponential backoff without the cap (the world still expects the model's cap).
/// Breaks H1.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NoCap(RealHealth);

impl Breakers for NoCap {
    const NAME: &'static str = "no-cap";
    fn fresh() -> Self {
        NoCap(Machine::new(
            BackoffPolicy {
                max: Duration::MAX,
                ..policy()
            },
            SEED,
        ))
    }
    fn handle(&mut self, input: Input<Instance>) -> Vec<Action<Instance>> {
        self.0.handle(input).to_vec()
    }
    fn is_routable(&self, instance: Instance) -> bool {
        self.0.is_routable(&instance)
    }
}

/// The model's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HealthConfig {
    /// Instances, all in discovery and reachable at the start.
    pub instances: u8,
    /// Ticks of time in all.
    pub ticks: u8,
    /// Reachability changes in all.
    pub blips: u8,
    /// Discovery changes (a removal or a re-add) in all.
    pub membership: u8,
}

impl HealthConfig {
    /// Two instances, enough time for a backoff to reach the cap and a blip to end after it.
    pub const STANDARD: HealthConfig = HealthConfig {
        instances: 2,
        ticks: 8,
        blips: 3,
        membership: 2,
    };
}

/// One step of the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HealthStep {
    /// One second passes.
    Tick,
    /// The instance's reachability flips.
    Blip(Instance),
    /// Discovery drops the instance.
    Remove(Instance),
    /// Discovery lists the instance again.
    Add(Instance),
    /// A request to the instance fails this way (connection-level classes only while it is
    /// unreachable; the others, a poisoned request or load, at any time).
    Fail(Instance, FailureClass),
    /// The due timer fires.
    Fire(Instance, TimerId),
    /// The probe answers (by the instance's reachability now).
    Answer(Instance, ProbeId),
}

impl fmt::Display for HealthStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HealthStep::Tick => write!(f, "a second passes"),
            HealthStep::Blip(i) => write!(f, "instance {i}'s reachability flips"),
            HealthStep::Remove(i) => write!(f, "discovery removes instance {i}"),
            HealthStep::Add(i) => write!(f, "discovery adds instance {i}"),
            HealthStep::Fail(i, c) => write!(f, "a request to instance {i} fails: {c}"),
            HealthStep::Fire(i, t) => write!(f, "{t} of instance {i} fires"),
            HealthStep::Answer(i, p) => write!(f, "{p} of instance {i} answers"),
        }
    }
}

/// The world of one instance.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Place {
    /// Listed in discovery.
    pub listed: bool,
    /// Its listener answers.
    pub reachable: bool,
    /// Ticks in a row it was reachable, listed and unroutable (saturates above the cap).
    pub waiting: u8,
}

/// A state of the model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HealthState<B> {
    /// The machine under check.
    pub breakers: B,
    /// Current time, in ticks.
    pub now: u8,
    /// Per instance.
    pub places: Vec<Place>,
    /// Armed timers: instance, id, due time.
    pub timers: Vec<(Instance, TimerId, u8)>,
    /// Probes under way.
    pub probes: Vec<(Instance, ProbeId)>,
    /// Reachability changes left.
    pub blips_left: u8,
    /// Discovery changes left.
    pub membership_left: u8,
    /// Some breaker closed after opening (vacuity witness).
    pub recovered: bool,
}

/// The model over machine `B`.
#[derive(Clone, Debug)]
pub struct HealthModel<B> {
    /// Its bounds.
    pub config: HealthConfig,
    _breakers: std::marker::PhantomData<B>,
}

impl<B: Breakers> HealthModel<B> {
    /// The model with these bounds.
    pub fn new(config: HealthConfig) -> Self {
        HealthModel {
            config,
            _breakers: std::marker::PhantomData,
        }
    }

    fn apply(&self, s: &HealthState<B>, step: HealthStep) -> HealthState<B> {
        let mut n = s.clone();
        let input = match step {
            HealthStep::Tick => {
                n.now += 1;
                for (i, p) in n.places.iter_mut().enumerate() {
                    let stuck = p.listed && p.reachable && !n.breakers.is_routable(i as u8);
                    p.waiting = if stuck {
                        (p.waiting + 1).min(CAP_TICKS + 1)
                    } else {
                        0
                    };
                }
                None
            }
            HealthStep::Blip(i) => {
                n.blips_left -= 1;
                let p = &mut n.places[usize::from(i)];
                p.reachable = !p.reachable;
                None
            }
            HealthStep::Remove(i) => {
                n.membership_left -= 1;
                n.places[usize::from(i)].listed = false;
                Some(Input::Removed(i))
            }
            HealthStep::Add(i) => {
                n.membership_left -= 1;
                n.places[usize::from(i)].listed = true;
                Some(Input::Added(i))
            }
            HealthStep::Fail(instance, class) => Some(Input::Failed { instance, class }),
            HealthStep::Fire(instance, timer) => {
                n.timers.retain(|t| (t.0, t.1) != (instance, timer));
                Some(Input::TimerFired { instance, timer })
            }
            HealthStep::Answer(instance, probe) => {
                n.probes.retain(|p| *p != (instance, probe));
                Some(Input::ProbeResult {
                    instance,
                    probe,
                    ok: n.places[usize::from(instance)].reachable,
                })
            }
        };
        if let Some(input) = input {
            for action in n.breakers.handle(input) {
                match action {
                    Action::ArmTimer {
                        instance,
                        timer,
                        delay,
                        ..
                    } => {
                        // Due at the first tick at or after the delay.
                        let ticks = delay.as_nanos().div_ceil(1_000_000_000);
                        let due = u128::from(n.now) + ticks;
                        n.timers.push((instance, timer, due.min(255) as u8));
                    }
                    Action::CancelTimer { instance, timer } => {
                        n.timers.retain(|t| (t.0, t.1) != (instance, timer));
                    }
                    Action::StartProbe { instance, probe } => n.probes.push((instance, probe)),
                    Action::Close { .. } => n.recovered = true,
                    Action::Open { .. } => {}
                }
            }
        }
        n
    }
}

impl<B: Breakers> Model for HealthModel<B> {
    type State = HealthState<B>;
    type Action = HealthStep;

    fn init_states(&self) -> Vec<HealthState<B>> {
        let mut breakers = B::fresh();
        for i in 0..self.config.instances {
            let _ = breakers.handle(Input::Added(i));
        }
        let place = Place {
            listed: true,
            reachable: true,
            waiting: 0,
        };
        vec![HealthState {
            breakers,
            now: 0,
            places: vec![place; usize::from(self.config.instances)],
            timers: Vec::new(),
            probes: Vec::new(),
            blips_left: self.config.blips,
            membership_left: self.config.membership,
            recovered: false,
        }]
    }

    fn actions(&self, s: &HealthState<B>, out: &mut Vec<HealthStep>) {
        let due = s.timers.iter().any(|t| t.2 <= s.now);
        if s.now < self.config.ticks && !due && s.probes.is_empty() {
            out.push(HealthStep::Tick);
        }
        for t in &s.timers {
            if t.2 <= s.now {
                out.push(HealthStep::Fire(t.0, t.1));
            }
        }
        for p in &s.probes {
            out.push(HealthStep::Answer(p.0, p.1));
        }
        for (i, p) in s.places.iter().enumerate() {
            let i = i as u8;
            if s.blips_left > 0 {
                out.push(HealthStep::Blip(i));
            }
            if s.membership_left > 0 {
                out.push(if p.listed {
                    HealthStep::Remove(i)
                } else {
                    HealthStep::Add(i)
                });
            }
            if p.listed {
                for class in FailureClass::ALL {
                    // A connection-level failure needs a dead listener; the others happen to
                    // live workers too (a poisoned request, a client deadline, load).
                    if !class.counts_against_health() || !p.reachable {
                        out.push(HealthStep::Fail(i, class));
                    }
                }
            }
        }
    }

    fn next_state(&self, s: &HealthState<B>, step: HealthStep) -> Option<HealthState<B>> {
        Some(self.apply(s, step))
    }

    fn format_action(&self, step: &HealthStep) -> String {
        step.to_string()
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ROUTABLE_AGAIN_WITHIN_THE_CAP, |_, s: &HealthState<B>| {
                s.places.iter().all(|p| p.waiting <= CAP_TICKS)
            }),
            Property::always(UNLISTED_NEVER_ROUTABLE, |_, s: &HealthState<B>| {
                s.places
                    .iter()
                    .enumerate()
                    .all(|(i, p)| p.listed || !s.breakers.is_routable(i as u8))
            }),
            Property::always(NO_STUCK_BREAKER, |_, s: &HealthState<B>| {
                // An unroutable listed instance always has its way back under way: a timer
                // armed or a probe out. Without one it would stay out until re-added.
                s.places.iter().enumerate().all(|(i, p)| {
                    let i = i as u8;
                    let pending =
                        s.timers.iter().any(|t| t.0 == i) || s.probes.iter().any(|q| q.0 == i);
                    !p.listed || pending || s.breakers.is_routable(i)
                })
            }),
            Property::sometimes(SOMETIMES_RECOVERS, |_, s: &HealthState<B>| s.recovered),
            Property::sometimes(SOMETIMES_WAITS_THE_CAP, |_, s: &HealthState<B>| {
                s.places.iter().any(|p| p.waiting == CAP_TICKS)
            }),
        ]
    }
}

/// H1: an instance reachable and in discovery is unroutable for at most the cap, in a row.
pub const ROUTABLE_AGAIN_WITHIN_THE_CAP: &str =
    "H1 reachable and listed is routable again within the cap";
/// H2: an instance not in discovery is never routable.
pub const UNLISTED_NEVER_ROUTABLE: &str = "H2 an unlisted instance is never routable";
/// H3: a listed instance that is not routable has a timer armed or a probe under way (no breaker
/// is stuck open waiting for discovery).
pub const NO_STUCK_BREAKER: &str = "H3 an open breaker always has a timer or probe pending";
/// HV1: a breaker opens and closes again on some path (H1 is not vacuous).
pub const SOMETIMES_RECOVERS: &str = "HV1 sometimes a breaker closes again";
/// HV2: some instance waits the whole cap (H1's bound is tight, not trivially met).
pub const SOMETIMES_WAITS_THE_CAP: &str = "HV2 sometimes a recovering instance waits the full cap";
