//! Typed errors of the dispatchers.

use crate::discovery::InstanceId;
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
}
