//! The replay's external-policy seam (`Policy::External`): an in-test router that routes by
//! the KV events it is fed finds the shared prefix, every pick it made is released once, and a
//! configuration it cannot run is refused with a typed error.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures_util::future::{BoxFuture, FutureExt};
use parking_lot::Mutex;
use prefill_router::router::ConditionalPolicy;
use prefill_router_tools::replay::{
    run, External, ExternalError, ExternalKvEvent, ExternalPolicy, ExternalRequest, ExternalRouter,
    ExternalSetup, Policy, ReplayConfig, ReplayError, Workload,
};

/// What the in-test routers saw, over every binding of a run.
#[derive(Default)]
struct Seen {
    selected: HashSet<u64>,
    released: Vec<u64>,
    /// Stored blocks whose tokens were not one whole block.
    bad_blocks: usize,
}

/// Routes to the routable worker holding the longest prefix of the prompt per its events
/// (ties: the lowest id).
struct FollowEvents {
    block: u32,
    held: Mutex<HashMap<u64, HashSet<u64>>>,
    seen: Arc<Mutex<Seen>>,
}

impl ExternalRouter for FollowEvents {
    fn apply_events(&self, worker: u64, events: &[ExternalKvEvent]) {
        let mut held = self.held.lock();
        let blocks = held.entry(worker).or_default();
        for event in events {
            match event {
                ExternalKvEvent::Stored { blocks: stored, .. } => {
                    for b in stored {
                        if b.tokens.len() != self.block as usize {
                            self.seen.lock().bad_blocks += 1;
                        }
                        blocks.insert(b.hash);
                    }
                }
                ExternalKvEvent::Removed { blocks: removed } => {
                    for h in removed {
                        blocks.remove(h);
                    }
                }
                ExternalKvEvent::Cleared => blocks.clear(),
            }
        }
    }

    fn select(
        &self,
        request: ExternalRequest,
        routable: Vec<u64>,
    ) -> BoxFuture<'_, Result<u64, ExternalError>> {
        let keys = prefill_router::push::block_hashes(&request.tokens, self.block);
        let held = self.held.lock();
        let overlap = |w: &u64| {
            let blocks = held.get(w);
            keys.iter()
                .take_while(|k| blocks.is_some_and(|b| b.contains(k)))
                .count()
        };
        let pick = routable
            .iter()
            .copied()
            .max_by_key(|w| (overlap(w), std::cmp::Reverse(*w)))
            .ok_or(ExternalError::NoWorker);
        self.seen.lock().selected.insert(request.id);
        futures_util::future::ready(pick).boxed()
    }

    fn release(&self, id: u64) -> BoxFuture<'_, Result<(), ExternalError>> {
        self.seen.lock().released.push(id);
        futures_util::future::ready(Ok(())).boxed()
    }
}

struct FollowEventsPolicy(Arc<Mutex<Seen>>);

impl ExternalPolicy for FollowEventsPolicy {
    fn name(&self) -> &str {
        "follow-events"
    }

    fn router(&self, setup: &ExternalSetup) -> Result<Arc<dyn ExternalRouter>, ExternalError> {
        Ok(Arc::new(FollowEvents {
            block: setup.block_tokens,
            held: Mutex::default(),
            seen: Arc::clone(&self.0),
        }))
    }
}

#[test]
fn an_external_router_fed_the_events_finds_the_prefix_and_releases_every_pick_once() {
    let trace = Workload::parse("multi-tenant:rate=8,requests=300")
        .expect("spec")
        .generate();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let config = ReplayConfig {
        external: Some(External::new(FollowEventsPolicy(Arc::clone(&seen)))),
        ..ReplayConfig::new(Policy::External)
    };
    let report = run(&config, &trace).expect("replay");
    let round_robin = run(&ReplayConfig::new(Policy::RoundRobin), &trace).expect("replay");
    assert_eq!(report.policy, "follow-events");
    assert_eq!((report.requests, report.lost), (300, 0));
    // The events reach it: following them beats round robin by far on shared system prompts.
    assert!(
        report.prefix_hit_rate > round_robin.prefix_hit_rate + 0.05,
        "{} vs round robin {}",
        report.prefix_hit_rate,
        round_robin.prefix_hit_rate
    );
    let seen = seen.lock();
    assert_eq!(seen.bad_blocks, 0);
    assert_eq!(seen.selected.len(), 300);
    let mut released = seen.released.clone();
    released.sort_unstable();
    released.dedup();
    assert_eq!(released.len(), seen.released.len(), "a pick released twice");
    assert_eq!(
        released.into_iter().collect::<HashSet<_>>(),
        seen.selected,
        "every pick released"
    );
}

#[test]
fn an_external_policy_without_its_router_or_with_conditional_disaggregation_is_refused() {
    let trace = Workload::parse("shared-prefix:rate=5,requests=10")
        .expect("spec")
        .generate();
    let missing = run(&ReplayConfig::new(Policy::External), &trace);
    assert!(matches!(
        missing,
        Err(ReplayError::External(ExternalError::Missing))
    ));
    let conditional = ReplayConfig {
        external: Some(External::new(FollowEventsPolicy(Arc::default()))),
        conditional: Some(ConditionalPolicy::default()),
        ..ReplayConfig::new(Policy::External)
    };
    assert!(matches!(
        run(&conditional, &trace),
        Err(ReplayError::External(ExternalError::Conditional))
    ));
}
