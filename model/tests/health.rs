//! The worker-health model: the real machine satisfies every property over the whole bounded
//! world, and each mutant yields a counterexample of the recovery-within-the-cap property.

use std::collections::BTreeSet;

use prefill_router_model::health::*;
use stateright::{Checker, HasDiscoveries, Model};

/// Unique states of [`HealthConfig::STANDARD`] with the real machine, pinned so that a silently
/// truncated or changed search fails (update it, with the reason, when the model changes).
const STANDARD_HEALTH_STATES: usize = 183_466;

#[test]
fn real_health_machine_satisfies_every_property() {
    let checker = HealthModel::<RealHealth>::new(HealthConfig::STANDARD)
        .checker()
        .spawn_bfs()
        .join();
    assert!(checker.is_done());
    checker.assert_properties();
    assert_eq!(checker.unique_state_count(), STANDARD_HEALTH_STATES);
}

/// Runs BFS on mutant `B` until `property` has a discovery, and returns its trace.
fn counterexample<B: Breakers>(property: &'static str) -> String {
    let model = HealthModel::<B>::new(HealthConfig::STANDARD);
    let checker = model
        .checker()
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
        .spawn_bfs()
        .join();
    let path = checker.discovery(property).unwrap_or_else(|| {
        panic!(
            "mutant {} escaped property {property:?} after {} states",
            B::NAME,
            checker.unique_state_count()
        )
    });
    path.into_actions()
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_breaker_that_never_closes_breaks_h1() {
    let t = counterexample::<NeverCloses>(ROUTABLE_AGAIN_WITHIN_THE_CAP);
    assert!(t.contains("answers"), "{t}");
}

#[test]
fn a_backoff_without_the_cap_breaks_h1() {
    let t = counterexample::<NoCap>(ROUTABLE_AGAIN_WITHIN_THE_CAP);
    // Only a third consecutive failure takes the uncapped delay past the cap.
    assert!(t.matches("answers").count() >= 2, "{t}");
}
