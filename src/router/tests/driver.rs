//! The driver under reordered batches, and `set_target` from threads outside the runtime.

use std::time::Duration;

use super::fakes::{target, ScriptFactory, Step};
use crate::control::{Effect, Effects};
use crate::lifecycle::{BuildId, RetryPolicy};
use crate::router::{PrefillRouter, PrefillRouterConfig};

fn batch(
    effects: impl IntoIterator<Item = Effect<crate::binding::WorkerSetTarget>>,
) -> Effects<crate::binding::WorkerSetTarget> {
    let mut out = Effects::default();
    for effect in effects {
        out.push(effect);
    }
    out
}

async fn settle() {
    // Let the driver drain its channel (current-thread runtime: it runs while we sleep).
    tokio::time::sleep(Duration::from_millis(50)).await;
}

#[tokio::test]
async fn a_cancel_that_overtakes_its_start_keeps_the_build_from_ever_starting() {
    let (factory, log) = ScriptFactory::new([Step::Hang, Step::Hang]);
    let router = PrefillRouter::new(factory, PrefillRouterConfig::default());
    router.inject(batch([Effect::CancelBuild { build: BuildId(1) }]));
    router.inject(batch([Effect::StartBuild {
        build: BuildId(1),
        target: target(1),
    }]));
    settle().await;
    assert_eq!(log.calls(), 0);
    assert_eq!(router.status().counters.builds_started, 0);
}

#[tokio::test]
async fn a_start_overtaken_by_a_later_start_is_stale_and_skipped() {
    let (factory, log) = ScriptFactory::new([Step::Hang, Step::Hang]);
    let router = PrefillRouter::new(factory, PrefillRouterConfig::default());
    router.inject(batch([Effect::StartBuild {
        build: BuildId(2),
        target: target(2),
    }]));
    router.inject(batch([Effect::StartBuild {
        build: BuildId(1),
        target: target(1),
    }]));
    settle().await;
    assert_eq!(log.calls(), 1);
    assert_eq!(log.calls.lock()[0].0.generation, 2);
    // Build 1's cancellation, arriving late, leaves build 2 running; build 2's own ends it.
    router.inject(batch([Effect::CancelBuild { build: BuildId(1) }]));
    settle().await;
    assert_eq!(log.builds_live.get(), 1);
    router.inject(batch([Effect::CancelBuild { build: BuildId(2) }]));
    settle().await;
    assert_eq!(log.builds_live.get(), 0);
    assert!(log.tokens.lock()[0].is_cancelled());
}

/// A router retrying failed builds after exactly 1 s (no jitter).
fn retrying_router(
    steps: impl IntoIterator<Item = Step>,
) -> (
    PrefillRouter<ScriptFactory>,
    std::sync::Arc<super::fakes::FactoryLog>,
) {
    let (factory, log) = ScriptFactory::new(steps);
    let config = PrefillRouterConfig {
        retry: RetryPolicy::fixed(Duration::from_secs(1)),
        retry_jitter: 0.0,
        ..PrefillRouterConfig::default()
    };
    (PrefillRouter::new(factory, config), log)
}

/// A year: a retry this far away never fires within a test.
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

#[tokio::test(start_paused = true)]
async fn late_cancel_retry_never_disarms_the_live_retry() {
    let (router, log) = retrying_router([Step::Fail("boom"), Step::Fail("boom")]);
    router.set_target(Some(target(1)));
    // Build 1 fails, its retry starts build 2 at 1 s, which fails: the live retry follows 2.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(log.calls(), 2);
    assert!(router.status().retry_armed);
    // Build 1's retry cancellation, reordered behind build 2's schedule.
    router.inject(batch([Effect::CancelRetry { after: BuildId(1) }]));
    router
        .wait_active(Duration::from_secs(10))
        .await
        .expect("the live retry still fires and its build activates");
    assert_eq!(log.calls(), 3);
}

#[tokio::test(start_paused = true)]
async fn late_schedule_retry_never_replaces_the_live_retry() {
    let (router, log) = retrying_router([Step::Fail("boom"), Step::Fail("boom")]);
    router.set_target(Some(target(1)));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(log.calls(), 2);
    // Build 1's schedule, reordered behind build 2's: stale, it must not re-arm the timer.
    router.inject(batch([Effect::ScheduleRetry {
        after: BuildId(1),
        delay: NEVER,
        attempt: 1,
    }]));
    router
        .wait_active(Duration::from_secs(10))
        .await
        .expect("the live retry still fires");
    assert_eq!(log.calls(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_cancel_retry_that_overtakes_its_schedule_keeps_that_retry_from_ever_arming() {
    let (router, log) = retrying_router([Step::Fail("boom")]);
    router.set_target(Some(target(1)));
    settle().await;
    assert_eq!(log.calls(), 1);
    assert!(router.status().retry_armed);
    // Retry 2's cancel arrives before its schedule: the schedule is dead on arrival, and the
    // armed retry (after build 1) is neither disarmed nor displaced by either.
    router.inject(batch([Effect::CancelRetry { after: BuildId(2) }]));
    router.inject(batch([Effect::ScheduleRetry {
        after: BuildId(2),
        delay: NEVER,
        attempt: 2,
    }]));
    router
        .wait_active(Duration::from_secs(10))
        .await
        .expect("the armed retry still fires");
    assert_eq!(log.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_finished_build_leaves_the_other_running_build_cancellable() {
    let (factory, log) = ScriptFactory::new([Step::After(Duration::from_secs(1)), Step::Hang]);
    let router = PrefillRouter::new(factory, PrefillRouterConfig::default());
    router.set_target(Some(target(1)));
    settle().await;
    // A second build runs beside the first (as it briefly does while a cancel is on its way).
    router.inject(batch([Effect::StartBuild {
        build: BuildId(2),
        target: target(2),
    }]));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    assert_eq!(log.calls(), 2);
    assert_eq!(log.builds_live.get(), 1, "build 2 still running");
    // Build 1's completion must have forgotten build 1 only: build 2 is still cancellable.
    router.inject(batch([Effect::CancelBuild { build: BuildId(2) }]));
    settle().await;
    assert_eq!(log.builds_live.get(), 0, "build 2's future was dropped");
    let tokens = log.tokens.lock();
    assert!(tokens[1].is_cancelled());
    assert!(
        !tokens[0].is_cancelled(),
        "the built binding keeps its token"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_target_works_from_threads_outside_the_runtime_and_converges() {
    let (factory, log) = ScriptFactory::instant();
    let router = std::sync::Arc::new(PrefillRouter::new(factory, PrefillRouterConfig::default()));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let router = router.clone();
            std::thread::spawn(move || {
                for i in 0..500u64 {
                    let generation = 1 + (i * 7 + t * 3) % 20;
                    router.set_target((i % 5 != 0).then(|| target(generation)));
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("controller thread");
    }
    router.set_target(Some(target(99)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        // Eventually: a build task may still be between its future's end and its report.
        while log.builds_live.get() != 0 || log.bindings_live.get() != 1 || router.tasks_alive() != 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("no build task, build future or stale binding left (only the driver and the active binding)");
    let status = router.status();
    assert_eq!(status.build_in_flight, None);
    assert!(!status.retry_armed);
    assert_eq!(
        log.bindings_live.get(),
        1,
        "only the active binding is alive"
    );
}
