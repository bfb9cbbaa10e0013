//! The model checks bite: each deliberately broken machine yields a counterexample for the
//! property it breaks (the mapping is the "caught by" column of docs/properties.md).

use std::collections::BTreeSet;

use prefill_router_model::mutants::{
    IgnoreAdmission, KeepRetryOnRetarget, NoRetry, NoStalenessCheck, RetireAsDiscard,
    RetireOnClear, ReuseForOtherTarget, ReuseRetired, SecondBuildInFlight,
};
use prefill_router_model::properties::*;
use prefill_router_model::{Config, RouterModel, Subject};
use stateright::{Checker, HasDiscoveries, Model};

/// Runs BFS on mutant `S` until `property` has a discovery, and returns its trace.
fn counterexample<S: Subject>(property: &'static str) -> String {
    let model = RouterModel::<S>::new(Config::STANDARD);
    let checker = model
        .checker()
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
        .spawn_bfs()
        .join();
    let path = checker.discovery(property).unwrap_or_else(|| {
        panic!(
            "mutant {} escaped property {property:?} after {} states",
            S::NAME,
            checker.unique_state_count()
        )
    });
    checker.model().render(&path.into_actions())
}

#[test]
fn publishing_without_staleness_check_breaks_m2() {
    let t = counterexample::<NoStalenessCheck>(STALE_BUILD_NEVER_PUBLISHED);
    assert!(t.contains("publish"), "{t}");
}

#[test]
fn reusing_a_binding_for_another_target_breaks_m1() {
    counterexample::<ReuseForOtherTarget>(ACTIVE_SERVES_DESIRED);
}

#[test]
fn reusing_a_binding_for_another_target_breaks_m6() {
    let t = counterexample::<ReuseForOtherTarget>(CLEARING_IS_SYNCHRONOUS);
    assert!(t.contains("dispatches"), "{t}");
}

#[test]
fn forgetting_to_cancel_the_retry_breaks_m8() {
    counterexample::<KeepRetryOnRetarget>(NO_LEAKED_RETRY);
}

#[test]
fn starting_a_second_build_breaks_m3() {
    counterexample::<SecondBuildInFlight>(AT_MOST_ONE_BUILD);
}

#[test]
fn retiring_on_clear_breaks_m4() {
    let t = counterexample::<RetireOnClear>(RETIRED_ONCE);
    assert!(t.matches("retire").count() >= 2, "{t}");
}

#[test]
fn republishing_a_retired_binding_breaks_m5() {
    counterexample::<ReuseRetired>(RETIRED_NEVER_REPUBLISHED);
}

#[test]
fn tearing_down_instead_of_retiring_breaks_m7() {
    let t = counterexample::<RetireAsDiscard>(NO_REQUEST_LOST);
    assert!(t.contains("finishes") || t.contains("dispatches"), "{t}");
}

#[test]
fn never_retrying_breaks_m9() {
    let t = counterexample::<NoRetry>(SETTLES);
    assert!(t.contains("fails"), "{t}");
}

#[test]
fn dispatching_without_checking_admission_breaks_m10() {
    let t = counterexample::<IgnoreAdmission>(NO_DISPATCH_OUTSIDE_ADMISSION);
    assert!(t.contains("admission of binding"), "{t}");
    assert!(t.contains("dispatches"), "{t}");
}

#[test]
fn every_safety_and_liveness_property_is_broken_by_some_mutant() {
    // The mapping the tests above exercise, kept in one place so a new property without a mutant
    // fails here (a property no mutant can break is suspect).
    let caught: BTreeSet<&str> = [
        STALE_BUILD_NEVER_PUBLISHED,
        ACTIVE_SERVES_DESIRED,
        CLEARING_IS_SYNCHRONOUS,
        NO_LEAKED_RETRY,
        AT_MOST_ONE_BUILD,
        RETIRED_ONCE,
        RETIRED_NEVER_REPUBLISHED,
        NO_REQUEST_LOST,
        SETTLES,
        NO_DISPATCH_OUTSIDE_ADMISSION,
    ]
    .into();
    let model = RouterModel::<prefill_router_model::Real>::new(Config::STANDARD);
    for p in model.properties() {
        let is_sometimes = p.name.starts_with('V');
        assert!(
            is_sometimes || caught.contains(p.name),
            "property {:?} has no mutant that breaks it",
            p.name
        );
    }
}
