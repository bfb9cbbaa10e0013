//! The dispatcher's deliberate mutants, in a file of their own: the dispatcher and its KV feed
//! both arm them, and neither should depend on the other for it.

/// A deliberate mutant of the dispatcher (see `crate::hooks` and `Dispatcher::with_mutant`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DispatchMutant {
    /// A retry may pick the worker that just failed (the retry tests must catch it).
    ReuseFailed,
    /// Session affinity sends a session to its remembered worker whether or not it is still
    /// routable (outside admission, breaker open); the affinity checks must catch it.
    AffinityIgnoresRoutable,
    /// Session affinity keeps a session on its live entry's worker while that worker is
    /// routable, even when it is no longer first in the session's rendezvous order (the old
    /// per-frontend stickiness); the rendezvous checks must catch it.
    AffinityKeepsLiveEntry,
    /// A reconnect or a closed connection keeps the worker's KV index entries (the KV feed
    /// tests must catch it).
    KeepKvOnReconnect,
    /// A decode attempt that failed after it may have reached its worker gives its single-use
    /// handoff back, so the retry carries a used handle to another worker (the handoff
    /// property tests must catch it).
    ResendHandoff,
    /// A continuation's picks ignore the workers it must avoid (its stream broke there), so
    /// the KV pick returns to the worker holding its prompt (the avoid tests must catch it).
    IgnoresAvoid,
}
