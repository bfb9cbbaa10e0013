//! The discovery trait, registrations, and the watch streams shared by every backend.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_core::Stream;
use tokio::sync::mpsc;

use super::known::{Change, KnownSet, RawEvent, Scope};
use super::record::decode_record;
use super::{DiscoveryError, EndpointId, Instance, InstanceEvent, InstanceId, NamespaceEvent};
use crate::advert::ModelCard;

/// A watch of one endpoint: `Added` for every instance present (first) and every later
/// appearance or address change, `Removed` when one goes. Ends only if the backend's task
/// stops (runtime shutdown); store outages and gaps are healed inside by a resync.
pub type InstanceStream = Pin<Box<dyn Stream<Item = InstanceEvent> + Send + 'static>>;

/// A watch of a whole namespace: `Upserted` for every record present (first) and every later
/// appearance or change (address or card), `Removed` when one goes.
pub type NamespaceStream = Pin<Box<dyn Stream<Item = NamespaceEvent> + Send + 'static>>;

/// Where workers register and frontends look. Object-safe: use it as `Arc<dyn Discovery>`.
///
/// Every backend passes the same conformance suite (`tests/discovery_conformance/`).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use futures::StreamExt;
/// use prefill_router::advert::ModelCard;
/// use prefill_router::discovery::{
///     Discovery, EndpointId, Instance, InstanceEvent, MemoryDiscovery,
/// };
///
/// let store: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::default());
/// let endpoint = EndpointId::new("dynamo", "prefill", "generate");
/// let mut watch = store.watch(&endpoint).await?;
///
/// let worker = Instance {
///     endpoint: endpoint.clone(),
///     instance_id: 7,
///     address: "127.0.0.1:9000".parse()?,
/// };
/// let registration = store.register(worker.clone(), ModelCard::named("llama")).await?;
/// assert_eq!(watch.next().await, Some(InstanceEvent::Added(worker)));
/// assert_eq!(store.list_cards(&endpoint).await?, vec![(7, ModelCard::named("llama"))]);
///
/// registration.deregister().await?;
/// assert_eq!(watch.next().await, Some(InstanceEvent::Removed(7)));
/// # Ok(())
/// # }
/// ```
#[async_trait::async_trait]
pub trait Discovery: Send + Sync {
    /// Publish `instance` with its model card under a lease that the returned [`Registration`]
    /// keeps alive in the background; the record expires if the process dies. Registering the
    /// same endpoint and instance id again replaces the record (upsert, e.g. a changed card).
    async fn register(
        &self,
        instance: Instance,
        card: ModelCard,
    ) -> Result<Registration, DiscoveryError>;

    /// The live instances of an endpoint, ordered by instance id. Unreadable records are
    /// skipped with a warning.
    async fn list_instances(&self, endpoint: &EndpointId) -> Result<Vec<Instance>, DiscoveryError>;

    /// The model cards of an endpoint's live instances, ordered by instance id.
    async fn list_cards(
        &self,
        endpoint: &EndpointId,
    ) -> Result<Vec<(InstanceId, ModelCard)>, DiscoveryError>;

    /// Every live instance of a namespace with its card, ordered by endpoint then id.
    async fn list_namespace(
        &self,
        namespace: &str,
    ) -> Result<Vec<(Instance, ModelCard)>, DiscoveryError>;

    /// Watch one endpoint. See [`InstanceStream`].
    async fn watch(&self, endpoint: &EndpointId) -> Result<InstanceStream, DiscoveryError>;

    /// Watch a whole namespace. See [`NamespaceStream`].
    async fn watch_namespace(&self, namespace: &str) -> Result<NamespaceStream, DiscoveryError>;

    /// Whether the store answers, as this process's watches find it: unreachable from the
    /// first failed listing or broken watch until a listing succeeds again. Watches heal
    /// outages by themselves (the last view stays in force meanwhile); this is how a frontend
    /// reports one. The default, for a store that cannot fail (in memory), is always
    /// reachable and never changes.
    fn store_status(&self) -> tokio::sync::watch::Receiver<super::StoreStatus> {
        super::reach::always_reachable()
    }
}

