//! Discovery: where workers register their instances and model cards, and where the frontend
//! watches them.
//!
//! This file holds the vocabulary shared by every backend and by the request plane. The record
//! format ([`record_key`], [`encode_record`], [`decode_record`]) and the level-triggered diff
//! behind every watch are pure and build without tokio. With the default feature `runtime`
//! the module adds the `Discovery` trait and its backends: `MemoryDiscovery` (in-process),
//! `FileDiscovery` (a shared directory, the embedded default), with feature `etcd`
//! `EtcdDiscovery`, and with feature `kubernetes` the read-only `KubernetesDiscovery`. See
//! `docs/discovery.md` and `docs/kubernetes.md`.

use std::fmt;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::advert::ModelCard;

mod error;
// Without `runtime` nothing watches or registers: the helpers used only by backends idle.
#[cfg_attr(not(feature = "runtime"), allow(dead_code))]
mod known;
#[cfg_attr(not(feature = "runtime"), allow(dead_code))]
mod record;

pub use error::{DiscoveryError, RecordError};
pub use record::{decode_record, encode_record, record_key};

#[cfg(feature = "runtime")]
mod api;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "runtime")]
mod file;
#[cfg(feature = "kubernetes")]
mod kubernetes;
#[cfg(feature = "runtime")]
mod memory;
#[cfg(feature = "runtime")]
mod reach;
#[cfg(feature = "runtime")]
mod store;

#[cfg(feature = "runtime")]
pub use api::{Discovery, InstanceStream, Lease, NamespaceStream, Registration};
#[cfg(feature = "etcd")]
pub use etcd::{EtcdConfig, EtcdDiscovery, HTTP2_PING_INTERVAL, WATCH_PROBE_INTERVAL};
#[cfg(feature = "runtime")]
pub use file::{FileConfig, FileDiscovery};
#[cfg(feature = "kubernetes")]
pub use kubernetes::{
    instance_id_of, ClusterSource, KubernetesConfig, KubernetesDiscovery, CARD_ANNOTATION,
    COMPONENT_LABEL, ENDPOINT_LABEL, NAMESPACE_LABEL,
};
#[cfg(feature = "runtime")]
pub use memory::{MemoryConfig, MemoryDiscovery};
#[cfg(feature = "runtime")]
pub use reach::StoreStatus;

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

/// A change anywhere in a namespace, as a namespace-wide watch reports it.
#[derive(Clone, Debug, PartialEq)]
pub enum NamespaceEvent {
    /// The instance appeared, or its record changed: a new address or a new card (upsert).
    Upserted(Instance, ModelCard),
    /// The instance of this endpoint is gone (deregistered, expired, or its record unreadable).
    Removed(EndpointId, InstanceId),
}
