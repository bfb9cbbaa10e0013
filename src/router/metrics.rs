//! Prometheus metrics, read from the router's status at scrape time.
//!
//! One collector per router, registered with
//! [`PrefillRouter::register_metrics`](super::PrefillRouter::register_metrics). Nothing is
//! recorded twice: the collector encodes [`RouterStatus`] (the control core's counters and the
//! router's own atomics) on each scrape, so the metrics and `status()` can never disagree.
//! Names (prefix `prefill_router_`, label `router` = the configured name):
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `lifecycle{state}` | gauge | 1 for the current state (`pending`, `active`, `unavailable`), 0 otherwise |
//! | `activations_total` | counter | bindings published |
//! | `builds_started_total` | counter | builds started |
//! | `build_failures_total` | counter | failed builds, timeouts included |
//! | `build_timeouts_total` | counter | builds that hit the build timeout |
//! | `stale_builds_discarded_total` | counter | built bindings dropped because the target had moved on |
//! | `consecutive_build_failures` | gauge | failures in a row for the desired target |
//! | `retired_bindings_alive` | gauge | retired bindings still held by in-flight requests |
//! | `prefilled_total` | counter | requests that prefilled on a binding |
//! | `prefill_errors_total` | counter | prefills that failed their request |
//! | `bypassed_total{reason}` | counter | requests sent to decode without prefill (the hop's bypass reasons, and the conditional policy's `conditional_short` / `conditional_busy`) |
//! | `rejected_total{reason}` | counter | requests rejected with `NotActivated` |
//! | `waited_total` | counter | requests that waited for activation |
//! | `drained_total` | counter | prefills cut off by the drain cap after their binding was retired |
//! | `rerouted_total` | counter | requests routed again: their binding was retired before they picked a worker |
//! | `handoffs_total{ending}` | counter | single-use prefill handoffs (an engine's `kv_transfer_params`): `issued`, then each ended once as `delivered`, `carried_then_failed`, or abandoned (`prefill_finished`, `decode_unreachable`, `client_gone`) |
//! | `unreachable_bypassed_total` | counter | requests whose prefill found no reachable worker (none routable, or every attempt failed to reach its worker) and that the fallback policy sent to decode whole |
//! | `open_breakers` | gauge | the serving binding's instances whose health breaker is open (0 when not Active) |
//! | `prefill_retries_total{class}` | counter | prefills retried on another worker, by the failure's class (the serving binding's; the default factory's bindings share one count) |
//! | `affinity_total{outcome}` | counter | prefills of requests with a session key, by how session affinity decided them: `hit` (the live entry's worker), `miss` (no live entry), `repick` (a live entry on another worker: it left, failed, is busy, or no longer ranks first; the entry moved) |
//! | `affinity_evictions_total` | counter | affinity entries evicted to keep a binding's table within its cap |
//! | `affinity_expired_total` | counter | affinity entries dropped after their TTL |
//! | `prefill_booked_tokens` | gauge | prefill work (uncached tokens plus the per-request booking) booked on the serving binding's workers now (KV mode) |
//! | `overload_waiting` | gauge | requests waiting for room: every routable worker over the busy threshold |
//! | `overload_queued_total` | counter | requests that found every routable worker busy and queued |
//! | `overload_shed_total` | counter | requests failed as overloaded (503 with `Retry-After` in `serve`) |

use std::fmt;
use std::sync::Weak;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::conditional::ConditionalSkip;
use super::status::{RouterStatus, REASONS};
use crate::lifecycle::Lifecycle;

/// Anything that can report a [`RouterStatus`] (the router's shared state).
pub(crate) trait StatusSource: Send + Sync + 'static {
    fn status(&self) -> RouterStatus;
}

/// The scrape-time collector of one router. Holds the router weakly: a registry outliving the
/// router reports nothing for it rather than keeping it alive.
pub(crate) struct RouterCollector {
    pub(crate) source: Weak<dyn StatusSource>,
}

impl fmt::Debug for RouterCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouterCollector")
            .field("alive", &(self.source.strong_count() > 0))
            .finish()
    }
}

pub(crate) fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), fmt::Error> {
    let metric = ConstCounter::new(value);
    let e = encoder.encode_descriptor(name, help, None, metric.metric_type())?;
    metric.encode(e)
}

pub(crate) fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: i64,
) -> Result<(), fmt::Error> {
    let metric = ConstGauge::new(value);
    let e = encoder.encode_descriptor(name, help, None, metric.metric_type())?;
    metric.encode(e)
}

fn per_reason(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: &std::collections::BTreeMap<crate::snapshot::BypassReason, u64>,
    skips: Option<&std::collections::BTreeMap<ConditionalSkip, u64>>,
) -> Result<(), fmt::Error> {
    let kind = ConstCounter::new(0u64).metric_type();
    let mut family = encoder.encode_descriptor(name, help, None, kind)?;
    for reason in REASONS {
        let labels = [("reason", reason.as_str())];
        let e = family.encode_family(&labels)?;
        ConstCounter::new(values.get(&reason).copied().unwrap_or(0)).encode(e)?;
    }
    // Conditional skips are bypasses too (to decode whole), with their own reasons.
    for skip in skips.map_or(&[][..], |_| &ConditionalSkip::ALL[..]) {
        let labels = [("reason", skip.as_str())];
        let e = family.encode_family(&labels)?;
        let n = skips.and_then(|s| s.get(skip)).copied().unwrap_or(0);
        ConstCounter::new(n).encode(e)?;
    }
    Ok(())
}

fn saturating_i64<T: TryInto<i64>>(v: T) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

