//! Fuzz target `health_inputs`: a sequence of inputs through the worker-health
//! [`Machine`], checked after every step against a ledger of
//! what the world was told and ordered.
//!
//! Like `machine_inputs`, a [`HealthStep`] picks its timer or probe id relative to the state
//! (the instance's current one, the latest issued, an older or a not-yet-issued one), since a
//! random 64-bit id would almost never be current.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};

use prefill_router::health::{
    Action, BackoffPolicy, Breaker, FailureClass, Input, Machine, ProbeId, TimerId,
};

/// Instances are small integers folded onto this many.
pub const INSTANCE_ALPHABET: u8 = 4;

/// Which id a step names.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdPick {
    /// The instance's current timer or probe (falls back to the latest issued).
    Current,
    /// The latest id issued.
    Latest,
    /// An older id, this many back.
    Older(u8),
    /// One not issued yet.
    Future(u8),
}

/// One step of a script.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthStep {
    /// Discovery lists the instance.
    Add(u8),
    /// Discovery drops the instance.
    Remove(u8),
    /// A request fails with the class of this index (folded onto [`FailureClass::ALL`]).
    Fail(u8, u8),
    /// A timer fires.
    Fire(u8, IdPick),
    /// A probe answers.
    Answer(u8, IdPick, bool),
}

/// A run: the policy, the seed, the steps.
#[derive(Arbitrary, Clone, Debug, PartialEq, Eq)]
pub struct HealthScript {
    /// First delay, in milliseconds.
    pub initial_ms: u16,
    /// The cap, in milliseconds.
    pub max_ms: u32,
    /// The jitter seed.
    pub seed: u64,
    /// The inputs.
    pub steps: Vec<HealthStep>,
}

/// Decode raw fuzz bytes the way libfuzzer-sys does for a typed target.
pub fn decode(bytes: &[u8]) -> Option<HealthScript> {
    HealthScript::arbitrary_take_rest(Unstructured::new(bytes)).ok()
}

fn id_of(pick: IdPick, current: Option<u64>, latest: u64) -> u64 {
    match pick {
        IdPick::Current => current.unwrap_or(latest),
        IdPick::Latest => latest,
        IdPick::Older(k) => latest.saturating_sub(u64::from(k)),
        IdPick::Future(k) => latest + 1 + u64::from(k),
    }
}

/// A health machine under test: the real one, or a broken variant of it
/// ([`crate::mutants::HealthMutant`]) that the ledger must reject.
pub trait HealthSubject {
    /// Apply one input; the actions in order.
    fn handle(&mut self, input: Input<u8>) -> Vec<Action<u8>>;
    /// The breaker of a tracked instance.
    fn breaker(&self, instance: &u8) -> Option<Breaker>;
    /// Whether the request path may pick the instance.
    fn is_routable(&self, instance: &u8) -> bool;
    /// The tracked instances.
    fn tracked(&self) -> BTreeSet<u8>;
    /// Breakers not closed.
    fn open_count(&self) -> usize;
    /// The next timer or probe id.
    fn next_id(&self) -> u64;
}

impl HealthSubject for Machine<u8> {
    fn handle(&mut self, input: Input<u8>) -> Vec<Action<u8>> {
        Machine::handle(self, input).to_vec()
    }
    fn breaker(&self, instance: &u8) -> Option<Breaker> {
        Machine::breaker(self, instance)
    }
    fn is_routable(&self, instance: &u8) -> bool {
        Machine::is_routable(self, instance)
    }
    fn tracked(&self) -> BTreeSet<u8> {
        self.instances().map(|(i, _)| *i).collect()
    }
    fn open_count(&self) -> usize {
        Machine::open_count(self)
    }
    fn next_id(&self) -> u64 {
        Machine::next_id(self)
    }
}

/// The script's backoff policy.
pub fn policy_of(script: &HealthScript) -> BackoffPolicy {
    BackoffPolicy {
        initial: Duration::from_millis(u64::from(script.initial_ms)),
        max: Duration::from_millis(u64::from(script.max_ms)),
    }
}

/// Runs a script through the real machine; `Err` names the first broken check.
pub fn run_health_script(script: &HealthScript) -> Result<(), String> {
    run_health_script_with(script, Machine::new)
}

