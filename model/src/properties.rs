//! The model's properties, one named function each. Ids and statements are listed in
//! docs/properties.md; the names below are the ones the checker reports.

use prefill_router::lifecycle::Lifecycle;
use stateright::{Model, Property};

use crate::subject::Subject;
use crate::world::{fault, seen, Request, State};

/// M1 (= I1 seen from readers): when the snapshot says Active, its binding serves the target of
/// the controller's last `SetTarget`.
pub const ACTIVE_SERVES_DESIRED: &str = "M1 active serves the desired target";
/// M2 (I4): no cancelled or superseded build is ever published.
pub const STALE_BUILD_NEVER_PUBLISHED: &str = "M2 stale build never published";
/// M3 (I2, I3): at most one uncancelled build in flight, and it is for the desired target.
pub const AT_MOST_ONE_BUILD: &str = "M3 at most one build in flight";
/// M4 (I5): nothing unpublished is retired, nothing retired twice, nothing replaced unretired.
pub const RETIRED_ONCE: &str = "M4 each binding retired at most once";
/// M5 (I5): a retired binding is never published again.
pub const RETIRED_NEVER_REPUBLISHED: &str = "M5 retired binding never re-published";
/// M6 (upstream I7): a request that loaded after a `SetTarget` returned never dispatches to a
/// binding of an earlier target.
pub const CLEARING_IS_SYNCHRONOUS: &str = "M6 clearing is synchronous";
/// M7: every request finishes on the binding it loaded or by bypass; none loses its binding.
pub const NO_REQUEST_LOST: &str = "M7 no request lost";
/// M8: an armed retry timer always follows a failure of the desired target's build.
pub const NO_LEAKED_RETRY: &str = "M8 no retry timer outlives its target";
/// M9: once the controller is done, the hop settles: Active on the last target, or Unavailable
/// when that was `None` or after shutdown; every request has finished.
pub const SETTLES: &str = "M9 settles when the controller is done";
/// M10: no request is dispatched on a binding whose admission set is empty (it fails instead).
pub const NO_DISPATCH_OUTSIDE_ADMISSION: &str =
    "M10 no dispatch on a binding whose admission is empty";
/// V1: Active is reachable.
pub const SOMETIMES_ACTIVE: &str = "V1 sometimes active";
/// V2: a build started by a retry timer is published.
pub const SOMETIMES_RETRY_ACTIVE: &str = "V2 sometimes a retry reaches active";
/// V3: a retired binding finishes a request that loaded it earlier.
pub const SOMETIMES_RETIRED_SERVES: &str = "V3 sometimes a retired binding serves a request";
/// V4: a late build result is discarded.
pub const SOMETIMES_STALE_REJECTED: &str = "V4 sometimes a stale build is rejected";
/// V5: a held binding is reused on a return to its target.
pub const SOMETIMES_REUSED: &str = "V5 sometimes a held binding is reused";
/// V6: a request on a retired binding fails because the binding's admission emptied.
pub const SOMETIMES_ADMISSION_FAILS: &str =
    "V6 sometimes a retired binding's request fails after its admission emptied";

