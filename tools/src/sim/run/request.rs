//! One request through the real request path, under the deadline oracle, and the accounting
//! the router's counters must agree with.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;

use super::super::binding::SimDecode;
use super::super::config::timing;
use super::super::oracle::Violation;
use super::super::world::World;
use super::state::{Router, Run};
use prefill_router::binding::PrefillError;
use prefill_router::request::GenerateRequest;
use prefill_router::router::GenerateError;

/// How a request ended (the deadline oracle has already judged hangs).
#[derive(Debug)]
enum Outcome {
    Completed {
        prefilled: bool,
    },
    Rejected,
    /// The binding had no routable worker (empty admission, all down): failed fast.
    Unroutable,
    PrefillFailed(String),
    DecodeFailed(String),
    Hung,
}

impl Outcome {
    /// The outcome's code in the run's trace (and so its digest).
    fn code(&self) -> u64 {
        match self {
            Outcome::Completed { prefilled: true } => 1,
            Outcome::Completed { prefilled: false } => 2,
            Outcome::Rejected => 3,
            Outcome::PrefillFailed(_) => 4,
            Outcome::DecodeFailed(_) => 5,
            Outcome::Hung => 6,
            Outcome::Unroutable => 7,
        }
    }
}

impl Run {
    /// The next seeded request and its deadline (long enough for any fallback wait, a prefill
    /// and every decode token at the slowest simulated pace).
    fn request(&mut self) -> (u64, GenerateRequest, Duration) {
        let id = self.next_request;
        self.next_request += 1;
        let len = self.scenario.between(4, 96);
        let base = self.scenario.below(4) as u32 * 1000;
        let tokens: Vec<u32> = (0..len as u32).map(|t| base + t).collect();
        let max_tokens = self.scenario.between(1, u64::from(timing::MAX_TOKENS)) as u32;
        let request = GenerateRequest {
            token_ids: tokens,
            max_tokens,
            request_id: Some(id),
            session: self
                .world
                .with(|s| s.sessions.on)
                .then(|| super::super::sessions::draw(&self.world, id))
                .flatten(),
            ..GenerateRequest::default()
        };
        let deadline = self.wait_budget
            + timing::PREFILL_TIMEOUT
            + Duration::from_millis(u64::from(max_tokens) * timing::TOKEN_MAX_MS)
            + timing::DEADLINE_SLACK;
        (id, request, deadline)
    }

    /// Send the next request on a task of its own.
    pub(super) fn spawn_request(&mut self) {
        let (id, request, deadline) = self.request();
        self.world.with(|s| s.stats.requests += 1);
        let world = Arc::clone(&self.world);
        let router = Arc::clone(&self.router);
        let decode = Arc::clone(&self.decode);
        self.requests.push(tokio::spawn(async move {
            let outcome = serve(&world, &router, &decode, id, request, deadline).await;
            world.trace(&[20, id, outcome.code()]);
        }));
    }

    /// Oracle: once converged with admitted workers up and no faults, a request prefills and
    /// completes.
    pub(super) async fn healthy_request(&mut self) {
        if self.router.load().target().is_none() || self.admitted_now().is_empty() {
            return;
        }
        let (id, request, deadline) = self.request();
        self.world.with(|s| s.stats.requests += 1);
        let outcome = serve(
            &self.world,
            &self.router,
            &self.decode,
            id,
            request,
            deadline,
        )
        .await;
        // A conditional skip is a healthy outcome too (its own oracles judge it).
        let skipped = super::super::conditional::was_skipped(&self.world, id);
        if !matches!(outcome, Outcome::Completed { prefilled: true }) && !skipped {
            self.world.violate(Violation::HealthyRequestFailed {
                outcome: format!("{outcome:?}"),
            });
        }
    }
}

/// One request through the real request path, under the deadline oracle.
async fn serve(
    world: &World,
    router: &Router,
    decode: &SimDecode,
    id: u64,
    request: GenerateRequest,
    deadline: Duration,
) -> Outcome {
    let work = async {
        match router.generate(request, decode).await {
            Ok(mut stream) => {
                while let Some(item) = stream.next().await {
                    if let Err(e) = item {
                        return Outcome::DecodeFailed(e.to_string());
                    }
                }
                let prefilled = world.with(|s| s.prefilled.contains(&id));
                Outcome::Completed { prefilled }
            }
            Err(GenerateError::NotActivated { .. }) => Outcome::Rejected,
            Err(GenerateError::Prefill(PrefillError::NoRoutableWorker)) => Outcome::Unroutable,
            Err(GenerateError::Prefill(e)) => Outcome::PrefillFailed(e.to_string()),
            Err(e) => Outcome::DecodeFailed(e.to_string()),
        }
    };
    let outcome = match tokio::time::timeout(deadline, work).await {
        Ok(outcome) => outcome,
        Err(_) => {
            world.violate(Violation::RequestHung {
                request: id,
                deadline,
            });
            Outcome::Hung
        }
    };
    tally(world, id, &outcome);
    if let Outcome::PrefillFailed(why) | Outcome::DecodeFailed(why) = &outcome {
        tracing::debug!(request = id, %why, "simulated request failed");
    }
    outcome
}

/// The accounting the router's counters must agree with (see [`check_counters`]).
fn tally(world: &World, id: u64, outcome: &Outcome) {
    world.with(|s| {
        let prefilled = s.prefilled.remove(&id);
        let stats = &mut s.stats;
        stats.prefill_calls += u64::from(prefilled);
        match outcome {
            Outcome::Completed { prefilled: true } => stats.prefilled_ok += 1,
            Outcome::Completed { prefilled: false } => stats.bypassed_ok += 1,
            Outcome::Rejected => stats.rejected += 1,
            Outcome::Unroutable => stats.unroutable += 1,
            Outcome::PrefillFailed(_) => stats.prefill_failed += 1,
            Outcome::DecodeFailed(_) => stats.decode_failed += 1,
            Outcome::Hung => {}
        }
        if !prefilled
            && matches!(
                outcome,
                Outcome::Completed { .. } | Outcome::DecodeFailed(_)
            )
        {
            stats.bypass_calls += 1;
        }
    });
}

/// Oracle: with every request ended, the router's request counters agree with what the
/// requests saw (each request counted once, under the path it took).
pub(super) fn check_counters(world: &World, router: &Router) {
    let (stats, hung) = world.with(|s| {
        let hung = s.violations.iter().any(|v| v.kind() == "request_hung");
        (s.stats.clone(), hung)
    });
    if hung {
        // A request cut off by its deadline may have been counted before it hung.
        return;
    }
    let counters = router.status().counters;
    let pairs = [
        ("prefilled", counters.prefilled, stats.prefill_calls),
        (
            "prefill_errors",
            counters.prefill_errors,
            stats.prefill_failed + stats.unroutable,
        ),
        (
            "bypassed",
            // Conditional skips go to decode without prefill too, counted apart.
            counters.bypassed.values().sum::<u64>() + super::super::conditional::skips(world),
            stats.bypass_calls,
        ),
        ("rejected", counters.rejected.values().sum(), stats.rejected),
    ];
    super::super::conditional::check_counters(world, &counters);
    for (counter, reported, observed) in pairs {
        if reported != observed {
            world.violate(Violation::CountersDisagree {
                counter,
                reported,
                observed,
            });
        }
    }
}
