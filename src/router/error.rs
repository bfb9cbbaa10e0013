//! Errors of the request path and of waiting for activation.

use std::time::Duration;

use crate::binding::PrefillError;
use crate::decode::DecodeError;
use crate::lifecycle::Lifecycle;
use crate::snapshot::BypassReason;

/// Why [`PrefillRouter::generate`](super::PrefillRouter::generate) failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GenerateError {
    /// The hop is not Active and the fallback policy rejects (nothing was sent).
    #[error("prefill hop not activated ({reason}); request rejected by the fallback policy")]
    NotActivated {
        /// Why the hop was not Active when the request gave up.
        reason: BypassReason,
    },
    /// The prefill failed; the request fails with it (decode is not tried).
    #[error(transparent)]
    Prefill(#[from] PrefillError),
    /// The decode hop failed.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The request was prefilling on a binding that was retired, and the prefill had not
    /// finished `after` the retirement: the drain cap
    /// ([`PrefillRouterConfig::drain_cap`](super::PrefillRouterConfig::drain_cap)) cut it off
    /// and released the binding (the worker sees the cancellation). Decode was not called.
    #[error("prefill cut off {after:?} after its binding was retired (drain cap)")]
    Drained {
        /// The drain cap that expired.
        after: Duration,
    },
}

/// Why [`PrefillRouter::wait_active`](super::PrefillRouter::wait_active) returned early.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// The hop did not become Active in time.
    #[error("prefill hop not active after {after:?} (lifecycle {lifecycle})")]
    TimedOut {
        /// The timeout that expired.
        after: Duration,
        /// The lifecycle at the deadline.
        lifecycle: Lifecycle,
    },
    /// The router was shut down; it will never become Active.
    #[error("prefill router shut down")]
    ShutDown,
}
