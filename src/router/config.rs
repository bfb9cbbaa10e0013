//! Router configuration.

use std::time::Duration;

use super::conditional::ConditionalPolicy;
use super::fallback::FallbackPolicy;
use crate::lifecycle::RetryPolicy;

/// Configuration of a [`PrefillRouter`](super::PrefillRouter).
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillRouterConfig {
    /// Backoff between failed builds (the machine's delay; jitter is added on top).
    pub retry: RetryPolicy,
    /// A build that has not finished after this long fails (and is retried). Default 30 s.
    pub build_timeout: Duration,
    /// Extra random delay added to each retry, as a fraction of the machine's delay: a retry
    /// after delay `d` fires after a uniform time in `[d, d * (1 + retry_jitter)]`. Spreads the
    /// retries of many frontends that failed together. Clamped to `[0, 1]`; default 0.1.
    pub retry_jitter: f64,
    /// Seed of the jitter's random numbers: `None` (the default) draws it from process
    /// entropy; `Some(seed)` makes retry times reproducible (simulators, tests).
    pub jitter_seed: Option<u64>,
    /// What requests do while the hop is not Active.
    pub fallback: FallbackPolicy,
    /// The router's name in logs and metrics (e.g. the model name).
    pub name: String,
    /// How long a retired binding keeps serving the prefills in flight on it. `None` (the
    /// default) lets them run to completion, however long; `Some(cap)`: a prefill still running
    /// `cap` after its binding was retired (retarget, clear, shutdown) ends with
    /// [`GenerateError::Drained`](super::GenerateError::Drained), which drops the request's
    /// hold on the binding. Decode does not hold the binding, so it is never cut off.
    pub drain_cap: Option<Duration>,
    /// Conditional disaggregation: while the hop is Active, send a request to decode whole
    /// (no remote prefill) when the policy says the prefill gains it nothing. `None` (the
    /// default) is off: every request prefills on the hop. See
    /// [`conditional`](super::conditional).
    pub conditional: Option<ConditionalPolicy>,
}

impl Default for PrefillRouterConfig {
    fn default() -> Self {
        PrefillRouterConfig {
            retry: RetryPolicy::default(),
            build_timeout: Duration::from_secs(30),
            retry_jitter: 0.1,
            jitter_seed: None,
            fallback: FallbackPolicy::default(),
            name: "prefill".to_owned(),
            drain_cap: None,
            conditional: None,
        }
    }
}

impl PrefillRouterConfig {
    /// The jitter fraction actually applied (NaN and negatives count as 0, more than 1 as 1).
    pub(crate) fn jitter_fraction(&self) -> f64 {
        if self.retry_jitter.is_nan() {
            0.0
        } else {
            self.retry_jitter.clamp(0.0, 1.0)
        }
    }
}
