//! Discovery: where workers register their instances and model cards, and where the frontend
//! watches them.
//!
//! This file holds the vocabulary shared by every backend and by the request plane.

use std::fmt;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// A served endpoint: `namespace/component/endpoint`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EndpointId {
    /// Deployment namespace (one model family, e.g. `dynamo`).
    pub namespace: String,
    /// Component within the namespace (e.g. `prefill`, `decode`).
    pub component: String,
    /// Endpoint within the component (e.g. `generate`).
    pub endpoint: String,
}

impl EndpointId {
    /// Build an endpoint id from its three parts.
    pub fn new(
        namespace: impl Into<String>,
        component: impl Into<String>,
        endpoint: impl Into<String>,
    ) -> Self {
        EndpointId {
            namespace: namespace.into(),
            component: component.into(),
            endpoint: endpoint.into(),
        }
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.component, self.endpoint)
    }
}

/// Identity of one worker instance, unique within an endpoint.
pub type InstanceId = u64;

/// One live worker instance of an endpoint, reachable over the request plane at `address`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Instance {
    /// The endpoint it serves.
    pub endpoint: EndpointId,
    /// Its id, unique within the endpoint.
    pub instance_id: InstanceId,
    /// Where its request-plane listener is.
    pub address: SocketAddr,
}

/// A change in an endpoint's instance set, as a watch reports it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum InstanceEvent {
    /// The instance appeared, or its record changed (upsert).
    Added(Instance),
    /// The instance is gone (deregistered, or its lease expired).
    Removed(InstanceId),
}
