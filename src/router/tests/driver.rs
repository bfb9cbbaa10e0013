//! The driver under reordered batches, and `set_target` from threads outside the runtime.

use std::time::Duration;

use super::fakes::{target, ScriptFactory, Step};
use crate::control::{Effect, Effects};
use crate::lifecycle::BuildId;
use crate::router::{PrefillRouter, PrefillRouterConfig};

fn batch(
    effects: impl IntoIterator<Item = Effect<crate::router::WorkerSetTarget>>,
) -> Effects<crate::router::WorkerSetTarget> {
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
