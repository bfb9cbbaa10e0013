//! The request path: prefill then decode when Active, and each fallback policy otherwise.

use std::collections::BTreeSet;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;

use super::fakes::{target, target_with, FakeDecode, ScriptFactory, Step};
use crate::binding::PrefillError;
use crate::push::PushError;
use crate::request::{GenerateRequest, PrefillInfo};
use crate::router::{AfterWait, FallbackPolicy, GenerateError, PrefillRouter, PrefillRouterConfig};
use crate::snapshot::BypassReason;

fn router(factory: ScriptFactory, fallback: FallbackPolicy) -> PrefillRouter<ScriptFactory> {
    PrefillRouter::new(
        factory,
        PrefillRouterConfig {
            fallback,
            ..PrefillRouterConfig::default()
        },
    )
}

fn request() -> GenerateRequest {
    GenerateRequest::new(vec![1, 2, 3, 4], 8)
}

#[tokio::test]
async fn active_hop_prefills_one_token_then_decodes_the_original_request() {
    let (factory, _log) = ScriptFactory::instant();
    let router = router(factory, FallbackPolicy::Reject);
    router.set_target(Some(target(1)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    let decode = FakeDecode::default();
    let mut stream = router.generate(request(), &decode).await.unwrap();
    let response = stream.next().await.unwrap().unwrap();
    assert_eq!(
        response.token_ids.len(),
        8,
        "decode got the original max_tokens"
    );
    let calls = decode.calls.lock();
    let (sent, outcome) = &calls[0];
    let outcome = outcome.as_ref().expect("decode got the prefill outcome");
    assert_eq!(outcome.worker, 1);
    assert_eq!(sent.handoff, outcome.handoff, "handoff carried to decode");
    assert_eq!(sent.handoff.as_ref().unwrap().prompt_tokens, 4);
    assert_eq!(router.status().counters.prefilled, 1);
}

#[tokio::test]
async fn a_client_supplied_handoff_never_reaches_the_prefill_worker() {
    let (factory, log) = ScriptFactory::instant();
    let router = router(factory, FallbackPolicy::Reject);
    router.set_target(Some(target(1)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    // A client claiming KV blocks already sit on worker 99.
    let forged = PrefillInfo {
        engine_params: None,
        worker: 99,
        prompt_tokens: 1_000,
        cached_blocks: 50,
        block_size: 64,
    };
    let forging = GenerateRequest {
        handoff: Some(forged.clone()),
        ..request()
    };
    let decode = FakeDecode::default();
    let _stream = router.generate(forging, &decode).await.unwrap();
    let prefills = log.prefills.lock();
    assert_eq!(prefills.len(), 1);
    assert_eq!(prefills[0].handoff, None, "the prefill leg never sees it");
    assert_eq!(prefills[0].token_ids, request().token_ids);
    assert_eq!(prefills[0].max_tokens, 1);
    let calls = decode.calls.lock();
    let handoff = calls[0].0.handoff.as_ref().expect("decode gets a handoff");
    assert_ne!(*handoff, forged, "decode gets the prefill worker's handoff");
    assert_eq!(handoff.worker, 1);
}

#[tokio::test]
async fn decode_policy_bypasses_and_counts_each_bypass_by_reason() {
    let (factory, _log) = ScriptFactory::new([Step::Hang]);
    let router = router(factory, FallbackPolicy::Decode);
    let decode = FakeDecode::default();
    let _stream = router.generate(request(), &decode).await.unwrap();
    router.set_target(Some(target(1)));
    let _stream = router.generate(request(), &decode).await.unwrap();
    let _stream = router.generate(request(), &decode).await.unwrap();
    router.set_target(None);
    let _stream = router.generate(request(), &decode).await.unwrap();
    let calls = decode.calls.lock();
    assert_eq!(calls.len(), 4);
    assert!(calls
        .iter()
        .all(|(r, o)| o.is_none() && r.handoff.is_none() && r.max_tokens == 8));
    let c = router.status().counters;
    assert_eq!(c.bypassed[&BypassReason::NotYetTargeted], 1);
    assert_eq!(c.bypassed[&BypassReason::Building], 2);
    assert_eq!(c.bypassed[&BypassReason::NoTarget], 1);
    assert_eq!(c.prefilled, 0);
}

#[tokio::test]
async fn reject_policy_fails_with_not_activated_and_sends_nothing() {
    let (factory, _log) = ScriptFactory::new([Step::Hang]);
    let router = router(factory, FallbackPolicy::Reject);
    let decode = FakeDecode::default();
    router.set_target(Some(target(1)));
    let err = router.generate(request(), &decode).await.err().unwrap();
    assert_eq!(
        err,
        GenerateError::NotActivated {
            reason: BypassReason::Building
        }
    );
    assert!(decode.calls.lock().is_empty());
    assert_eq!(
        router.status().counters.rejected[&BypassReason::Building],
        1
    );
}

#[tokio::test(start_paused = true)]
async fn wait_policy_prefills_once_the_hop_activates_within_the_wait() {
    let (factory, _log) = ScriptFactory::new([Step::After(Duration::from_secs(2))]);
    let policy = FallbackPolicy::WaitUpTo {
        timeout: Duration::from_secs(5),
        then: AfterWait::Reject,
    };
    let router = router(factory, policy);
    router.set_target(Some(target(1)));
    let decode = FakeDecode::default();
    let started = tokio::time::Instant::now();
    let _stream = router.generate(request(), &decode).await.unwrap();
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(2),
        "waited exactly for the build"
    );
    assert!(decode.calls.lock()[0].1.is_some(), "prefilled");
    let c = router.status().counters;
    assert_eq!((c.waited, c.prefilled), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn wait_policy_applies_its_then_clause_at_the_deadline() {
    for then in [AfterWait::Reject, AfterWait::Decode] {
        let (factory, _log) = ScriptFactory::new([Step::Hang]);
        let policy = FallbackPolicy::WaitUpTo {
            timeout: Duration::from_secs(5),
            then,
        };
        let router = router(factory, policy);
        router.set_target(Some(target(1)));
        let decode = FakeDecode::default();
        let started = tokio::time::Instant::now();
        let result = router.generate(request(), &decode).await;
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        let c = router.status().counters;
        match then {
            AfterWait::Reject => {
                assert!(matches!(
                    result,
                    Err(GenerateError::NotActivated {
                        reason: BypassReason::Building
                    })
                ));
                assert!(decode.calls.lock().is_empty());
                assert_eq!(c.rejected[&BypassReason::Building], 1);
            }
            AfterWait::Decode => {
                assert!(result.is_ok());
                assert!(decode.calls.lock()[0].1.is_none(), "bypassed");
                assert_eq!(c.bypassed[&BypassReason::Building], 1);
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn wait_policy_does_not_wait_after_shutdown() {
    let (factory, _log) = ScriptFactory::instant();
    let policy = FallbackPolicy::WaitUpTo {
        timeout: Duration::from_secs(60),
        then: AfterWait::Reject,
    };
    let router = router(factory, policy);
    router.shutdown();
    let started = tokio::time::Instant::now();
    let err = router
        .generate(request(), &FakeDecode::default())
        .await
        .err();
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(
        err,
        Some(GenerateError::NotActivated {
            reason: BypassReason::ShutDown
        })
    );
}

#[tokio::test]
async fn prefill_error_fails_the_request_and_decode_is_not_tried() {
    // A binding with no routable worker is the one prefill failure the fallback policy
    // handles; under Reject it fails the request as any prefill error does.
    let (factory, _log) = ScriptFactory::instant();
    let router = router(factory, FallbackPolicy::Reject);
    let (_tx, empty) = watch::channel(BTreeSet::new());
    router.set_target(Some(target_with(1, empty)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    let decode = FakeDecode::default();
    let err = router.generate(request(), &decode).await.err().unwrap();
    assert_eq!(err, GenerateError::Prefill(PrefillError::NoRoutableWorker));
    assert!(decode.calls.lock().is_empty());
    let c = router.status().counters;
    assert_eq!(
        (c.prefilled, c.prefill_errors, c.unreachable_bypassed),
        (1, 1, 0)
    );
}

#[tokio::test]
async fn a_prefill_with_no_reachable_worker_bypasses_when_the_policy_does() {
    for policy in [
        FallbackPolicy::Decode,
        FallbackPolicy::WaitUpTo {
            timeout: Duration::from_secs(60),
            then: AfterWait::Decode,
        },
    ] {
        let (factory, _log) = ScriptFactory::instant();
        let router = router(factory, policy);
        let (_tx, empty) = watch::channel(BTreeSet::new());
        router.set_target(Some(target_with(1, empty)));
        router.wait_active(Duration::from_secs(5)).await.unwrap();
        let decode = FakeDecode::default();
        let stream =
            tokio::time::timeout(Duration::from_secs(5), router.generate(request(), &decode))
                .await
                .expect("no wait: the pool was there and is gone")
                .unwrap();
        drop(stream);
        assert_eq!(decode.calls.lock().len(), 1, "decode ran the whole request");
        let c = router.status().counters;
        assert_eq!(
            (c.prefilled, c.prefill_errors, c.unreachable_bypassed),
            (1, 0, 1),
            "{policy:?}"
        );
    }
}

#[test]
fn only_failures_to_reach_any_worker_count_as_no_reachable_worker() {
    use crate::health::FailureClass;
    use crate::push::Attempt;
    let refused = |instance| Attempt {
        instance,
        class: FailureClass::ConnectionRefused,
        error: PushError::InstanceGone(instance),
    };
    let rejected = Attempt {
        instance: 3,
        class: FailureClass::Rejected,
        error: PushError::Timeout { instance: 3 },
    };
    let no = |e: PushError| PrefillError::from(e).no_reachable_worker();
    assert_eq!(
        PrefillError::from(PushError::NoRoutableInstances),
        PrefillError::NoRoutableWorker
    );
    assert!(PrefillError::NoRoutableWorker.no_reachable_worker());
    assert!(no(PushError::NoRoutableInstances));
    assert!(no(PushError::Exhausted {
        attempts: vec![refused(1), refused(2)]
    }));
    assert!(!no(PushError::Exhausted {
        attempts: vec![refused(1), rejected]
    }));
    assert!(!no(PushError::Timeout { instance: 1 }));
    assert!(!PrefillError::NoResponse.no_reachable_worker());
}

#[tokio::test]
async fn generate_future_is_send_so_servers_can_spawn_it() {
    fn assert_send<T: Send>(value: T) -> T {
        value
    }
    let (factory, _log) = ScriptFactory::instant();
    let router = router(factory, FallbackPolicy::Decode);
    let decode = FakeDecode::default();
    let future = assert_send(router.generate(request(), &decode));
    assert!(future.await.is_ok());
}
