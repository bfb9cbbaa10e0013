//! The one `Discovery` implementation, over a crate-private [`Backend`].
//!
//! Everything that is the same on every store is written here once: validating and keying a
//! registration, the three listings, the two watches, the watch feed's resync loop, and the
//! reaper loop. A backend supplies only what differs: how to list a key prefix, how to follow
//! changes after a listing, and how to publish a record under a lease it keeps alive (see
//! `docs/discovery.md`, "Adding a backend").

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::api::{
    cards_of, instance_stream, instances_of, namespace_of, namespace_stream, Discovery,
    InstanceStream, Lease, NamespaceStream, Registration, FEED_CAPACITY,
};
use super::known::RawEvent;
use super::reach::Reachability;
use super::record::{endpoint_prefix, namespace_prefix, record_key, validate};
use super::{DiscoveryError, EndpointId, Instance, InstanceId};
use crate::advert::ModelCard;

/// Records as a backend stores them: (key relative to the backend's root, bytes), any order.
pub(crate) type Listing = Vec<(String, Vec<u8>)>;

/// What publishing a record yields: the backend's hold on its lease.
pub(crate) type Leased = Result<Box<dyn Lease>, DiscoveryError>;

/// Why a watch's change feed stopped before its next change.
#[derive(Debug)]
pub(crate) enum Gap {
    /// Changes may have been missed (a lagging subscriber, an overflow, a safety-net timer):
    /// list again at once.
    Missed,
    /// The feed broke (a lost connection, a cancelled watch): list again after the backend's
    /// retry interval.
    // Only a networked store breaks: etcd and Kubernetes are behind features.
    #[cfg_attr(not(any(feature = "etcd", feature = "kubernetes")), allow(dead_code))]
    Broken(DiscoveryError),
    /// The store itself is gone: end the watch.
    Closed,
}

/// What a discovery store must provide; [`Discovery`] is implemented once for every backend.
///
/// Keys are [`record_key`]s relative to the backend's root; prefixes end with `/`. Records are
/// the bytes of [`super::encode_record`] (or a foreign writer's junk, which the shared code
/// skips), and expired records must never be listed or reported as present.
pub(crate) trait Backend: Clone + Send + Sync + 'static {
    /// One watch's hold on the store's changes (a subscription, a stream, a timer).
    type Cursor: Send + 'static;

    /// The live records whose keys start with `prefix`.
    fn list(&self, prefix: &str) -> impl Future<Output = Result<Listing, DiscoveryError>> + Send;

    /// Start following the changes under `prefix`. Called by `watch` before it returns, so a
    /// backend that can subscribe synchronously misses nothing written after the call.
    fn subscribe(&self, prefix: String) -> Self::Cursor;

    /// A full listing of the cursor's prefix, such that [`Backend::changes`] then reports the
    /// changes after it: none missed (a replayed change must read as the current state, never
    /// a stale one). An error is retried after [`Backend::retry_interval`], and never reported
    /// to the watcher as an empty listing.
    fn resync(
        &self,
        cursor: &mut Self::Cursor,
    ) -> impl Future<Output = Result<Listing, DiscoveryError>> + Send;

    /// Wait for the next changes under the cursor's prefix and append them to `out` as `Put`
    /// and `Delete` events (a `Put` of an unreadable record is fine: the shared code skips it).
    /// The shared loop cancels a pending call only when the watch ends.
    fn changes(
        &self,
        cursor: &mut Self::Cursor,
        out: &mut Vec<RawEvent>,
    ) -> impl Future<Output = Result<(), Gap>> + Send;

    /// End a watch whose consumer is gone. The default drops the cursor.
    fn close(&self, cursor: Self::Cursor) -> impl Future<Output = ()> + Send {
        drop(cursor);
        async {}
    }

    /// Pause before listing again after a failed listing or a [`Gap::Broken`].
    fn retry_interval(&self) -> Duration;

    /// Write the record of `instance` and `card` under `key` with a fresh lease (replacing
    /// any record there: re-registering is an upsert) and keep the lease alive until the
    /// returned [`Lease`] ends it. A lease superseded by a newer one for the same key must
    /// never delete its successor's record.
    fn put_leased(
        &self,
        key: String,
        instance: &Instance,
        card: &ModelCard,
    ) -> impl Future<Output = Leased> + Send;

    /// Start this process's reaper of expired records if the backend needs one (see
    /// [`Reaper`]); called on every register and watch. The default does nothing: the store
    /// expires leases itself.
    fn ensure_reaper(&self) {}

    /// The cell this store's watches report failures and recoveries to, if it can fail.
    fn reachability(&self) -> Option<&Reachability> {
        None
    }
}

#[async_trait::async_trait]
impl<B: Backend> Discovery for B {
    async fn register(
        &self,
        instance: Instance,
        card: ModelCard,
    ) -> Result<Registration, DiscoveryError> {
        validate(&instance)?;
        self.ensure_reaper();
        let key = record_key(&instance.endpoint, instance.instance_id);
        let lease = self.put_leased(key, &instance, &card).await?;
        Ok(Registration::new(instance, lease))
    }

