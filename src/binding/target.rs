//! What the controller points the hop at: one generation of a prefill worker set.

use std::collections::BTreeSet;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use tokio::sync::watch;

use crate::advert::ModelCard;
use crate::discovery::{EndpointId, InstanceId};

/// Identity of a [`WorkerSetTarget`]: the worker-set group and its generation.
///
/// A new generation is minted whenever the set's content changes in a way that needs a new
/// binding (e.g. the selected card changed); admission changes keep the generation.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerSetTargetId {
    /// The worker set (e.g. `namespace/prefill`).
    pub group: String,
    /// Its generation; strictly increases within a group.
    pub generation: u64,
}

impl WorkerSetTargetId {
    /// An id from its two parts.
    pub fn new(group: impl Into<String>, generation: u64) -> Self {
        WorkerSetTargetId {
            group: group.into(),
            generation,
        }
    }
}

impl fmt::Display for WorkerSetTargetId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.group, self.generation)
    }
}

/// One generation of a prefill worker set: what a binding is built for.
///
/// **Equality and hashing are by [`id`](Self::id) only.** The retarget machine compares
/// targets to decide whether the held binding can be reused and whether a build is stale, so
/// whoever mints targets must guarantee that equal ids mean equal content (same endpoint, same
/// card): give changed content a new generation. The admission set is deliberately *not*
/// content: it is a live channel the binding reads at every pick, so admission changes need no
/// rebuild.
#[derive(Clone)]
pub struct WorkerSetTarget {
    /// Identity (group, generation).
    pub id: WorkerSetTargetId,
    /// The prefill endpoint the binding routes to.
    pub endpoint: EndpointId,
    /// The card selected for this generation (first-wins); the binding resolves it.
    pub card: Arc<ModelCard>,
    /// The instance ids admitted to this generation, live.
    pub admitted: watch::Receiver<BTreeSet<InstanceId>>,
}

impl WorkerSetTarget {
    /// A target; see the type docs for the id contract.
    pub fn new(
        id: WorkerSetTargetId,
        endpoint: EndpointId,
        card: Arc<ModelCard>,
        admitted: watch::Receiver<BTreeSet<InstanceId>>,
    ) -> Self {
        WorkerSetTarget {
            id,
            endpoint,
            card,
            admitted,
        }
    }
}

impl PartialEq for WorkerSetTarget {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for WorkerSetTarget {}

impl Hash for WorkerSetTarget {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.id.hash(state);
    }
}

impl fmt::Debug for WorkerSetTarget {
    // Short on purpose: targets appear in every lifecycle log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}, card {:?})",
            self.id, self.endpoint, self.card.name
        )
    }
}

impl fmt::Display for WorkerSetTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.id, f)
    }
}
