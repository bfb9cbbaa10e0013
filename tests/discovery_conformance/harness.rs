//! Harness: what each backend provides to the suite.

use super::*;

#[async_trait::async_trait]
pub(crate) trait Harness: Send + Sync + Sized + 'static {
    /// A fresh, isolated store; `None` when the backend is unavailable here (skip).
    async fn start() -> Option<Self>;
    /// Another client of the same store, as another process would open it.
    async fn client(&self) -> Arc<dyn Discovery>;
    /// Store raw bytes under a record key, bypassing the API (a foreign or buggy writer).
    async fn write_raw(&self, key: &str, bytes: Vec<u8>);
    /// The lease TTL the harness configured.
    fn ttl(&self) -> Duration;
    /// How many registrations make a watcher that does not read fall behind its backend's
    /// buffers (so that it must resync).
    fn burst(&self) -> u64 {
        1500
    }
    /// Register `instance` in a worker that keeps its lease alive, then kill the worker
    /// without deregistering. Returns once the worker is dead; `observer` is used to wait
    /// until the registration is visible and to check it outlives the TTL while alive.
    ///
    /// By default the worker is in-process: a client registers, and the "kill" is
    /// `Registration::abandon`, which stops the keep-alive exactly as a death would. Backends
    /// with a store outside the process override it with a real worker process.
    async fn register_then_kill(
        &self,
        instance: Instance,
        card: ModelCard,
        observer: &dyn Discovery,
    ) {
        let worker = self.client().await;
        let registration = worker.register(instance.clone(), card).await.unwrap();
        outlives_ttl_while_alive(observer, &instance, self.ttl()).await;
        registration.abandon();
    }
}

pub(crate) fn unique(tag: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{tag}-{}-{nanos:x}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

pub(crate) struct MemoryHarness {
    pub(crate) store: MemoryDiscovery,
}

#[async_trait::async_trait]
impl Harness for MemoryHarness {
    async fn start() -> Option<Self> {
        Some(MemoryHarness {
            store: MemoryDiscovery::new(MemoryConfig::with_ttl(Duration::from_secs(2))),
        })
    }
    async fn client(&self) -> Arc<dyn Discovery> {
        Arc::new(self.store.clone())
    }
    async fn write_raw(&self, key: &str, bytes: Vec<u8>) {
        self.store.insert_raw(key, bytes);
    }
    fn ttl(&self) -> Duration {
        Duration::from_secs(2)
    }
}

pub(crate) struct FileHarness {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) ttl: Duration,
}

impl FileHarness {
    pub(crate) fn config(&self) -> FileConfig {
        let mut config = FileConfig::with_ttl(self.dir.path(), self.ttl);
        config.resync_interval = Duration::from_millis(500);
        config
    }
}

#[async_trait::async_trait]
impl Harness for FileHarness {
    async fn start() -> Option<Self> {
        Some(FileHarness {
            dir: tempfile::tempdir().unwrap(),
            ttl: Duration::from_secs(2),
        })
    }
    async fn client(&self) -> Arc<dyn Discovery> {
        Arc::new(FileDiscovery::new(self.config()))
    }
    async fn write_raw(&self, key: &str, bytes: Vec<u8>) {
        // The documented layout: `<root>/v1/instances/<key with '/' as '.'>`.
        let dir = self.dir.path().join("v1").join("instances");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(key.replace('/', ".")), bytes).unwrap();
    }
    fn ttl(&self) -> Duration {
        self.ttl
    }
    async fn register_then_kill(
        &self,
        instance: Instance,
        _card: ModelCard,
        observer: &dyn Discovery,
    ) {
        let location = self.dir.path().to_str().unwrap().to_owned();
        kill_child_worker("file", &location, "", self.ttl, &instance, observer).await;
    }
}

#[cfg(feature = "etcd")]
pub(crate) mod etcd_harness {
    use super::*;
    use prefill_router::discovery::{EtcdConfig, EtcdDiscovery};

    /// The etcd endpoint, or `None` (with a notice) outside CI. In CI a missing endpoint fails.
    pub fn endpoint() -> Option<String> {
        match std::env::var("PREFILL_ETCD_ENDPOINT") {
            Ok(endpoint) if !endpoint.is_empty() => Some(endpoint),
            _ => {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "PREFILL_ETCD_ENDPOINT is not set in CI: source .ci/etcd.sh in .ci/run"
                );
                eprintln!("NOTICE: PREFILL_ETCD_ENDPOINT unset; skipping etcd discovery test");
                None
            }
        }
    }

    pub struct EtcdHarness {
        pub endpoint: String,
        pub root: String,
        pub ttl: Duration,
    }

    impl EtcdHarness {
        pub fn config(&self) -> EtcdConfig {
            EtcdConfig::new([self.endpoint.clone()])
                .with_root(self.root.clone())
                .with_ttl(self.ttl)
        }
    }

    #[async_trait::async_trait]
    impl Harness for EtcdHarness {
        async fn start() -> Option<Self> {
            Some(EtcdHarness {
                endpoint: endpoint()?,
                // A random root per test isolates tests sharing the one server.
                root: format!("{}/", unique("prefill-test")),
                ttl: Duration::from_secs(2),
            })
        }
        async fn client(&self) -> Arc<dyn Discovery> {
            Arc::new(EtcdDiscovery::connect(self.config()).await.unwrap())
        }
        async fn write_raw(&self, key: &str, bytes: Vec<u8>) {
            let store = EtcdDiscovery::connect(self.config()).await.unwrap();
            store
                .client()
                .put(format!("{}{key}", self.root), bytes, None)
                .await
                .unwrap();
        }
        fn ttl(&self) -> Duration {
            self.ttl
        }
        fn burst(&self) -> u64 {
            // etcd has no lag to provoke (its stream is flow-controlled): a burst that fills
            // the watch's own channel is enough, and keeps the test short.
            400
        }
        async fn register_then_kill(
            &self,
            instance: Instance,
            _card: ModelCard,
            observer: &dyn Discovery,
        ) {
            kill_child_worker(
                "etcd",
                &self.endpoint,
                &self.root,
                self.ttl,
                &instance,
                observer,
            )
            .await;
        }
    }
}