    async fn list_instances(&self, endpoint: &EndpointId) -> Result<Vec<Instance>, DiscoveryError> {
        Ok(instances_of(
            endpoint,
            self.list(&endpoint_prefix(endpoint)).await?,
        ))
    }

    async fn list_cards(
        &self,
        endpoint: &EndpointId,
    ) -> Result<Vec<(InstanceId, ModelCard)>, DiscoveryError> {
        Ok(cards_of(
            endpoint,
            self.list(&endpoint_prefix(endpoint)).await?,
        ))
    }

    async fn list_namespace(
        &self,
        namespace: &str,
    ) -> Result<Vec<(Instance, ModelCard)>, DiscoveryError> {
        Ok(namespace_of(
            namespace,
            self.list(&namespace_prefix(namespace)).await?,
        ))
    }

    async fn watch(&self, endpoint: &EndpointId) -> Result<InstanceStream, DiscoveryError> {
        Ok(instance_stream(
            endpoint,
            feed(self, endpoint_prefix(endpoint)),
        ))
    }

    async fn watch_namespace(&self, namespace: &str) -> Result<NamespaceStream, DiscoveryError> {
        Ok(namespace_stream(
            namespace,
            feed(self, namespace_prefix(namespace)),
        ))
    }

    fn store_status(&self) -> tokio::sync::watch::Receiver<super::StoreStatus> {
        match self.reachability() {
            Some(reach) => reach.subscribe(),
            None => super::reach::always_reachable(),
        }
    }
}

/// A watch's raw feed: subscribed now, served by a task that ends with the watch.
fn feed<B: Backend>(backend: &B, prefix: String) -> mpsc::Receiver<RawEvent> {
    backend.ensure_reaper();
    let (tx, rx) = mpsc::channel(FEED_CAPACITY);
    let cursor = backend.subscribe(prefix);
    tokio::spawn(run_feed(backend.clone(), cursor, tx));
    rx
}

/// The resync loop of every watch: a full listing first and after every gap, the changes in
/// between. The level-triggered known set behind the stream turns each listing into exactly
/// the changes the watcher missed.
async fn run_feed<B: Backend>(backend: B, mut cursor: B::Cursor, tx: mpsc::Sender<RawEvent>) {
    let mut batch = Vec::new();
    'resync: loop {
        let listing = tokio::select! {
            _ = tx.closed() => break,
            listing = backend.resync(&mut cursor) => listing,
        };
        match listing {
            Ok(listing) => {
                if let Some(reach) = backend.reachability() {
                    reach.answered();
                }
                if tx.send(RawEvent::Resync(listing)).await.is_err() {
                    break;
                }
            }
            Err(error) => {
                if let Some(reach) = backend.reachability() {
                    reach.failed(&error);
                }
                tracing::debug!(%error, "discovery watch cannot list; retrying");
                if pause(&tx, backend.retry_interval()).await {
                    break;
                }
                continue;
            }
        }
        loop {
            let next = tokio::select! {
                _ = tx.closed() => break 'resync,
                next = backend.changes(&mut cursor, &mut batch) => next,
            };
            for event in batch.drain(..) {
                if tx.send(event).await.is_err() {
                    break 'resync;
                }
            }
            match next {
                Ok(()) => {}
                Err(Gap::Missed) => continue 'resync,
                Err(Gap::Broken(error)) => {
                    if let Some(reach) = backend.reachability() {
                        reach.failed(&error);
                    }
                    tracing::debug!(%error, "discovery watch interrupted; will resync");
                    if pause(&tx, backend.retry_interval()).await {
                        break 'resync;
                    }
                    continue 'resync;
                }
                Err(Gap::Closed) => break 'resync,
            }
        }
    }
    backend.close(cursor).await;
}

/// Sleep `period` unless the watch's consumer goes first; true if it went.
async fn pause(tx: &mpsc::Sender<RawEvent>, period: Duration) -> bool {
    tokio::select! {
        _ = tx.closed() => true,
        _ = tokio::time::sleep(period) => false,
    }
}

/// A store's reaper of expired records: one task per store per process, started on first use,
/// holding the store weakly so that it ends with the store.
#[derive(Debug, Default)]
pub(crate) struct Reaper {
    started: AtomicBool,
}

impl Reaper {
    /// Run `reap` at once and then every `period`, unless already started. It stops when
    /// `store` is dropped or `reap` returns false (the runtime is shutting down).
    pub(crate) fn start<T, F, Fut>(&self, store: &Arc<T>, period: Duration, reap: F)
    where
        T: Send + Sync + 'static,
        F: Fn(Arc<T>) -> Fut + Send + 'static,
        Fut: Future<Output = bool> + Send,
    {
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak = Arc::downgrade(store);
        let period = period.max(Duration::from_millis(1));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                let Some(store) = weak.upgrade() else { return };
                if !reap(store).await {
                    return;
                }
            }
        });
    }
}
