//! Why the model's exhaustive search is a proof: every path is finite and acyclic (so
//! stateright's `eventually`, judged at terminal states only, is sound), and "settled" is stable
//! (so a state first reached on a path that had already settled cannot hide an unsettled path
//! through the same state: stateright keeps no `eventually` bits per path at DAG joins).

use std::collections::{HashSet, VecDeque};
use std::sync::OnceLock;

use prefill_router_model::mutants::NoStalenessCheck;
use prefill_router_model::properties::settles;
use prefill_router_model::world::State;
use prefill_router_model::{Config, Real, RouterModel, Subject, STANDARD_STATES};
use stateright::Model;

/// What the checks need of one transition: ranks and settledness before and after.
#[derive(Clone, Copy, Debug)]
struct Edge {
    rank: (u64, u64),
    settled: (bool, bool),
}

/// Every transition of the model (plain BFS, independent of stateright's checker), stopping at
/// the first edge for which `stop` holds. Returns the edges seen and the number of states.
fn edges<S: Subject>(config: Config, stop: fn(&Edge) -> bool) -> (Vec<Edge>, usize) {
    let model = RouterModel::<S>::new(config);
    let mut seen: HashSet<State<S>> = HashSet::new();
    let mut queue: VecDeque<State<S>> = model.init_states().into();
    let mut steps = Vec::new();
    let mut out = Vec::new();
    while let Some(s) = queue.pop_front() {
        if !seen.insert(s.clone()) {
            continue;
        }
        model.actions(&s, &mut steps);
        for step in steps.drain(..) {
            let Some(n) = model.next_state(&s, step) else {
                continue;
            };
            let edge = Edge {
                rank: (model.rank(&s), model.rank(&n)),
                settled: (settles(&s), settles(&n)),
            };
            out.push(edge);
            if stop(&edge) {
                return (out, seen.len());
            }
            queue.push_back(n);
        }
    }
    (out, seen.len())
}

/// The real machine's transitions in the standard configuration, computed once for both tests.
fn standard_edges() -> &'static (Vec<Edge>, usize) {
    static EDGES: OnceLock<(Vec<Edge>, usize)> = OnceLock::new();
    EDGES.get_or_init(|| edges::<Real>(Config::STANDARD, |_| false))
}

#[test]
fn every_step_strictly_decreases_the_rank_so_paths_are_acyclic() {
    let (edges, states) = standard_edges();
    assert_eq!(*states, STANDARD_STATES, "the traversal must be complete");
    let bad = edges.iter().find(|e| e.rank.1 >= e.rank.0);
    assert!(bad.is_none(), "a step does not decrease the rank: {bad:?}");
}

#[test]
fn settled_is_stable_for_the_real_machine() {
    let (edges, _) = standard_edges();
    assert!(
        edges.iter().any(|e| e.settled.1),
        "settling must be reachable"
    );
    let bad = edges.iter().find(|e| e.settled.0 && !e.settled.1);
    assert!(bad.is_none(), "a step leaves a settled state: {bad:?}");
}

#[test]
fn stability_check_catches_a_late_build_published_after_settling() {
    // Publishing a cancelled build after the controller is done un-settles the hop.
    let (edges, _) = edges::<NoStalenessCheck>(Config::STANDARD, |e| e.settled.0 && !e.settled.1);
    assert!(edges.last().is_some_and(|e| e.settled.0 && !e.settled.1));
}
