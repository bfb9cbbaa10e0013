//! Exhaustive checks of the real machine in the standard configuration.

use prefill_router_model::{Config, Real, RouterModel};
use stateright::{Checker, Model};

#[test]
fn probe() {
    let t = std::time::Instant::now();
    let c = RouterModel::<Real>::new(Config::STANDARD).checker().spawn_bfs().join();
    println!("unique {} total {} depth {} in {:?}", c.unique_state_count(), c.state_count(), c.max_depth(), t.elapsed());
    for p in c.model().properties() {
        println!("{} -> {:?}", p.name, c.discovery(p.name).map(|d| d.into_actions()));
    }
    c.assert_properties();
}
