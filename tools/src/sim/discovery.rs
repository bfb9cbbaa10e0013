//! A faulty [`Discovery`]: the real in-memory store underneath, but every namespace-watch
//! event is delivered late, twice, out of order or not at all (while faults are on), and a
//! periodic resync from a listing heals the gaps, as a real watch does after falling behind.

use std::collections::BTreeSet;
use std::sync::Arc;

use futures_util::StreamExt;
use tokio::sync::mpsc;

use super::config::timing;
use super::feed;
use super::world::World;
use prefill_router::advert::ModelCard;
use prefill_router::discovery::{
    Discovery, DiscoveryError, EndpointId, Instance, InstanceId, InstanceStream, MemoryDiscovery,
    NamespaceEvent, NamespaceStream, Registration,
};

/// Key part of namespace-event deliveries.
const FEED_NAMESPACE: u64 = 3;

/// The in-memory store behind a faulty namespace watch.
pub(crate) struct FaultyDiscovery {
    store: Arc<MemoryDiscovery>,
    world: Arc<World>,
}

impl FaultyDiscovery {
    pub(crate) fn new(store: Arc<MemoryDiscovery>, world: Arc<World>) -> Self {
        FaultyDiscovery { store, world }
    }
}

#[async_trait::async_trait]
impl Discovery for FaultyDiscovery {
    async fn register(
        &self,
        instance: Instance,
        card: ModelCard,
    ) -> Result<Registration, DiscoveryError> {
        self.store.register(instance, card).await
    }

    async fn list_instances(&self, endpoint: &EndpointId) -> Result<Vec<Instance>, DiscoveryError> {
        self.store.list_instances(endpoint).await
    }

    async fn list_cards(
        &self,
        endpoint: &EndpointId,
    ) -> Result<Vec<(InstanceId, ModelCard)>, DiscoveryError> {
        self.store.list_cards(endpoint).await
    }

    async fn list_namespace(
        &self,
        namespace: &str,
    ) -> Result<Vec<(Instance, ModelCard)>, DiscoveryError> {
        self.store.list_namespace(namespace).await
    }

    async fn watch(&self, endpoint: &EndpointId) -> Result<InstanceStream, DiscoveryError> {
        self.store.watch(endpoint).await
    }

    async fn watch_namespace(&self, namespace: &str) -> Result<NamespaceStream, DiscoveryError> {
        let mut inner = self.store.watch_namespace(namespace).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let world = Arc::clone(&self.world);
        let store = Arc::clone(&self.store);
        let namespace = namespace.to_owned();
        // The pump ends when the watcher drops the stream (the sends fail) or the store's
        // stream ends.
        tokio::spawn(async move {
            let mut seen: u64 = 0;
            let mut resync = tokio::time::interval(timing::RESYNC_PERIOD);
            resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    biased;
                    event = inner.next() => {
                        let Some(event) = event else { return };
                        seen += 1;
                        let delivery = feed::plan(&world, &[FEED_NAMESPACE, seen]);
                        let copy = tx.clone();
                        feed::deliver(delivery, move || {
                            let _ = copy.send(event.clone());
                        });
                        if tx.is_closed() {
                            return;
                        }
                    }
                    _ = resync.tick() => {
                        if !resync_from_listing(&store, &namespace, &tx).await {
                            return;
                        }
                    }
                }
            }
        });
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|event| (event, rx))
        });
        Ok(Box::pin(stream))
    }
}

/// Level-triggered resync: every listed record as an upsert, and a removal for every instance
/// of a listed-before endpoint that is gone. Returns false once the watcher is gone.
async fn resync_from_listing(
    store: &MemoryDiscovery,
    namespace: &str,
    tx: &mpsc::UnboundedSender<NamespaceEvent>,
) -> bool {
    let Ok(records) = store.list_namespace(namespace).await else {
        return !tx.is_closed();
    };
    let present: BTreeSet<(EndpointId, InstanceId)> = records
        .iter()
        .map(|(i, _)| (i.endpoint.clone(), i.instance_id))
        .collect();
    for (instance, card) in records {
        if tx.send(NamespaceEvent::Upserted(instance, card)).is_err() {
            return false;
        }
    }
    // Removals for the simulated endpoints' possible instances that are not listed; a removal
    // of an unknown instance is a no-op for the watcher.
    for endpoint in [
        super::world::prefill_endpoint(),
        super::pool::decode_endpoint(),
    ] {
        for id in 1..=super::pool::MAX_WORKERS {
            if !present.contains(&(endpoint.clone(), id))
                && tx
                    .send(NamespaceEvent::Removed(endpoint.clone(), id))
                    .is_err()
            {
                return false;
            }
        }
    }
    true
}
