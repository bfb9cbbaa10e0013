//! Where targets enter the router, with the oracle that a decision is visible the moment
//! `set_target` returns.

use std::sync::Arc;

use super::binding::SimFactory;
use super::config::Mutant;
use super::oracle::Violation;
use super::world::World;
use prefill_router::binding::WorkerSetTarget;
use prefill_router::router::PrefillRouter;
use prefill_router::snapshot::BypassReason;
use prefill_router::topology::TargetSink;

/// Record the decision (the dispatch oracles compare against it), call the router, then check
/// that its status and route show the decision at once.
pub(crate) fn set_target_checked(
    world: &World,
    router: &Arc<PrefillRouter<SimFactory>>,
    target: Option<WorkerSetTarget>,
) {
    let id = target.as_ref().map(|t| t.id.clone());
    world.with(|s| {
        s.stats.retargets += 1;
        s.desired = id.clone();
    });
    world.trace(&[14, id.as_ref().map_or(0, |i| i.generation)]);
    if world.mutant == Some(Mutant::DeferredSetTarget) {
        let router = Arc::clone(router);
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            router.set_target(target);
        });
        return;
    }
    // Not under any simulator lock: a retired binding may drop inside.
    router.set_target(target);
    let status = router.status();
    let route = router.route().bypass();
    let visible = if status.shut_down {
        // A shut-down router ignores targets for good.
        route == Some(BypassReason::ShutDown)
    } else {
        status.desired == id && (id.is_some() || route == Some(BypassReason::NoTarget))
    };
    if !visible {
        world.violate(Violation::SetTargetNotVisible {
            set: id,
            reported: status.desired,
        });
    }
}

/// The [`TargetSink`] the real topology watcher feeds.
pub(crate) struct CheckedSink {
    pub(crate) world: Arc<World>,
    pub(crate) router: Arc<PrefillRouter<SimFactory>>,
}

impl TargetSink for CheckedSink {
    fn set_target(&self, target: Option<WorkerSetTarget>) {
        set_target_checked(&self.world, &self.router, target);
    }
}
