//! Why the model's exhaustive search is a proof: every path is finite and acyclic (so
//! stateright's `eventually`, judged at terminal states only, is sound), and "settled" is stable
//! (so a state first reached on a path that had already settled cannot hide an unsettled path
//! through the same state: stateright does not keep `eventually` bits per path at DAG joins).

use std::collections::{HashSet, VecDeque};

use prefill_router_model::mutants::NoStalenessCheck;
use prefill_router_model::properties::settles;
use prefill_router_model::{Config, Real, RouterModel, Subject};
use stateright::Model;

/// Explores every reachable state (plain BFS, no stateright) and returns the first transition
/// that fails `ok(model, from, to)`, with the number of states visited.
fn first_bad_step<S: Subject>(
    config: Config,
    ok: fn(
        &RouterModel<S>,
        &prefill_router_model::world::State<S>,
        &prefill_router_model::world::State<S>,
    ) -> bool,
) -> (Option<String>, usize) {
    let model = RouterModel::<S>::new(config);
    let mut seen = HashSet::new();
    let mut queue: VecDeque<_> = model.init_states().into();
    let mut steps = Vec::new();
    while let Some(s) = queue.pop_front() {
        if !seen.insert(s.clone()) {
            continue;
        }
        model.actions(&s, &mut steps);
        for step in steps.drain(..) {
            let Some(n) = model.next_state(&s, step) else {
                continue;
            };
            if !ok(&model, &s, &n) {
                return (Some(format!("{step} from {s:?}")), seen.len());
            }
            queue.push_back(n);
        }
    }
    (None, seen.len())
}

#[test]
fn every_step_strictly_decreases_the_rank_so_paths_are_acyclic() {
    let (bad, states) = first_bad_step::<Real>(Config::STANDARD, |m, s, n| m.rank(n) < m.rank(s));
    assert_eq!(bad, None);
    assert_eq!(states, prefill_router_model::STANDARD_STATES);
}

#[test]
fn settled_is_stable_for_the_real_machine() {
    let (bad, _) =
        first_bad_step::<Real>(Config::STANDARD, |m, s, n| !settles(m, s) || settles(m, n));
    assert_eq!(bad, None);
}

#[test]
fn stability_check_catches_a_late_build_published_after_settling() {
    // Publishing a cancelled build after the controller is done un-settles the hop.
    let (bad, _) = first_bad_step::<NoStalenessCheck>(Config::STANDARD, |m, s, n| {
        !settles(m, s) || settles(m, n)
    });
    assert!(bad.is_some_and(|b| b.contains("succeeds")));
}
