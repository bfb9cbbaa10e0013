//! Conditional disaggregation: per request, skip the remote prefill and send the request to
//! decode whole when the prefill hop would gain it nothing (issue #13 item 2).
//!
//! The decision is a pure function of one [`PrefillEstimate`] (what the binding's pick for the
//! request says: prompt tokens, the tokens the picked worker is expected to hold cached, the
//! prefill pool's load per worker) and the [`ConditionalPolicy`]'s thresholds. The router
//! estimates and dispatches on the **same** binding and the same held pick (upstream loads its
//! binding twice, once to estimate and once to dispatch: its weakness W10), see `docs/router.md`.
//!
//! A skip is not a [`BypassReason`](crate::snapshot::BypassReason): a bypass means the pool
//! is not usable (the snapshot says so), a skip means the pool is usable and was passed over
//! for this request. Skips have their own type ([`ConditionalSkip`]) and counters, and appear
//! in the `bypassed_total` metric under their own `reason` labels.

use std::fmt;

use crate::binding::PrefillEstimate;

/// When to skip the remote prefill. Off unless configured
/// ([`PrefillRouterConfig::conditional`](super::PrefillRouterConfig::conditional) is `None` by
/// default); each condition is off while its threshold is `None`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConditionalPolicy {
    /// Skip when the prompt's uncached part (prompt tokens minus the tokens the picked worker
    /// is expected to hold) is **below** this many tokens: a short prefill costs decode less
    /// than the KV transfer costs the request.
    pub min_uncached_tokens: Option<u32>,
    /// Skip when the prefill pool holds **more** than this many queued or in-flight uncached
    /// prefill tokens per routable worker: the request would queue behind them.
    pub max_pool_tokens_per_worker: Option<u64>,
}

/// Why a request skipped the remote prefill although the hop was Active.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConditionalSkip {
    /// The uncached part of the prompt was below the policy's threshold.
    Short,
    /// The prefill pool's load per worker was above the policy's threshold.
    Busy,
}

impl ConditionalSkip {
    /// Every skip reason, in a fixed order.
    pub const ALL: [ConditionalSkip; 2] = [ConditionalSkip::Short, ConditionalSkip::Busy];

    /// A short, stable, lower-case label (the `reason` of `bypassed_total`).
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionalSkip::Short => "conditional_short",
            ConditionalSkip::Busy => "conditional_busy",
        }
    }
}

impl fmt::Display for ConditionalSkip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl ConditionalPolicy {
    /// The decision for one estimate: `Some(skip)` sends the request to decode whole.
    ///
    /// Exactly: `Short` when `uncached < min_uncached_tokens`; otherwise `Busy` when
    /// `pool_tokens_per_worker > max_pool_tokens_per_worker`; otherwise `None` (prefill). A
    /// condition whose threshold is `None` never holds.
    pub fn decide(&self, estimate: &PrefillEstimate) -> Option<ConditionalSkip> {
        if self
            .min_uncached_tokens
            .is_some_and(|min| estimate.uncached_tokens() < min)
        {
            return Some(ConditionalSkip::Short);
        }
        if self
            .max_pool_tokens_per_worker
            .is_some_and(|max| estimate.pool_tokens_per_worker > max)
        {
            return Some(ConditionalSkip::Busy);
        }
        None
    }
}

#[cfg(test)]
mod tests;
