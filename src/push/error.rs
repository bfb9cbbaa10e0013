//! Typed errors of the dispatchers.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::discovery::InstanceId;
use crate::health::FailureClass;
use crate::transport::TransportError;

/// Why a routed request failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PushError {
    /// No instance is routable (none discovered, none admitted, or every breaker open).
    #[error("no routable instances")]
    NoRoutableInstances,
    /// The instance is not (or no longer) in discovery.
    #[error("instance {0} is gone")]
    InstanceGone(InstanceId),
    /// The named instance is discovered but not routable (not admitted, or its breaker open
    /// after a connection failure).
    #[error("direct target {0} is not routable")]
    DirectTargetNotRoutable(InstanceId),
    /// The request plane failed for this request.
    #[error("transport error with instance {instance}: {source}")]
    Transport {
        /// The instance the request went to.
        instance: InstanceId,
        /// What failed.
        #[source]
        source: TransportError,
    },
    /// The request's deadline passed.
    #[error("request to instance {instance} timed out")]
    Timeout {
        /// The instance the request went to.
        instance: InstanceId,
    },
    /// Every routable worker is over the busy threshold (booked prefill work), and no room
    /// opened within the overload wait (or the overload queue was full). Not a health failure:
    /// the request is the client's to retry after a moment (HTTP 503 with `Retry-After`).
    #[error("overloaded: every routable worker has at least {threshold} prefill tokens booked (waited {waited:?})")]
    Overloaded {
        /// The busy threshold in booked tokens.
        threshold: u64,
        /// How long the request waited for room.
        waited: std::time::Duration,
    },
    /// The request was retried on other workers ([`PushConfig::retry_budget`](super::PushConfig))
    /// and every attempt failed, or the last failure may not be retried, or no other worker
    /// was left, or the deadline passed. Returned only when more than one attempt was made; a
    /// request tried once fails with that attempt's own error.
    #[error("all {} attempts failed (last: {})", attempts.len(), last_error(attempts))]
    Exhausted {
        /// Every attempt, in order; at least two.
        attempts: Vec<Attempt>,
    },
}

impl PushError {
    /// Whether the request failed for want of any reachable worker: nothing was routable, or
    /// every attempt failed at the connection level (refused, reset, a dead stream, garbage:
    /// the classes that [count against health](FailureClass::counts_against_health)), or its
    /// only target left discovery. False when a worker answered (an engine error, overload, a
    /// draining worker) or the deadline passed: those are not the pool being unreachable. A
    /// caller with a fallback for an unreachable pool (prefill on the decode worker) keys on it.
    pub fn no_reachable_worker(&self) -> bool {
        match self {
            PushError::NoRoutableInstances | PushError::InstanceGone(_) => true,
            PushError::Transport { source, .. } => {
                super::failure_class(source).counts_against_health()
            }
            PushError::Exhausted { attempts } => {
                !attempts.is_empty()
                    && attempts
                        .iter()
                        .all(|a| a.class.counts_against_health() || a.error.no_reachable_worker())
            }
            PushError::DirectTargetNotRoutable(_)
            | PushError::Timeout { .. }
            | PushError::Overloaded { .. } => false,
        }
    }
}

impl PushError {
    /// Whether no attempt of the request provably reached a worker: nothing was routable, or
    /// every attempt's connection was refused ([`FailureClass::request_unsent`]). A request
    /// carrying a single-use handoff that fails this way leaves the handoff unused.
    pub fn request_unsent(&self) -> bool {
        match self {
            PushError::NoRoutableInstances
            | PushError::InstanceGone(_)
            | PushError::DirectTargetNotRoutable(_)
            | PushError::Overloaded { .. } => true,
            PushError::Transport { source, .. } => super::failure_class(source).request_unsent(),
            PushError::Timeout { .. } => false,
            PushError::Exhausted { attempts } => attempts
                .iter()
                .all(|a| a.class.request_unsent() || a.error.request_unsent()),
        }
    }
}