/// A backend's hold on one registered record: what a [`Registration`] ends in one of three
/// ways.
///
/// The crate's own backends implement it privately. It is public as an extension point for a
/// [`Discovery`] implemented outside this crate (a test double, a wrapper playing the worker
/// side of a cluster), so that such an implementation can hand out a real [`Registration`]
/// through [`Registration::new`]. An implementation must keep the semantics below, which the
/// conformance suite checks: in particular a lease superseded by a newer registration of the
/// same instance (re-register = upsert) must never delete its successor's record.
#[async_trait::async_trait]
pub trait Lease: Send + Sync {
    /// Stop the keep-alive and delete the record now (polite shutdown: watchers see the
    /// removal at once, not after a TTL).
    async fn revoke(self: Box<Self>) -> Result<(), DiscoveryError>;
    /// Stop the keep-alive and leave the record to expire, as a crashed process would.
    fn abandon(self: Box<Self>);
    /// Called on drop: stop the keep-alive and remove the record as promptly as the backend
    /// can without blocking (drop is synchronous, so no `await` here).
    fn release(self: Box<Self>);
}

/// A live registration. Its background task keeps the record's lease alive.
///
/// - [`deregister`](Registration::deregister) removes the record at once (polite shutdown);
/// - dropping it stops the keep-alive and removes the record promptly too: synchronously on
///   the memory and file backends; on etcd the keep-alive task revokes the lease (if no tokio
///   runtime is running any more, the record expires after its TTL instead);
/// - [`abandon`](Registration::abandon) stops the keep-alive but leaves the record to expire
///   after its TTL, which is what a killed process does;
/// - if the process dies, nothing keeps the lease alive and the record expires after its TTL.
///
/// A registration superseded by a newer one for the same instance (re-register = upsert)
/// never deletes its successor's record.
#[must_use = "dropping a Registration removes the record"]
pub struct Registration {
    instance: Instance,
    lease: Option<Box<dyn Lease>>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

impl Registration {
    /// A registration of `instance` held by `lease`: how a [`Discovery::register`]
    /// implementation returns its record's hold. Public for a [`Discovery`] implemented
    /// outside this crate (see [`Lease`]); the crate's backends build theirs the same way.
    pub fn new(instance: Instance, lease: Box<dyn Lease>) -> Self {
        Registration {
            instance,
            lease: Some(lease),
        }
    }

    /// The registered instance.
    pub fn instance(&self) -> &Instance {
        &self.instance
    }

    /// Remove the record now and stop the keep-alive.
    pub async fn deregister(mut self) -> Result<(), DiscoveryError> {
        match self.lease.take() {
            Some(lease) => lease.revoke().await,
            None => Ok(()),
        }
    }

