//! Mutants: deliberately broken backends. Each must make a suite case fail, which shows the
//! suite's checks can fail at all.

use super::*;

/// Which way a wrapped memory store is broken.
#[derive(Clone, Copy)]
enum Bug {
    /// Nothing in the wrapper is broken (the control, and the lease-timing mutant).
    Nothing,
    /// Every `Added` is delivered twice (a resync that does not diff).
    DuplicateAdded,
    /// An endpoint watch reports the whole namespace (a prefix-boundary bug).
    LeakyEndpointWatch,
}

struct Broken {
    store: MemoryDiscovery,
    bug: Bug,
}

#[async_trait::async_trait]
impl Discovery for Broken {
    async fn register(
        &self,
        instance: Instance,
        card: ModelCard,
    ) -> Result<prefill_router::discovery::Registration, DiscoveryError> {
        self.store.register(instance, card).await
    }
    async fn list_instances(&self, ep: &EndpointId) -> Result<Vec<Instance>, DiscoveryError> {
        self.store.list_instances(ep).await
    }
    async fn list_cards(
        &self,
        ep: &EndpointId,
    ) -> Result<Vec<(InstanceId, ModelCard)>, DiscoveryError> {
        self.store.list_cards(ep).await
    }
    async fn list_namespace(&self, ns: &str) -> Result<Vec<(Instance, ModelCard)>, DiscoveryError> {
        self.store.list_namespace(ns).await
    }
    async fn watch(&self, ep: &EndpointId) -> Result<InstanceStream, DiscoveryError> {
        match self.bug {
            Bug::Nothing => self.store.watch(ep).await,
            Bug::DuplicateAdded => {
                let inner = self.store.watch(ep).await?;
                Ok(Box::pin(inner.flat_map(|event| {
                    let twice = match &event {
                        InstanceEvent::Added(_) => vec![event.clone(), event],
                        InstanceEvent::Removed(_) => vec![event],
                    };
                    futures::stream::iter(twice)
                })))
            }
            Bug::LeakyEndpointWatch => {
                let inner = self.store.watch_namespace(&ep.namespace).await?;
                Ok(Box::pin(inner.map(|event| match event {
                    NamespaceEvent::Upserted(instance, _) => InstanceEvent::Added(instance),
                    NamespaceEvent::Removed(_, id) => InstanceEvent::Removed(id),
                })))
            }
        }
    }
    async fn watch_namespace(&self, ns: &str) -> Result<NamespaceStream, DiscoveryError> {
        self.store.watch_namespace(ns).await
    }
}

struct BrokenHarness {
    store: MemoryDiscovery,
    bug: Bug,
    ttl: Duration,
}

#[async_trait::async_trait]
impl Harness for BrokenHarness {
    async fn start() -> Option<Self> {
        unreachable!("mutant harnesses are built by hand")
    }
    async fn client(&self) -> Arc<dyn Discovery> {
        Arc::new(Broken {
            store: self.store.clone(),
            bug: self.bug,
        })
    }
    async fn write_raw(&self, key: &str, bytes: Vec<u8>) {
        self.store.insert_raw(key, bytes);
    }
    fn ttl(&self) -> Duration {
        self.ttl
    }
}

fn harness(bug: Bug, config: MemoryConfig) -> BrokenHarness {
    BrokenHarness {
        store: MemoryDiscovery::new(config),
        bug,
        ttl: config.ttl,
    }
}

/// Runs a case to completion and asserts that it failed.
async fn rejected<F>(case: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let outcome = tokio::time::timeout(Duration::from_secs(60), tokio::spawn(case))
        .await
        .expect("mutant case hung");
    assert!(
        outcome.is_err_and(|e| e.is_panic()),
        "the suite accepted a broken backend"
    );
}

fn sound() -> MemoryConfig {
    MemoryConfig::with_ttl(Duration::from_secs(2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_rejects_a_watch_that_duplicates_instances() {
    let h = harness(Bug::DuplicateAdded, sound());
    rejected(async move { register_list_and_watch_agree(&h).await }).await;
    let h = harness(Bug::DuplicateAdded, sound());
    rejected(async move { two_watchers_agree(&h).await }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_rejects_an_endpoint_watch_that_leaks_other_endpoints() {
    let h = harness(Bug::LeakyEndpointWatch, sound());
    rejected(async move { endpoints_and_namespaces_are_isolated(&h).await }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_rejects_leases_that_are_not_kept_alive() {
    // Renewing less often than the TTL: records of live workers expire.
    let config = MemoryConfig {
        ttl: Duration::from_millis(500),
        keepalive_interval: Duration::from_secs(30),
        reap_interval: Duration::from_millis(100),
    };
    let h = harness(Bug::Nothing, config);
    rejected(async move { killed_worker_lease_expires(&h).await }).await;
    let h = harness(Bug::Nothing, config);
    rejected(async move { reregister_with_changed_card_is_an_upsert(&h).await }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sound_wrapper_passes_so_the_mutants_fail_for_their_bug() {
    // Control: the same wrapper without a bug passes the cases the mutants fail.
    let h = harness(Bug::Nothing, sound());
    register_list_and_watch_agree(&h).await;
    let h = harness(Bug::Nothing, sound());
    two_watchers_agree(&h).await;
    let h = harness(Bug::Nothing, sound());
    endpoints_and_namespaces_are_isolated(&h).await;
    let h = harness(Bug::Nothing, sound());
    killed_worker_lease_expires(&h).await;
}
