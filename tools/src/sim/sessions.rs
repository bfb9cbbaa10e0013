//! Session affinity in the simulated world, and its oracles.
//!
//! A run with [`SimConfig::sessions`](super::SimConfig::sessions) gives most requests a session
//! key drawn from a few sessions, and every binding's dispatcher a session-affinity table with
//! [`TTL`] (fresh per binding, as the default factory builds it). Each pick of a request with a
//! session reports here (`picked`) with the routable set the dispatcher saw, the workers the
//! request already failed on, and the outcome the binding's affinity counters recorded. The
//! world keeps a mirror of what each binding's table must hold (session → worker, last use)
//! and checks, per pick:
//!
//! - `affinity_outcome_miscounted`: a request with a session is counted exactly once (hit,
//!   miss or re-pick), one without none;
//! - `affinity_survived_rebuild`: the first pick of a session on a binding is a miss (a new
//!   binding's table is empty, whatever the previous binding remembered);
//! - `affinity_off_rendezvous`: the pick is the first worker of the session's rendezvous
//!   order among the routable ones the request has not failed on (the simulated bindings set
//!   no busy threshold, so nothing spills): what makes every frontend agree;
//! - `affinity_hit_missed`: the pick counts a hit exactly when it lands on the worker the
//!   session's live entry names (younger than the TTL): a live entry is never a miss, and a
//!   re-pick leaves the entry's worker;
//! - `affinity_outside_routable`: a hit is only on a routable worker not failed by the
//!   request;
//! - `affinity_expired_hit`: an entry as old as the TTL or older never gives a hit.
//!
//! The dispatch-outside-admission oracle of every run still judges every pick.

use std::time::Duration;

use tokio::time::Instant;

use super::config::Mutant;
use super::oracle::Violation;
use super::world::{AffinityMirror, World};
use prefill_router::discovery::InstanceId;
use prefill_router::push::{rendezvous_first, session_key, AffinityOutcome};

/// The simulated session TTL: a few request bursts long, so entries both live and expire
/// within a run.
pub const TTL: Duration = Duration::from_millis(150);

/// How many distinct sessions the requests draw from.
pub(crate) const SESSIONS: u64 = 6;

/// The affinity table of a new binding's dispatcher: a fresh one (`None` when the run has no
/// sessions), or under the `AffinityInheritedByRebuild` mutant the first binding's.
pub(crate) fn table_for_binding(world: &World, mutant: Option<Mutant>) -> Option<AffinityMirror> {
    world.with(|s| {
        if !s.sessions.on {
            return None;
        }
        let fresh = || AffinityMirror::fresh(TTL);
        if mutant == Some(Mutant::AffinityInheritedByRebuild) {
            return Some(s.sessions.shared.get_or_insert_with(fresh).clone());
        }
        Some(fresh())
    })
}

fn broken(world: &World, request: u64, property: &'static str, detail: String) {
    world.violate(Violation::AffinityBroken {
        request,
        property,
        detail,
    });
}

/// What one pick saw and did.
pub(crate) struct Pick<'a> {
    /// The request's id.
    pub(crate) request: u64,
    /// The binding's serial.
    pub(crate) serial: u64,
    /// The request's session key.
    pub(crate) session: Option<&'a str>,
    /// The routable set the dispatcher picked from (before exclusions).
    pub(crate) routable: &'a [InstanceId],
    /// Workers the request already failed on (excluded from this pick).
    pub(crate) tried: &'a [InstanceId],
    /// The picked worker.
    pub(crate) worker: InstanceId,
    /// The outcomes the binding's counters recorded for the pick.
    pub(crate) outcomes: Vec<AffinityOutcome>,
}