/// Every property, in report order, for a model over [`State`]s (generic so this module
/// needs only the world, not the model that steps it: `all::<S, RouterModel<S>>()`).
pub fn all<S: Subject, M: Model<State = State<S>>>() -> Vec<Property<M>> {
    vec![
        Property::always(ACTIVE_SERVES_DESIRED, |_: &M, s: &State<S>| {
            active_serves_desired(s)
        }),
        Property::always(STALE_BUILD_NEVER_PUBLISHED, |_: &M, s: &State<S>| {
            s.faults & fault::STALE_PUBLISHED == 0
        }),
        Property::always(AT_MOST_ONE_BUILD, |_: &M, s: &State<S>| {
            at_most_one_build(s)
        }),
        Property::always(RETIRED_ONCE, |_: &M, s: &State<S>| {
            s.faults & fault::BAD_RETIRE == 0
        }),
        Property::always(RETIRED_NEVER_REPUBLISHED, |_: &M, s: &State<S>| {
            s.faults & fault::REPUBLISHED == 0
        }),
        Property::always(CLEARING_IS_SYNCHRONOUS, |_: &M, s: &State<S>| {
            s.faults & fault::STALE_DISPATCH == 0
        }),
        Property::always(NO_REQUEST_LOST, |_: &M, s: &State<S>| {
            s.faults & fault::REQUEST_LOST == 0
        }),
        Property::always(NO_LEAKED_RETRY, |_: &M, s: &State<S>| no_leaked_retry(s)),
        Property::eventually(SETTLES, |_: &M, s: &State<S>| settles(s)),
        Property::always(NO_DISPATCH_OUTSIDE_ADMISSION, |_: &M, s: &State<S>| {
            s.faults & fault::OUTSIDE_ADMISSION == 0
        }),
        Property::sometimes(SOMETIMES_ACTIVE, |_: &M, s: &State<S>| {
            s.snapshot().lifecycle == Lifecycle::Active
        }),
        Property::sometimes(SOMETIMES_RETRY_ACTIVE, |_: &M, s: &State<S>| {
            s.seen & seen::RETRY_ACTIVE != 0
        }),
        Property::sometimes(SOMETIMES_RETIRED_SERVES, |_: &M, s: &State<S>| {
            s.seen & seen::RETIRED_SERVED != 0
        }),
        Property::sometimes(SOMETIMES_STALE_REJECTED, |_: &M, s: &State<S>| {
            s.seen & seen::STALE_REJECTED != 0
        }),
        Property::sometimes(SOMETIMES_REUSED, |_: &M, s: &State<S>| {
            s.seen & seen::REUSED != 0
        }),
        Property::sometimes(SOMETIMES_ADMISSION_FAILS, |_: &M, s: &State<S>| {
            s.seen & seen::ADMISSION_FAILED != 0
        }),
    ]
}

/// M1: Active ⇒ the snapshot's binding really serves the controller's desired target.
pub fn active_serves_desired<S: Subject>(s: &State<S>) -> bool {
    let snap = s.snapshot();
    if snap.lifecycle != Lifecycle::Active {
        return true;
    }
    !s.shut_down
        && snap
            .binding
            .is_some_and(|b| s.desired == Some(Some(b.target)))
}

/// M3: at most one uncancelled build, and only for the desired target.
pub fn at_most_one_build<S: Subject>(s: &State<S>) -> bool {
    let mut live = s.builds.iter().filter(|b| !b.cancelled);
    match (live.next(), live.next()) {
        (None, _) => true,
        (Some(b), None) => !s.shut_down && s.desired == Some(Some(b.target)),
        (Some(_), Some(_)) => false,
    }
}

/// M8: an uncancelled timer exists only after a failure of the desired target's build.
pub fn no_leaked_retry<S: Subject>(s: &State<S>) -> bool {
    let mut armed = s.timers.iter().filter(|t| !t.cancelled);
    match (armed.next(), armed.next()) {
        (None, _) => true,
        (Some(t), None) => !s.shut_down && s.desired == Some(Some(t.target)),
        (Some(_), Some(_)) => false,
    }
}

/// M9: the controller is done (retargets spent or shut down), the hop shows its last decision,
/// and every request has finished.
pub fn settles<S: Subject>(s: &State<S>) -> bool {
    let done = s.retargets_left == 0 || s.shut_down;
    let snap = s.snapshot();
    let shows_decision = match (s.shut_down, s.desired) {
        (true, _) | (false, Some(None)) => snap.lifecycle == Lifecycle::Unavailable,
        (false, Some(Some(t))) => {
            snap.lifecycle == Lifecycle::Active && snap.binding.is_some_and(|b| b.target == t)
        }
        // Never targeted (a zero budget): Pending is the decision shown.
        (false, None) => snap.lifecycle == Lifecycle::Pending,
    };
    done && shows_decision && s.requests.iter().all(Request::is_done)
}
