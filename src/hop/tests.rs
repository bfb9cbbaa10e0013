//! The readiness rule against the fallback policy (the hop over real workers is tested in
//! `tools/tests/prefill_e2e/hop.rs`, with the mock engines).

use std::time::Duration;

use super::*;
use crate::lifecycle::Lifecycle;
use crate::router::FallbackPolicy;

#[test]
fn readiness_rule_matches_the_fallback_policy() {
    use status::readiness;
    let wait = |then| FallbackPolicy::WaitUpTo {
        timeout: Duration::from_millis(1),
        then,
    };
    for lifecycle in [Lifecycle::Pending, Lifecycle::Unavailable] {
        assert!(readiness(lifecycle, true, FallbackPolicy::Decode, false, None).is_ready());
        assert!(readiness(
            lifecycle,
            true,
            wait(crate::router::AfterWait::Decode),
            false,
            None
        )
        .is_ready());
        for policy in [
            FallbackPolicy::Reject,
            wait(crate::router::AfterWait::Reject),
        ] {
            assert_eq!(
                readiness(lifecycle, true, policy, false, None),
                Readiness::NotReady(NotReady::PrefillNotActive { lifecycle })
            );
        }
    }
    assert!(readiness(Lifecycle::Active, true, FallbackPolicy::Reject, false, None).is_ready());
    assert_eq!(
        readiness(
            Lifecycle::Active,
            false,
            FallbackPolicy::Decode,
            false,
            None
        ),
        Readiness::NotReady(NotReady::NoDecodeSet)
    );
    assert_eq!(
        readiness(Lifecycle::Active, true, FallbackPolicy::Decode, true, None),
        Readiness::NotReady(NotReady::ShutDown)
    ); // Active with no reachable worker: ready only when the policy bypasses.
    assert_eq!(
        readiness(
            Lifecycle::Active,
            true,
            FallbackPolicy::Reject,
            false,
            Some(0)
        ),
        Readiness::NotReady(NotReady::NoReachablePrefill)
    );
    assert!(readiness(
        Lifecycle::Active,
        true,
        FallbackPolicy::Reject,
        false,
        Some(1)
    )
    .is_ready());
    assert!(readiness(
        Lifecycle::Active,
        true,
        FallbackPolicy::Decode,
        false,
        Some(0)
    )
    .is_ready());
}

#[test]
fn migrations_are_counted_per_reason_in_the_metrics() {
    let counts = std::sync::Arc::new(crate::decode::MigrationCounts::default());
    let mut registry = prometheus_client::registry::Registry::default();
    registry
        .sub_registry_with_prefix("prefill_router")
        .register_collector(Box::new(status::MigrationCollector {
            counts: std::sync::Arc::clone(&counts),
        }));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for reason in crate::migration::BreakReason::ALL {
        let line = format!(
            "prefill_router_migrations_total{{reason=\"{}\"}} 0",
            reason.as_str()
        );
        assert!(text.contains(&line), "{line} in {text}");
    }
    for name in ["exhausted", "prefilled"] {
        let line = format!("prefill_router_migrations_{name}_total 0");
        assert!(text.contains(&line), "{line} in {text}");
    }
}
