//! The conditional disaggregation policy in the simulated world, and its oracles.
//!
//! A run with [`SimConfig::conditional`](super::SimConfig::conditional) configures the router
//! with [`POLICY`]. Bindings report each request's probe here when the router picks
//! (`probed`), then either the dispatch on that pick (`dispatched`) or decode receiving the
//! request without a prefill (`decoded`) settles it. The oracles:
//!
//! - `conditional_skip_without_condition`: every request decode got without a prefill after a
//!   probe (a skip) had its condition true for the probe the loaded binding reported truthfully;
//! - `conditional_prefilled_and_skipped`: no request was both prefilled remotely and skipped;
//! - `conditional_probe_dispatch_split`: a pick is dispatched on the binding that made it;
//! - `conditional_skips_miscounted`: the router's skip counters, by reason, equal the skips
//!   decode saw (and are 0 with the policy off).

use super::oracle::Violation;
use super::world::World;
use prefill_router::binding::PrefillEstimate;
use prefill_router::router::{ConditionalPolicy, ConditionalSkip, RouterCounters};

/// The simulated policy: the requests' prompts are 4 to 96 tokens, so about a fifth are short;
/// a pool is busy past 3 prefills of average length per worker.
pub const POLICY: ConditionalPolicy = ConditionalPolicy {
    min_uncached_tokens: Some(24),
    max_pool_tokens_per_worker: Some(120),
};

fn broken(world: &World, request: u64, property: &'static str, detail: String) {
    world.violate(Violation::ConditionalBroken {
        request,
        property,
        detail,
    });
}

/// Binding `serial` picked for `request`; `truth` is the probe its state really gives.
pub(crate) fn probed(world: &World, request: u64, serial: u64, truth: PrefillEstimate) {
    world.with(|s| s.conditional.open.insert(request, (serial, truth)));
}

/// Binding `serial` dispatches `request` on a pick made by binding `origin`.
pub(crate) fn dispatched(world: &World, request: u64, origin: u64, serial: u64) {
    let skipped = world.with(|s| {
        s.conditional.open.remove(&request);
        s.conditional.dispatched.insert(request);
        s.conditional.skipped.contains(&request)
    });
    if origin != serial {
        let detail = format!("picked on binding #{origin}, dispatched on binding #{serial}");
        broken(world, request, "conditional_probe_dispatch_split", detail);
    }
    if skipped {
        let detail = "dispatched after decode got it as a skip".to_owned();
        broken(world, request, "conditional_prefilled_and_skipped", detail);
    }
}

/// Decode received `request`, with a prefill outcome or (`without_prefill`) without.
pub(crate) fn decoded(world: &World, request: u64, without_prefill: bool) {
    if !without_prefill {
        return;
    }
    // Picked and neither dispatched nor rerouted since: the router skipped it.
    let Some((serial, truth, policy, prefilled)) = world.with(|s| {
        let (serial, truth) = s.conditional.open.remove(&request)?;
        s.conditional.skipped.insert(request);
        let prefilled =
            s.conditional.dispatched.contains(&request) || s.prefilled.contains(&request);
        Some((serial, truth, s.conditional.policy, prefilled))
    }) else {
        return;
    };
    match policy.and_then(|p| p.decide(&truth)) {
        Some(reason) => world.with(|s| *s.conditional.seen.entry(reason).or_insert(0) += 1),
        None => broken(
            world,
            request,
            "conditional_skip_without_condition",
            format!(
                "skipped on binding #{serial} although {truth:?} meets no condition of {policy:?}"
            ),
        ),
    }
    if prefilled {
        let detail = "skipped after it was prefilled remotely".to_owned();
        broken(world, request, "conditional_prefilled_and_skipped", detail);
    }
}

/// End of run: the router's skip counters equal the skips decode saw, by reason.
pub(crate) fn check_counters(world: &World, counters: &RouterCounters) {
    let seen = world.with(|s| s.conditional.seen.clone());
    for reason in ConditionalSkip::ALL {
        let reported = counters
            .conditional_skips
            .get(&reason)
            .copied()
            .unwrap_or(0);
        let observed = seen.get(&reason).copied().unwrap_or(0);
        if reported != observed {
            let detail = format!("router counted {reported} {reason}, decode saw {observed}");
            broken(world, u64::MAX, "conditional_skips_miscounted", detail);
        }
    }
    world.with(|s| {
        s.stats.conditional_short = seen.get(&ConditionalSkip::Short).copied().unwrap_or(0);
        s.stats.conditional_busy = seen.get(&ConditionalSkip::Busy).copied().unwrap_or(0);
    });
}

/// The skips decode saw (bypasses the router counts apart from the snapshot's).
pub(crate) fn skips(world: &World) -> u64 {
    world.with(|s| s.conditional.seen.values().sum())
}

/// Whether decode got `request` as a skip (the healthy-request oracle accepts it).
pub(crate) fn was_skipped(world: &World, request: u64) -> bool {
    world.with(|s| s.conditional.skipped.contains(&request))
}