    /// Stop keeping the lease alive without removing the record: it expires after its TTL,
    /// as if the process had been killed. For failover drills and tests.
    pub fn abandon(mut self) {
        if let Some(lease) = self.lease.take() {
            lease.abandon();
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.release();
        }
    }
}

/// Capacity of a watch's raw-event channel: bounds a watch's memory; a full channel
/// back-pressures the backend's feed task, which answers falling behind with a resync.
pub(crate) const FEED_CAPACITY: usize = 256;

/// Turns a backend's raw feed into changes, through the level-triggered [`KnownSet`].
struct ChangeStream<T, F> {
    feed: mpsc::Receiver<RawEvent>,
    known: KnownSet,
    changes: VecDeque<Change>,
    map: F,
    ready: VecDeque<T>,
}

impl<T, F> Stream for ChangeStream<T, F>
where
    F: FnMut(Change) -> Option<T> + Unpin,
    T: Unpin,
{
    type Item = T;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let this = self.get_mut();
        loop {
            if let Some(item) = this.ready.pop_front() {
                return Poll::Ready(Some(item));
            }
            match this.feed.poll_recv(cx) {
                Poll::Ready(Some(event)) => {
                    this.known.apply(event, &mut this.changes);
                    while let Some(change) = this.changes.pop_front() {
                        if let Some(item) = (this.map)(change) {
                            this.ready.push_back(item);
                        }
                    }
                }
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// An endpoint watch over a raw feed (which may carry more than the endpoint's records).
pub(crate) fn instance_stream(
    endpoint: &EndpointId,
    feed: mpsc::Receiver<RawEvent>,
) -> InstanceStream {
    Box::pin(ChangeStream {
        feed,
        known: KnownSet::new(Scope::Endpoint(endpoint.clone())),
        changes: VecDeque::new(),
        ready: VecDeque::new(),
        map: |change| match change {
            // A card-only change leaves the instance as it was: no event, so a consumer of
            // instance events never sees a duplicate `Added`.
            Change::Upserted {
                previous, instance, ..
            } => (previous.as_ref() != Some(&instance)).then_some(InstanceEvent::Added(instance)),
            Change::Removed(instance) => Some(InstanceEvent::Removed(instance.instance_id)),
        },
    })
}

/// A namespace watch over a raw feed.
pub(crate) fn namespace_stream(namespace: &str, feed: mpsc::Receiver<RawEvent>) -> NamespaceStream {
    Box::pin(ChangeStream {
        feed,
        known: KnownSet::new(Scope::Namespace(namespace.to_owned())),
        changes: VecDeque::new(),
        ready: VecDeque::new(),
        map: |change| {
            Some(match change {
                Change::Upserted { instance, card, .. } => NamespaceEvent::Upserted(instance, card),
                Change::Removed(instance) => {
                    NamespaceEvent::Removed(instance.endpoint, instance.instance_id)
                }
            })
        },
    })
}

/// Decode a listing, skipping unreadable records with a warning, ordered by key (so by
/// endpoint, then instance id, as ids are fixed-width hex).
pub(crate) fn decode_listing(mut listing: Vec<(String, Vec<u8>)>) -> Vec<(Instance, ModelCard)> {
    listing.sort_by(|a, b| a.0.cmp(&b.0));
    listing
        .into_iter()
        .filter_map(|(key, bytes)| match decode_record(&key, &bytes) {
            Ok(record) => Some(record),
            Err(error) => {
                tracing::warn!(key, %error, "skipping malformed discovery record");
                None
            }
        })
        .collect()
}

/// The endpoint's instances from a namespace-or-endpoint listing.
pub(crate) fn instances_of(
    endpoint: &EndpointId,
    listing: Vec<(String, Vec<u8>)>,
) -> Vec<Instance> {
    decode_listing(listing)
        .into_iter()
        .filter(|(i, _)| i.endpoint == *endpoint)
        .map(|(i, _)| i)
        .collect()
}

/// The endpoint's cards from a listing.
pub(crate) fn cards_of(
    endpoint: &EndpointId,
    listing: Vec<(String, Vec<u8>)>,
) -> Vec<(InstanceId, ModelCard)> {
    decode_listing(listing)
        .into_iter()
        .filter(|(i, _)| i.endpoint == *endpoint)
        .map(|(i, c)| (i.instance_id, c))
        .collect()
}

/// The namespace's records from a listing.
pub(crate) fn namespace_of(
    namespace: &str,
    listing: Vec<(String, Vec<u8>)>,
) -> Vec<(Instance, ModelCard)> {
    decode_listing(listing)
        .into_iter()
        .filter(|(i, _)| i.endpoint.namespace == namespace)
        .collect()
}

/// Shared between a registration's keep-alive task and its lease: set once the lease is
/// released. The task checks it under the lock before every renewal, so a renewal can never
/// resurrect a record that the release has just deleted (aborting a task is not enough: it may
/// be mid-poll on another worker thread).
#[derive(Debug, Default)]
pub(crate) struct StopFlag {
    stopped: std::sync::Mutex<bool>,
    /// Wakes a keep-alive thread sleeping in [`StopFlag::sleep`] when the flag is set.
    wake: std::sync::Condvar,
}

impl StopFlag {
    fn lock(&self) -> std::sync::MutexGuard<'_, bool> {
        self.stopped.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Run `renew` unless stopped; false if stopped.
    pub(crate) fn unless_stopped(&self, renew: impl FnOnce()) -> bool {
        let stopped = self.lock();
        if *stopped {
            return false;
        }
        renew();
        true
    }

    /// Stop, then run `cleanup` while no renewal can interleave.
    pub(crate) fn stop_then(&self, cleanup: impl FnOnce()) {
        let mut stopped = self.lock();
        *stopped = true;
        self.wake.notify_all();
        cleanup();
    }

    /// Block the calling (non-runtime) thread for `period` or until stopped; true if stopped.
    pub(crate) fn sleep(&self, period: std::time::Duration) -> bool {
        let stopped = self.lock();
        let (stopped, _) = self
            .wake
            .wait_timeout_while(stopped, period, |stopped| !*stopped)
            .unwrap_or_else(|e| e.into_inner());
        *stopped
    }
}

/// A process-unique, hard-to-collide token naming one registration (its "lease owner").
pub(crate) fn fresh_owner() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // RandomState is seeded randomly per process; mixing in pid, time and a counter keeps
    // tokens distinct across processes sharing a file store.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    if let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(now.as_nanos());
    }
    hasher.finish().max(1)
}