/// Judge one pick against the mirror, then update the mirror as the table must have.
pub(crate) fn picked(world: &World, pick: &Pick<'_>) {
    let Pick {
        request,
        serial,
        session,
        routable,
        tried,
        worker,
        ref outcomes,
    } = *pick;
    let Some(session) = session else {
        if !outcomes.is_empty() {
            let detail = format!("no session, yet counted {outcomes:?}");
            broken(world, request, "affinity_outcome_miscounted", detail);
        }
        return;
    };
    let [outcome] = outcomes[..] else {
        let detail = format!("session {session} counted {outcomes:?} for one pick");
        broken(world, request, "affinity_outcome_miscounted", detail);
        return;
    };
    let now = Instant::now();
    let key = (serial, session.to_owned());
    let entry = world.with(|s| s.sessions.remembered.get(&key).copied());
    let usable = |w: InstanceId| routable.contains(&w) && !tried.contains(&w);
    if outcome == AffinityOutcome::Hit && !usable(worker) {
        let detail = format!(
            "hit on worker {worker}, not routable ({routable:?}) or already failed ({tried:?})"
        );
        broken(world, request, "affinity_outside_routable", detail);
    }
    if usable(worker) {
        let usable_set: Vec<InstanceId> = routable.iter().copied().filter(|&w| usable(w)).collect();
        let first = rendezvous_first(session_key(session), &usable_set);
        if first != Some(worker) {
            let detail = format!(
                "session {session} on worker {worker}, its first usable rendezvous worker is \
                 {first:?} (usable {usable_set:?})"
            );
            broken(world, request, "affinity_off_rendezvous", detail);
        }
    }
    match entry {
        None if outcome != AffinityOutcome::Miss => {
            let detail = format!(
                "first pick of session {session} on binding #{serial} was a {outcome:?} \
                 (to worker {worker})"
            );
            broken(world, request, "affinity_survived_rebuild", detail);
        }
        None => {}
        Some((remembered, last)) => {
            let age = now.saturating_duration_since(last);
            let live = age < TTL;
            match outcome {
                AffinityOutcome::Hit if !live => {
                    let detail = format!("hit on an entry {age:?} old (TTL {TTL:?})");
                    broken(world, request, "affinity_expired_hit", detail);
                }
                AffinityOutcome::Hit if worker != remembered => {
                    let detail =
                        format!("hit on worker {worker}, the entry remembers {remembered}");
                    broken(world, request, "affinity_hit_missed", detail);
                }
                AffinityOutcome::Miss if live => {
                    let detail = format!("miss on a live entry ({age:?} old, worker {remembered})");
                    broken(world, request, "affinity_hit_missed", detail);
                }
                AffinityOutcome::Repick if !live => {
                    let detail = format!("re-pick on an expired entry ({age:?} old)");
                    broken(world, request, "affinity_outcome_miscounted", detail);
                }
                AffinityOutcome::Repick if worker == remembered => {
                    let detail = format!("re-pick that stayed on the entry's worker {worker}");
                    broken(world, request, "affinity_hit_missed", detail);
                }
                _ => {}
            }
        }
    }
    world.with(|s| {
        s.sessions.remembered.insert(key, (worker, now));
        match outcome {
            AffinityOutcome::Hit => s.stats.affinity_hits += 1,
            AffinityOutcome::Miss => s.stats.affinity_misses += 1,
            AffinityOutcome::Repick => s.stats.affinity_repicks += 1,
        }
    });
}

/// The remembered worker of `session` on binding `serial`, if the entry is younger than the
/// TTL (the `AffinityIgnoresRoutable` mutant sends the request there unchecked, the
/// `AffinityKeepsLiveEntry` one while it is usable).
pub(crate) fn live_entry(world: &World, serial: u64, session: &str) -> Option<InstanceId> {
    let now = Instant::now();
    world.with(|s| {
        s.sessions
            .remembered
            .get(&(serial, session.to_owned()))
            .filter(|(_, last)| now.saturating_duration_since(*last) < TTL)
            .map(|(w, _)| *w)
    })
}

/// The session of request `id`, drawn from its own key (so runs without sessions draw
/// exactly as before): one request in five has none.
pub(crate) fn draw(world: &World, id: u64) -> Option<String> {
    let mut rng = world.keyed(&[STREAM_SESSION, id]);
    (!rng.percent(20)).then(|| format!("session-{}", rng.below(SESSIONS)))
}

/// The key of the session draws (apart from the binding's decision streams).
const STREAM_SESSION: u64 = 5;
