//! After `shutdown()` or Drop, every task the router spawned has ended, and nothing it built
//! outlives it (except bindings that requests still hold).

use std::time::Duration;

use super::fakes::{target, ScriptFactory, Step};
use crate::binding::Binding;
use crate::lifecycle::RetryPolicy;
use crate::request::GenerateRequest;
use crate::router::{PrefillRouter, PrefillRouterConfig};
use crate::snapshot::{BypassReason, Route};

const BOUND: Duration = Duration::from_secs(5);

async fn until(mut ready: impl FnMut() -> bool) {
    tokio::time::timeout(BOUND, async {
        while !ready() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("condition not reached in time");
}

#[tokio::test]
async fn drop_ends_every_task_even_with_a_hanging_build() {
    let (factory, log) = ScriptFactory::new([Step::Hang]);
    let router = PrefillRouter::new(factory, PrefillRouterConfig::default());
    router.set_target(Some(target(1)));
    until(|| log.builds_live.get() == 1).await;
    assert_eq!(router.tasks_alive(), 2, "driver and one build");
    let done = router.terminated();
    drop(router);
    tokio::time::timeout(BOUND, done)
        .await
        .expect("tasks ended");
    assert_eq!(
        log.builds_live.get(),
        0,
        "the hung build future was dropped"
    );
    assert!(log.tokens.lock()[0].is_cancelled());
}

#[tokio::test(start_paused = true)]
async fn drop_with_a_retry_armed_ends_the_timer_and_starts_nothing_later() {
    let (factory, log) = ScriptFactory::new([Step::Fail("boom")]);
    let config = PrefillRouterConfig {
        retry: RetryPolicy::fixed(Duration::from_secs(1)),
        ..PrefillRouterConfig::default()
    };
    let router = PrefillRouter::new(factory, config);
    router.set_target(Some(target(1)));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(router.status().retry_armed);
    let done = router.terminated();
    drop(router);
    tokio::time::timeout(BOUND, done)
        .await
        .expect("tasks ended");
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(log.calls(), 1, "no retry after drop");
}

#[tokio::test]
async fn shutdown_ends_every_task_and_leaves_held_bindings_usable_until_released() {
    let (factory, log) = ScriptFactory::instant();
    let router = PrefillRouter::new(factory, PrefillRouterConfig::default());
    router.set_target(Some(target(1)));
    router.wait_active(BOUND).await.unwrap();
    let Route::Prefill(held) = router.route() else {
        panic!("not active")
    };
    router.shutdown();
    tokio::time::timeout(BOUND, router.terminated())
        .await
        .expect("tasks ended");
    assert_eq!(router.tasks_alive(), 0);
    assert_eq!(router.route().bypass(), Some(BypassReason::ShutDown));
    assert!(router.status().shut_down);

    // A request that held the binding finishes on it.
    assert!(held.prefill(GenerateRequest::new(vec![1], 1)).await.is_ok());
    drop(held);
    assert_eq!(
        log.bindings_live.get(),
        0,
        "the retired binding went with its last holder"
    );

    // Nothing starts after shutdown.
    router.set_target(Some(target(2)));
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(log.calls(), 1);
    assert_eq!(router.route().bypass(), Some(BypassReason::ShutDown));
}

#[tokio::test]
async fn dropping_an_untargeted_router_ends_its_driver() {
    let (factory, _log) = ScriptFactory::instant();
    let router = PrefillRouter::new(factory, PrefillRouterConfig::default());
    assert_eq!(router.tasks_alive(), 1);
    let done = router.terminated();
    drop(router);
    tokio::time::timeout(BOUND, done)
        .await
        .expect("driver ended");
}
