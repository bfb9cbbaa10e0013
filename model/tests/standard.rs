//! Exhaustive checks of the real machine: BFS over the standard configuration with the state
//! count pinned, DFS agreeing on it, and the vacuity witnesses found.

use prefill_router_model::{Config, Real, RouterModel, STANDARD_STATES};
use stateright::{Checker, Model};

#[test]
fn real_machine_satisfies_every_property_in_the_standard_configuration() {
    let checker = RouterModel::<Real>::new(Config::STANDARD)
        .checker()
        .spawn_bfs()
        .join();
    // Pinned: a truncated or silently changed search must fail, not pass.
    assert_eq!(checker.unique_state_count(), STANDARD_STATES);
    assert!(checker.is_done());
    checker.assert_properties();
}

#[test]
fn dfs_agrees_with_bfs_on_the_state_count() {
    let checker = RouterModel::<Real>::new(Config::STANDARD)
        .checker()
        .spawn_dfs()
        .join();
    assert_eq!(checker.unique_state_count(), STANDARD_STATES);
    checker.assert_properties();
}

#[test]
fn two_threads_agree_on_the_state_count() {
    let checker = RouterModel::<Real>::new(Config::STANDARD)
        .checker()
        .threads(2)
        .spawn_bfs()
        .join();
    assert_eq!(checker.unique_state_count(), STANDARD_STATES);
    checker.assert_properties();
}

#[test]
fn without_shutdown_every_property_still_holds() {
    // Paths that never shut down must settle on the last target by themselves.
    let config = Config {
        shutdown: false,
        ..Config::STANDARD
    };
    let checker = RouterModel::<Real>::new(config)
        .checker()
        .spawn_bfs()
        .join();
    assert!(checker.unique_state_count() > 1000);
    checker.assert_properties();
}

#[test]
fn without_admission_changes_the_model_is_the_pre_admission_one() {
    // Admission is a conservative extension: with no admission change the state space is the
    // one pinned before admission was modelled, so the extension added states, not altered any.
    let config = Config {
        admission_changes: 0,
        ..Config::STANDARD
    };
    let checker = RouterModel::<Real>::new(config)
        .checker()
        .spawn_bfs()
        .join();
    assert_eq!(checker.unique_state_count(), 242_502);
    assert!(checker.is_done());
}

#[test]
fn requests_are_a_canonical_multiset() {
    // Two requests in the same stage are interchangeable: the model keeps them sorted and steps
    // only the first of equal ones, so one request load yields one successor, not two.
    let model = RouterModel::<Real>::new(Config::STANDARD);
    let init = model.init_states().remove(0);
    let mut steps = Vec::new();
    model.actions(&init, &mut steps);
    let loads = steps
        .iter()
        .filter(|s| matches!(s, prefill_router_model::Step::Load(_)))
        .count();
    assert_eq!(loads, 1);
}
