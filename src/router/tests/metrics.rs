//! The Prometheus collector reports what `status()` reports.

use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;

use super::fakes::{target_with, FakeDecode, ScriptFactory, Step};
use crate::lifecycle::RetryPolicy;
use crate::request::GenerateRequest;
use crate::router::{FallbackPolicy, PrefillRouter, PrefillRouterConfig};

fn scrape(registry: &Registry) -> String {
    let mut text = String::new();
    encode(&mut text, registry).unwrap();
    text
}

fn has(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

#[tokio::test(start_paused = true)]
async fn metrics_report_lifecycle_activations_failures_bypasses_and_worker_health() {
    let (factory, _log) = ScriptFactory::new([Step::Fail("boom")]);
    let config = PrefillRouterConfig {
        name: "llama".into(),
        retry: RetryPolicy::fixed(Duration::from_secs(1)),
        fallback: FallbackPolicy::Decode,
        ..PrefillRouterConfig::default()
    };
    let router = PrefillRouter::new(factory, config);
    let mut registry = Registry::default();
    router.register_metrics(&mut registry);

    let decode = FakeDecode::default();
    let _bypassed = router
        .generate(GenerateRequest::new(vec![1], 4), &decode)
        .await;
    let admitted = tokio::sync::watch::channel(std::collections::BTreeSet::from([1, 2, 3])).1;
    router.set_target(Some(target_with(1, admitted)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    let _prefilled = router
        .generate(GenerateRequest::new(vec![1], 4), &decode)
        .await;

    let text = scrape(&registry);
    for line in [
        r#"prefill_router_lifecycle{router="llama",state="active"} 1"#,
        r#"prefill_router_lifecycle{router="llama",state="pending"} 0"#,
        r#"prefill_router_activations_total{router="llama"} 1"#,
        r#"prefill_router_build_failures_total{router="llama"} 1"#,
        r#"prefill_router_builds_started_total{router="llama"} 2"#,
        r#"prefill_router_bypassed_total{router="llama",reason="not_yet_targeted"} 1"#,
        r#"prefill_router_bypassed_total{router="llama",reason="building"} 0"#,
        r#"prefill_router_prefilled_total{router="llama"} 1"#,
        r#"prefill_router_retired_bindings_alive{router="llama"} 0"#,
    ] {
        assert!(has(&text, line), "missing {line:?} in\n{text}");
    }

    // The serving binding's health: the fake reports admitted - 1 open breakers and one
    // overload retry per prefill; every class has a line.
    let status = router.status();
    assert_eq!(status.health.open_breakers, 2);
    let text = scrape(&registry);
    for line in [
        r#"prefill_router_open_breakers{router="llama"} 2"#,
        r#"prefill_router_prefill_retries_total{router="llama",class="overloaded"} 1"#,
        r#"prefill_router_prefill_retries_total{router="llama",class="connection_refused"} 0"#,
        r#"prefill_router_prefill_retries_total{router="llama",class="deadline"} 0"#,
        r#"prefill_router_affinity_total{router="llama",outcome="hit"} 2"#,
        r#"prefill_router_affinity_total{router="llama",outcome="miss"} 3"#,
        r#"prefill_router_affinity_total{router="llama",outcome="repick"} 4"#,
        r#"prefill_router_affinity_evictions_total{router="llama"} 5"#,
        r#"prefill_router_affinity_expired_total{router="llama"} 6"#,
    ] {
        assert!(has(&text, line), "missing {line:?} in\n{text}");
    }

    // A registry outliving its router reports nothing for it (and does not keep it alive).
    let done = router.terminated();
    drop(router);
    done.await;
    assert!(!scrape(&registry).contains("prefill_router_lifecycle{"));
}