/// Runs a script through the machine `make` builds from the script's policy and seed.
pub fn run_health_script_with<S: HealthSubject>(
    script: &HealthScript,
    make: impl FnOnce(BackoffPolicy, u64) -> S,
) -> Result<(), String> {
    let policy = policy_of(script);
    let mut m = make(policy, script.seed);
    // What discovery listed, the timers armed and the probes out, by instance.
    let mut listed: BTreeSet<u8> = BTreeSet::new();
    let mut timers: BTreeMap<u8, TimerId> = BTreeMap::new();
    let mut probes: BTreeMap<u8, ProbeId> = BTreeMap::new();
    let mut latest = 0u64;
    for (n, step) in script.steps.iter().enumerate() {
        let fold = |i: u8| i % INSTANCE_ALPHABET;
        let before = m.breaker(&match *step {
            HealthStep::Add(i)
            | HealthStep::Remove(i)
            | HealthStep::Fail(i, _)
            | HealthStep::Fire(i, _)
            | HealthStep::Answer(i, _, _) => fold(i),
        });
        let (instance, input) = match *step {
            HealthStep::Add(i) => {
                listed.insert(fold(i));
                (fold(i), Input::Added(fold(i)))
            }
            HealthStep::Remove(i) => {
                listed.remove(&fold(i));
                probes.remove(&fold(i));
                (fold(i), Input::Removed(fold(i)))
            }
            HealthStep::Fail(i, c) => {
                let class = FailureClass::ALL[usize::from(c) % FailureClass::ALL.len()];
                (
                    fold(i),
                    Input::Failed {
                        instance: fold(i),
                        class,
                    },
                )
            }
            HealthStep::Fire(i, pick) => {
                let timer = TimerId(id_of(pick, timers.get(&fold(i)).map(|t| t.0), latest));
                (
                    fold(i),
                    Input::TimerFired {
                        instance: fold(i),
                        timer,
                    },
                )
            }
            HealthStep::Answer(i, pick, ok) => {
                let probe = ProbeId(id_of(pick, probes.get(&fold(i)).map(|p| p.0), latest));
                (
                    fold(i),
                    Input::ProbeResult {
                        instance: fold(i),
                        probe,
                        ok,
                    },
                )
            }
        };
        let fail = |what: String| Err(format!("step {n} ({step:?}): {what}"));
        let actions = m.handle(input.clone());
        for action in &actions {
            match action {
                Action::Open { instance: i } => {
                    let counts = matches!(input, Input::Failed { class, .. } if class.counts_against_health());
                    if !counts || before != Some(Breaker::Closed) || *i != instance {
                        return fail(format!(
                            "{action} without a counting failure of a closed breaker"
                        ));
                    }
                }
                Action::Close { instance: i } => {
                    let current = matches!(input, Input::ProbeResult { probe, ok: true, .. } if probes.get(&instance) == Some(&probe));
                    if !current || *i != instance {
                        return fail(format!("{action} without a successful current probe"));
                    }
                    probes.remove(&instance);
                }
                Action::ArmTimer {
                    instance: i,
                    timer,
                    delay,
                    ..
                } => {
                    if *delay > policy.max {
                        return fail(format!("{action}: above the cap {:?}", policy.max));
                    }
                    if timer.0 <= latest || *i != instance {
                        return fail(format!("{action}: id not fresh or wrong instance"));
                    }
                    latest = timer.0;
                    probes.remove(&instance);
                    timers.insert(instance, *timer);
                }
                Action::CancelTimer { instance: i, timer } => {
                    if timers.remove(i) != Some(*timer) {
                        return fail(format!("{action}: not the armed timer"));
                    }
                }
                Action::StartProbe { instance: i, probe } => {
                    let fired = matches!(input, Input::TimerFired { timer, .. } if timers.get(&instance) == Some(&timer));
                    if !fired || probe.0 <= latest || *i != instance {
                        return fail(format!(
                            "{action} without its current timer, or id not fresh"
                        ));
                    }
                    latest = probe.0;
                    timers.remove(&instance);
                    probes.insert(instance, *probe);
                }
            }
        }
        if m.next_id() != latest + 1 {
            return fail(format!("next id {} after latest {latest}", m.next_id()));
        }
        // Exactly the listed instances are tracked; routable iff closed; the open count agrees.
        let tracked = m.tracked();
        if tracked != listed {
            return fail(format!("tracks {tracked:?}, discovery lists {listed:?}"));
        }
        let mut open = 0;
        for i in 0..INSTANCE_ALPHABET {
            let breaker = m.breaker(&i);
            if m.is_routable(&i) != (breaker == Some(Breaker::Closed)) {
                return fail(format!("instance {i}: routable disagrees with {breaker:?}"));
            }
            match breaker {
                Some(Breaker::Open { timer, .. }) if timers.get(&i) != Some(&timer) => {
                    return fail(format!(
                        "instance {i}: open on {timer}, armed {:?}",
                        timers.get(&i)
                    ));
                }
                Some(Breaker::Probing { probe, .. }) if probes.get(&i) != Some(&probe) => {
                    return fail(format!(
                        "instance {i}: probing {probe}, started {:?}",
                        probes.get(&i)
                    ));
                }
                Some(Breaker::Closed) | None if timers.contains_key(&i) => {
                    return fail(format!("instance {i}: a timer is left armed"));
                }
                _ => {}
            }
            if breaker.is_some_and(|b| b != Breaker::Closed) {
                open += 1;
            }
        }
        if m.open_count() != open {
            return fail(format!("open_count {} but {open} open", m.open_count()));
        }
    }
    Ok(())
}

/// Run one decoded script; panics when a check fails.
pub fn check_health_script(script: &HealthScript) {
    if let Err(e) = run_health_script(script) {
        panic!("health_inputs: {e}");
    }
}

/// The `health_inputs` harness.
pub fn health_inputs(bytes: &[u8]) {
    if let Some(script) = decode(bytes) {
        check_health_script(&script);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_script_through_open_probe_and_close_passes_the_ledger() {
        use HealthStep::*;
        use IdPick::*;
        let script = HealthScript {
            initial_ms: 100,
            max_ms: 1_000,
            seed: 3,
            steps: vec![
                Add(0),
                Add(1),
                Fail(0, 3),
                Fail(0, 0),
                Fire(0, Future(2)),
                Fire(0, Current),
                Answer(0, Current, false),
                Fire(0, Current),
                Answer(0, Older(1), true),
                Answer(0, Current, true),
                Fail(1, 2),
                Remove(1),
                Add(1),
                Remove(5),
            ],
        };
        run_health_script(&script).unwrap();
        // The same bytes decode the same way every time (the replay relies on it).
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(decode(&bytes), decode(&bytes));
    }
}
