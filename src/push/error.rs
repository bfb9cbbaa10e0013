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
