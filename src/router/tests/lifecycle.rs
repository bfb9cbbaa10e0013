//! Activation, retargeting, reuse, clearing and the watch channel, through the adapter.

use std::time::Duration;

use super::fakes::{target, ScriptFactory, Step};
use crate::binding::WorkerSetTargetId;
use crate::lifecycle::Lifecycle;
use crate::router::{PrefillRouter, PrefillRouterConfig, WaitError};
use crate::snapshot::{BypassReason, Route};

fn router(factory: ScriptFactory) -> PrefillRouter<ScriptFactory> {
    PrefillRouter::new(factory, PrefillRouterConfig::default())
}

#[tokio::test]
async fn instant_factory_activates_and_subscribers_see_each_change() {
    let (factory, _log) = ScriptFactory::instant();
    let router = router(factory);
    let mut rx = router.subscribe();
    assert_eq!(*rx.borrow_and_update(), Lifecycle::Pending);
    assert_eq!(router.route().bypass(), Some(BypassReason::NotYetTargeted));
    router.set_target(Some(target(1)));
    tokio::time::timeout(
        Duration::from_secs(5),
        rx.wait_for(|l| *l == Lifecycle::Active),
    )
    .await
    .unwrap()
    .unwrap();
    let Route::Prefill(binding) = router.route() else {
        panic!("active without a binding")
    };
    assert_eq!(binding.target, WorkerSetTargetId::new("ns/prefill", 1));
    router.set_target(None);
    assert_eq!(
        *rx.borrow_and_update(),
        Lifecycle::Unavailable,
        "announced before returning"
    );
}

#[tokio::test]
async fn clearing_is_visible_to_the_next_route_when_set_target_returns() {
    let (factory, _log) = ScriptFactory::instant();
    let router = router(factory);
    router.set_target(Some(target(1)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    router.set_target(None);
    assert_eq!(router.route().bypass(), Some(BypassReason::NoTarget));
    assert_eq!(router.status().lifecycle, Lifecycle::Unavailable);
}

#[tokio::test]
async fn returning_to_the_held_target_reuses_its_binding_without_a_build() {
    let (factory, log) = ScriptFactory::instant();
    let router = router(factory);
    router.set_target(Some(target(1)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    router.set_target(None);
    router.set_target(Some(target(1)));
    assert!(router.route().is_prefill(), "reuse is synchronous");
    assert_eq!(log.calls(), 1);
    assert_eq!(router.status().counters.builds_started, 1);
}

#[tokio::test]
async fn retarget_retires_the_old_binding_and_builds_the_new_one() {
    let (factory, log) = ScriptFactory::instant();
    let router = router(factory);
    router.set_target(Some(target(1)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    router.set_target(Some(target(2)));
    assert!(
        !router.route().is_prefill(),
        "never the old binding after a retarget"
    );
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    let status = router.status();
    assert_eq!(status.held, Some(WorkerSetTargetId::new("ns/prefill", 2)));
    assert_eq!(status.counters.retired, 1);
    assert_eq!(status.counters.activations, 2);
    assert_eq!(
        log.bindings_live.get(),
        1,
        "the retired binding was dropped"
    );
}

#[tokio::test(start_paused = true)]
async fn superseded_slow_build_is_cancelled_and_never_published() {
    let (factory, log) = ScriptFactory::new([Step::After(Duration::from_secs(10))]);
    let router = router(factory);
    router.set_target(Some(target(1)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    router.set_target(Some(target(2)));
    router.wait_active(Duration::from_secs(1)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(20)).await;
    let status = router.status();
    assert_eq!(status.held, Some(WorkerSetTargetId::new("ns/prefill", 2)));
    assert_eq!(status.counters.activations, 1);
    assert!(log.tokens.lock()[0].is_cancelled());
    assert_eq!(log.builds_live.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn wait_active_times_out_while_pending_and_fails_after_shutdown() {
    let (factory, _log) = ScriptFactory::new([Step::Hang]);
    let router = router(factory);
    router.set_target(Some(target(1)));
    let err = router
        .wait_active(Duration::from_secs(3))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        WaitError::TimedOut {
            after: Duration::from_secs(3),
            lifecycle: Lifecycle::Pending
        }
    );
    let waiter = router.wait_active(Duration::from_secs(3600));
    let shut = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        router.shutdown();
    };
    let (result, ()) = tokio::join!(waiter, shut);
    assert_eq!(result, Err(WaitError::ShutDown));
}

#[tokio::test]
async fn config_and_debug_report_the_router_they_were_given() {
    let (factory, _log) = ScriptFactory::instant();
    let router = PrefillRouter::new(
        factory,
        PrefillRouterConfig {
            name: "model-x".into(),
            ..PrefillRouterConfig::default()
        },
    );
    assert_eq!(router.config().name, "model-x");
    // Debug shows the live status (operators log it), not an empty placeholder.
    let shown = format!("{router:?}");
    assert!(
        shown.starts_with("PrefillRouter") && shown.contains("model-x"),
        "{shown}"
    );
}