fn last_error(attempts: &[Attempt]) -> String {
    attempts
        .last()
        .map_or_else(String::new, |a| a.error.to_string())
}

/// One failed attempt of a request: where it went and how it failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// The instance the attempt went to.
    pub instance: InstanceId,
    /// The failure's class (what it says about the worker, and whether it was retried).
    pub class: FailureClass,
    /// The attempt's own error.
    pub error: PushError,
}

/// Retries of failed requests on another worker, by the class of the failure that caused them.
/// Lock-free; one instance may be shared by several dispatchers (the default binding factory
/// shares one across the bindings it builds).
#[derive(Debug, Default)]
pub struct RetryCounts {
    by_class: [AtomicU64; FailureClass::ALL.len()],
}

fn class_index(class: FailureClass) -> usize {
    match class {
        FailureClass::ConnectionRefused => 0,
        FailureClass::ConnectionReset => 1,
        FailureClass::StreamDead => 2,
        FailureClass::Rejected => 3,
        FailureClass::Deadline => 4,
        FailureClass::Overloaded => 5,
    }
}

impl RetryCounts {
    /// Count one retry caused by a failure of `class`.
    pub fn record(&self, class: FailureClass) {
        // Relaxed: independent statistics.
        self.by_class[class_index(class)].fetch_add(1, Ordering::Relaxed);
    }

    /// Retries caused by failures of `class`.
    pub fn get(&self, class: FailureClass) -> u64 {
        self.by_class[class_index(class)].load(Ordering::Relaxed)
    }

    /// Every class with its count (zeros included), in [`FailureClass::ALL`] order.
    pub fn snapshot(&self) -> BTreeMap<FailureClass, u64> {
        FailureClass::ALL
            .into_iter()
            .map(|c| (c, self.get(c)))
            .collect()
    }

    /// Retries of any class.
    pub fn total(&self) -> u64 {
        FailureClass::ALL.into_iter().map(|c| self.get(c)).sum()
    }
}

#[cfg(test)]
mod unreachable_tests {
    use super::*;
    use crate::transport::RemoteError;

    fn transport(source: TransportError) -> PushError {
        PushError::Transport {
            instance: 1,
            source,
        }
    }

    fn attempt(class: FailureClass, error: PushError) -> Attempt {
        Attempt {
            instance: 1,
            class,
            error,
        }
    }

    #[test]
    fn a_pool_with_no_reachable_worker_is_told_apart_from_a_worker_that_answered() {
        let refused = transport(TransportError::Connect {
            addr: ([127, 0, 0, 1], 1).into(),
            reason: "refused".into(),
        });
        let reset = transport(TransportError::Disconnected {
            reason: "reset".into(),
        });
        let overloaded = transport(TransportError::Remote(RemoteError::Overloaded));
        assert!(PushError::NoRoutableInstances.no_reachable_worker());
        assert!(PushError::InstanceGone(3).no_reachable_worker());
        assert!(refused.no_reachable_worker());
        assert!(reset.no_reachable_worker());
        assert!(PushError::Exhausted {
            attempts: vec![
                attempt(FailureClass::ConnectionRefused, refused.clone()),
                attempt(FailureClass::ConnectionReset, reset.clone()),
            ]
        }
        .no_reachable_worker());
        // One worker answered: the pool is reachable.
        assert!(!PushError::Exhausted {
            attempts: vec![
                attempt(FailureClass::ConnectionRefused, refused),
                attempt(FailureClass::Overloaded, overloaded.clone()),
            ]
        }
        .no_reachable_worker());
        for answered in [
            overloaded,
            transport(TransportError::Draining),
            transport(TransportError::Remote(RemoteError::Engine {
                message: "bad".into(),
            })),
            transport(TransportError::Timeout),
            PushError::Timeout { instance: 1 },
            PushError::Overloaded {
                threshold: 1,
                waited: std::time::Duration::ZERO,
            },
            PushError::DirectTargetNotRoutable(1),
        ] {
            assert!(!answered.no_reachable_worker(), "{answered:?}");
        }
    }
}