impl Collector for RouterCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let Some(source) = self.source.upgrade() else {
            return Ok(());
        };
        let s = source.status();
        let c = &s.counters;
        {
            let kind = ConstGauge::new(0i64).metric_type();
            let mut family = encoder.encode_descriptor(
                "lifecycle",
                "Prefill hop lifecycle: 1 for the current state",
                None,
                kind,
            )?;
            for state in [
                Lifecycle::Pending,
                Lifecycle::Active,
                Lifecycle::Unavailable,
            ] {
                let labels = [("state", state.to_string())];
                let e = family.encode_family(&labels)?;
                ConstGauge::new(i64::from(s.lifecycle == state)).encode(e)?;
            }
        }
        let e = &mut encoder;
        counter(
            e,
            "activations",
            "Prefill bindings published",
            c.activations,
        )?;
        counter(
            e,
            "builds_started",
            "Prefill binding builds started",
            c.builds_started,
        )?;
        counter(
            e,
            "build_failures",
            "Prefill binding builds that failed (timeouts included)",
            c.build_failures,
        )?;
        counter(
            e,
            "build_timeouts",
            "Prefill binding builds that hit the build timeout",
            c.build_timeouts,
        )?;
        counter(
            e,
            "stale_builds_discarded",
            "Built bindings dropped because the target moved on",
            c.stale_builds_discarded,
        )?;
        gauge(
            e,
            "consecutive_build_failures",
            "Failed builds in a row for the desired target",
            i64::from(s.consecutive_failures),
        )?;
        gauge(
            e,
            "retired_bindings_alive",
            "Retired bindings still held by in-flight requests",
            saturating_i64(c.retired_alive),
        )?;
        counter(
            e,
            "prefilled",
            "Requests that prefilled on a binding",
            c.prefilled,
        )?;
        counter(
            e,
            "prefill_errors",
            "Prefills that failed their request",
            c.prefill_errors,
        )?;
        per_reason(
            e,
            "bypassed",
            "Requests sent to decode without prefill, by reason",
            &c.bypassed,
            Some(&c.conditional_skips),
        )?;
        per_reason(
            e,
            "rejected",
            "Requests rejected because the hop was not active, by reason",
            &c.rejected,
            None,
        )?;
        counter(e, "waited", "Requests that waited for activation", c.waited)?;
        counter(
            e,
            "drained",
            "Prefills cut off by the drain cap after their binding was retired",
            c.drained,
        )?;
        counter(
            e,
            "rerouted",
            "Requests routed again because their binding was retired before they picked a worker",
            c.rerouted,
        )?;
        counter(
            e,
            "unreachable_bypassed",
            "Requests whose prefill found no reachable worker and that the fallback policy sent to decode whole",
            c.unreachable_bypassed,
        )?;
        {
            let h = &c.handoffs;
            let kind = ConstCounter::new(0u64).metric_type();
            let mut family = e.encode_descriptor(
                "handoffs",
                "Single-use prefill handoffs by how they ended (issued, delivered, carried_then_failed, or abandoned with a reason)",
                None,
                kind,
            )?;
            let mut endings = vec![
                ("issued", h.issued),
                ("delivered", h.delivered),
                ("carried_then_failed", h.carried_then_failed),
            ];
            for (reason, n) in &h.abandoned {
                endings.push((reason.as_str(), *n));
            }
            for (ending, value) in endings {
                let labels = [("ending", ending)];
                let m = family.encode_family(&labels)?;
                ConstCounter::new(value).encode(m)?;
            }
        }
        gauge(
            e,
            "open_breakers",
            "Instances of the serving binding whose health breaker is open",
            saturating_i64(s.health.open_breakers),
        )?;
        {
            let kind = ConstCounter::new(0u64).metric_type();
            let mut family = e.encode_descriptor(
                "prefill_retries",
                "Prefills retried on another worker, by the class of the failure",
                None,
                kind,
            )?;
            for class in crate::health::FailureClass::ALL {
                let labels = [("class", class.as_str())];
                let m = family.encode_family(&labels)?;
                ConstCounter::new(s.health.retries.get(&class).copied().unwrap_or(0)).encode(m)?;
            }
        }
        let a = s.health.affinity;
        {
            let kind = ConstCounter::new(0u64).metric_type();
            let mut family = e.encode_descriptor(
                "affinity",
                "Prefills of requests with a session key, by how session affinity decided them",
                None,
                kind,
            )?;
            for (outcome, value) in [("hit", a.hits), ("miss", a.misses), ("repick", a.repicks)] {
                let labels = [("outcome", outcome)];
                let m = family.encode_family(&labels)?;
                ConstCounter::new(value).encode(m)?;
            }
        }
        counter(
            e,
            "affinity_evictions",
            "Session-affinity entries evicted to keep a table within its cap",
            a.evictions,
        )?;
        counter(
            e,
            "affinity_expired",
            "Session-affinity entries dropped after their TTL",
            a.expired,
        )?;
        let o = s.health.overload;
        gauge(
            e,
            "prefill_booked_tokens",
            "Prefill work booked on the serving binding's workers now (tokens)",
            i64::try_from(o.booked_tokens).unwrap_or(i64::MAX),
        )?;
        gauge(
            e,
            "overload_waiting",
            "Requests waiting for room: every routable worker over the busy threshold",
            i64::try_from(o.waiting).unwrap_or(i64::MAX),
        )?;
        counter(
            e,
            "overload_queued",
            "Requests that found every routable worker busy and queued",
            o.queued,
        )?;
        counter(e, "overload_shed", "Requests failed as overloaded", o.shed)?;
        Ok(())
    }
}
