//! Conditional disaggregation on the router: off means every request prefills; a skip goes
//! to decode whole and is counted by reason; estimate and dispatch use one binding and one pick
//! even when a retarget lands between them.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::fakes::{target, FactoryLog, FakeDecode, ScriptFactory};
use crate::request::GenerateRequest;
use crate::router::{
    ConditionalPolicy, ConditionalSkip, PauseBeforeDispatch, PrefillRouter, PrefillRouterConfig,
    RouterMutant,
};

fn with_policy(policy: Option<ConditionalPolicy>) -> PrefillRouterConfig {
    PrefillRouterConfig {
        conditional: policy,
        ..PrefillRouterConfig::default()
    }
}

const SHORT_BELOW_10: ConditionalPolicy = ConditionalPolicy {
    min_uncached_tokens: Some(10),
    max_pool_tokens_per_worker: Some(50),
};

/// Serves a 3-token and a 20-token request on an Active router configured with `policy`, the
/// fake picks reporting a pool load of `load`; returns the log, the decode hop and the router.
async fn serve_two(
    policy: Option<ConditionalPolicy>,
    load: u64,
) -> (Arc<FactoryLog>, FakeDecode, PrefillRouter<ScriptFactory>) {
    let (factory, log) = ScriptFactory::instant();
    log.pool_load.store(load, Ordering::SeqCst);
    let router = PrefillRouter::new(factory, with_policy(policy));
    router.set_target(Some(target(1)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    let decode = FakeDecode::default();
    for len in [3, 20] {
        let _stream = router
            .generate(GenerateRequest::new(vec![1; len], 4), &decode)
            .await
            .unwrap();
    }
    (log, decode, router)
}

#[tokio::test]
async fn policy_off_prefills_every_request_and_never_estimates() {
    // Even with a saturated pool and a 3-token prompt: off is off.
    let (log, decode, router) = serve_two(None, u64::MAX).await;
    let counters = router.status().counters;
    assert_eq!(counters.prefilled, 2);
    assert!(counters.conditional_skips.values().all(|&n| n == 0));
    assert!(
        log.picks.lock().is_empty(),
        "no estimate with the policy off"
    );
    assert!(decode.calls.lock().iter().all(|(_, p)| p.is_some()));
}

#[tokio::test]
async fn a_short_prompt_goes_to_decode_whole_and_counts_as_conditional_short() {
    let (log, decode, router) = serve_two(Some(SHORT_BELOW_10), 0).await;
    let counters = router.status().counters;
    assert_eq!(counters.conditional_skips[&ConditionalSkip::Short], 1);
    assert_eq!(counters.conditional_skips[&ConditionalSkip::Busy], 0);
    assert_eq!(counters.prefilled, 1);
    let calls = decode.calls.lock();
    // The short request reached decode whole (no prefill outcome, its own max_tokens).
    assert_eq!(calls[0].0.token_ids.len(), 3);
    assert_eq!(calls[0].0.max_tokens, 4);
    assert!(calls[0].1.is_none());
    assert!(calls[1].1.is_some());
    // Only the long one was dispatched, on the pick of the binding that made it.
    assert_eq!(log.prefills.lock().len(), 1);
    assert_eq!(log.picks.lock().len(), 1);
}

#[tokio::test]
async fn a_saturated_pool_sends_long_prompts_to_decode_as_conditional_busy() {
    let (log, _decode, router) = serve_two(Some(SHORT_BELOW_10), 51).await;
    let counters = router.status().counters;
    assert_eq!(counters.conditional_skips[&ConditionalSkip::Short], 1);
    assert_eq!(counters.conditional_skips[&ConditionalSkip::Busy], 1);
    assert_eq!(counters.prefilled, 0);
    assert!(log.prefills.lock().is_empty());
}

/// One request is estimated on generation 1; the hook retargets to generation 2 and waits until
/// generation 2 is published before letting the dispatch go. Returns the picks' log.
async fn retarget_between_estimate_and_dispatch(
    reload_mutant: bool,
) -> Vec<(Option<crate::binding::WorkerSetTargetId>, u64)> {
    let (factory, log) = ScriptFactory::instant();
    let estimated = Arc::new(Notify::new());
    let go = Arc::new(Notify::new());
    let hook: PauseBeforeDispatch = {
        let (estimated, go) = (Arc::clone(&estimated), Arc::clone(&go));
        Arc::new(move || {
            let (estimated, go) = (Arc::clone(&estimated), Arc::clone(&go));
            Box::pin(async move {
                estimated.notify_one();
                go.notified().await;
            })
        })
    };
    let policy = ConditionalPolicy {
        min_uncached_tokens: Some(1),
        max_pool_tokens_per_worker: None,
    };
    let router = Arc::new(PrefillRouter::with_pause_before_dispatch(
        factory,
        with_policy(Some(policy)),
        hook,
        reload_mutant.then_some(RouterMutant::ReloadForDispatch),
    ));
    router.set_target(Some(target(1)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    let request = {
        let router = Arc::clone(&router);
        tokio::spawn(async move {
            let decode = FakeDecode::default();
            router
                .generate(GenerateRequest::new(vec![1; 20], 4), &decode)
                .await
                .map(|_| ())
        })
    };
    estimated.notified().await;
    router.set_target(Some(target(2)));
    tokio::time::timeout(Duration::from_secs(5), async {
        while router
            .route()
            .binding()
            .is_none_or(|b| b.target.generation != 2)
        {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("generation 2 published");
    go.notify_one();
    request.await.unwrap().unwrap();
    let picks = log.picks.lock();
    picks
        .iter()
        .map(|(origin, on)| (origin.clone(), on.generation))
        .collect()
}

#[tokio::test]
async fn a_retarget_between_estimate_and_dispatch_cannot_split_decision_and_dispatch() {
    let picks = retarget_between_estimate_and_dispatch(false).await;
    assert_eq!(picks.len(), 1);
    let (origin, on) = &picks[0];
    assert_eq!(origin.as_ref().map(|o| o.generation), Some(*on));
    assert_eq!(*on, 1, "dispatched on the binding that estimated it");
}

#[tokio::test]
async fn the_estimate_dispatch_check_catches_a_dispatch_that_reloads_the_binding() {
    // Upstream's W10 shape: decided on generation 1's pick, sent on generation 2.
    let picks = retarget_between_estimate_and_dispatch(true).await;
    assert_eq!(picks.len(), 1);
    let (origin, on) = &picks[0];
    assert_ne!(origin.as_ref().map(|o| o.generation), Some(*on));
}
