//! One run's state, shared by the runner's parts (a leaf: they all import it, it imports none
//! of them).

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::super::binding::{SimDecode, SimFactory};
use super::super::config::TargetSource;
use super::super::controller::Controller;
use super::super::pool::Pool;
use super::super::rng::SimRng;
use super::super::world::World;
use prefill_router::router::{FallbackPolicy, PrefillRouter};
use prefill_router::topology::TopologyWatcher;

/// The router under test.
pub(super) type Router = PrefillRouter<SimFactory>;

/// What moves the topology in this run.
pub(super) enum Topo {
    Controller(Arc<Controller>),
    Watcher {
        pool: Arc<Pool>,
        watcher: TopologyWatcher,
    },
}

/// One run in progress.
pub(super) struct Run {
    pub(super) world: Arc<World>,
    pub(super) router: Arc<Router>,
    pub(super) decode: Arc<SimDecode>,
    /// The seeded controller; it moves the topology unless `topo` is a watcher.
    pub(super) controller: Arc<Controller>,
    pub(super) topo: Topo,
    pub(super) source: TargetSource,
    pub(super) fallback: FallbackPolicy,
    pub(super) scenario: SimRng,
    pub(super) wait_budget: Duration,
    pub(super) next_request: u64,
    pub(super) requests: Vec<JoinHandle<()>>,
}
