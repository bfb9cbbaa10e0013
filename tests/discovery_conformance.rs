//! One conformance suite, run unchanged against every discovery backend.
//!
//! Each case is a generic async fn over a [`Harness`]; the `conformance!` macro instantiates
//! the whole list for a backend, so no backend can skip a case. Backends: memory, file, and
//! (feature `etcd`) etcd against `PREFILL_ETCD_ENDPOINT`. Without that variable the etcd cases
//! print a notice and pass, unless `CI` is set, where they fail.
//!
//! A killed worker is a real process: the test binary re-invokes itself (`child_worker_entry`)
//! to register, and is SIGKILLed. For the in-process memory backend the "kill" is
//! `Registration::abandon`, which stops the keep-alive exactly as a death would.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use prefill_router::advert::{ModelCard, RouterConfig, RouterMode};
use prefill_router::discovery::{
    record_key, Discovery, DiscoveryError, EndpointId, FileConfig, FileDiscovery, Instance,
    InstanceEvent, InstanceId, InstanceStream, MemoryConfig, MemoryDiscovery, NamespaceEvent,
    NamespaceStream,
};

/// How long any single expected event may take (debug builds on a loaded 2-core box).
const EVENT_WAIT: Duration = Duration::from_secs(15);
/// How long "nothing more happens" is observed.
const QUIET: Duration = Duration::from_millis(600);

// ---------------------------------------------------------------------------------------------
// Harness: what each backend provides to the suite.

#[async_trait::async_trait]
trait Harness: Send + Sync + Sized + 'static {
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
    async fn register_then_kill(
        &self,
        instance: Instance,
        card: ModelCard,
        observer: &dyn Discovery,
    );
}

fn unique(tag: &str) -> String {
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

struct MemoryHarness {
    store: MemoryDiscovery,
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

struct FileHarness {
    dir: tempfile::TempDir,
    ttl: Duration,
}

impl FileHarness {
    fn config(&self) -> FileConfig {
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
mod etcd_harness {
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

// ---------------------------------------------------------------------------------------------
// The killed worker: this test binary, re-invoked.

const CHILD_BACKEND: &str = "PREFILL_CHILD_BACKEND";
const CHILD_LOCATION: &str = "PREFILL_CHILD_LOCATION";
const CHILD_ROOT: &str = "PREFILL_CHILD_ROOT";
const CHILD_TTL_MS: &str = "PREFILL_CHILD_TTL_MS";
const CHILD_INSTANCE: &str = "PREFILL_CHILD_INSTANCE";

/// Entry point of the worker process of the kill test: registers, then idles until killed.
/// Ignored in normal runs; the parent starts it with `--ignored --exact`.
#[test]
#[ignore = "entry point of the child worker process of the lease-expiry tests"]
fn child_worker_entry() {
    let Ok(backend) = std::env::var(CHILD_BACKEND) else {
        return; // run by hand with --ignored: nothing to do
    };
    let location = std::env::var(CHILD_LOCATION).unwrap();
    let ttl = Duration::from_millis(std::env::var(CHILD_TTL_MS).unwrap().parse().unwrap());
    let instance: Instance = serde_json::from_str(&std::env::var(CHILD_INSTANCE).unwrap()).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async move {
        let store: Arc<dyn Discovery> = match backend.as_str() {
            "file" => Arc::new(FileDiscovery::new(FileConfig::with_ttl(location, ttl))),
            #[cfg(feature = "etcd")]
            "etcd" => {
                let root = std::env::var(CHILD_ROOT).unwrap();
                let config = prefill_router::discovery::EtcdConfig::new([location])
                    .with_root(root)
                    .with_ttl(ttl);
                Arc::new(
                    prefill_router::discovery::EtcdDiscovery::connect(config)
                        .await
                        .unwrap(),
                )
            }
            other => panic!("unknown child backend {other}"),
        };
        let _registration = store
            .register(instance, ModelCard::named("child"))
            .await
            .unwrap();
        // The parent kills us long before this; the bound keeps an orphan from lingering.
        tokio::time::sleep(Duration::from_secs(60)).await;
        // Leave without running destructors: a polite deregister would defeat the test.
        std::process::exit(3);
    });
}

/// Kills the child on every path out of the parent (including a failed assertion).
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn kill_child_worker(
    backend: &str,
    location: &str,
    root: &str,
    ttl: Duration,
    instance: &Instance,
    observer: &dyn Discovery,
) {
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_worker_entry",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_BACKEND, backend)
        .env(CHILD_LOCATION, location)
        .env(CHILD_ROOT, root)
        .env(CHILD_TTL_MS, ttl.as_millis().to_string())
        .env(CHILD_INSTANCE, serde_json::to_string(instance).unwrap())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut child = ChildGuard(child);
    let started = Instant::now();
    while !observer
        .list_instances(&instance.endpoint)
        .await
        .unwrap()
        .contains(instance)
    {
        if let Ok(Some(status)) = child.0.try_wait() {
            panic!("child worker exited early: {status}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "child never registered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    outlives_ttl_while_alive(observer, instance, ttl).await;
    // SIGKILL: no destructor, no deregistration, no last keep-alive.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
}

/// A live worker's record survives well past its TTL: keep-alive works.
async fn outlives_ttl_while_alive(observer: &dyn Discovery, instance: &Instance, ttl: Duration) {
    tokio::time::sleep(ttl + ttl / 2).await;
    assert!(
        observer
            .list_instances(&instance.endpoint)
            .await
            .unwrap()
            .contains(instance),
        "a live worker's record expired: keep-alive is not working"
    );
}

// ---------------------------------------------------------------------------------------------
// Helpers.

fn endpoint(ns: &str, component: &str) -> EndpointId {
    EndpointId::new(ns, component, "generate")
}

fn instance(endpoint: &EndpointId, id: InstanceId) -> Instance {
    Instance {
        endpoint: endpoint.clone(),
        instance_id: id,
        address: SocketAddr::from(([127, 0, 0, 1], 20_000 + (id % 10_000) as u16)),
    }
}

fn card(name: &str, mode: RouterMode) -> ModelCard {
    ModelCard {
        router_config: Some(RouterConfig {
            router_mode: mode,
            ..RouterConfig::default()
        }),
        kv_cache_block_size: 16,
        ..ModelCard::named(name)
    }
}

async fn next<S: Stream + Unpin>(stream: &mut S) -> S::Item {
    match tokio::time::timeout(EVENT_WAIT, stream.next()).await {
        Ok(Some(item)) => item,
        Ok(None) => panic!("watch ended"),
        Err(_) => panic!("no event within {EVENT_WAIT:?}"),
    }
}

/// Asserts the stream stays silent for `QUIET`.
async fn assert_quiet<S: Stream + Unpin>(stream: &mut S)
where
    S::Item: std::fmt::Debug,
{
    if let Ok(item) = tokio::time::timeout(QUIET, stream.next()).await {
        panic!("unexpected watch event: {item:?}");
    }
}

/// What an endpoint watcher believes, built only from its events. Rejects duplicates (an
/// `Added` of an instance already known unchanged) and removals of unknown instances.
#[derive(Debug, Default)]
struct View {
    instances: BTreeMap<InstanceId, Instance>,
    removals: usize,
}

impl View {
    fn apply(&mut self, event: InstanceEvent) {
        match event {
            InstanceEvent::Added(instance) => {
                let previous = self
                    .instances
                    .insert(instance.instance_id, instance.clone());
                assert_ne!(previous, Some(instance), "duplicate Added");
            }
            InstanceEvent::Removed(id) => {
                assert!(
                    self.instances.remove(&id).is_some(),
                    "Removed of unknown {id}"
                );
                self.removals += 1;
            }
        }
    }

    fn is(&self, expected: &[&Instance]) -> bool {
        self.instances.len() == expected.len()
            && expected
                .iter()
                .all(|i| self.instances.get(&i.instance_id) == Some(*i))
    }

    /// Apply events until the view holds exactly `expected`.
    async fn until(&mut self, stream: &mut InstanceStream, expected: &[&Instance]) {
        while !self.is(expected) {
            self.apply(next(stream).await);
        }
    }
}

/// A namespace watcher's belief.
#[derive(Debug, Default)]
struct NsView {
    records: BTreeMap<(EndpointId, InstanceId), (Instance, ModelCard)>,
}

impl NsView {
    fn apply(&mut self, event: NamespaceEvent) {
        match event {
            NamespaceEvent::Upserted(instance, card) => {
                let key = (instance.endpoint.clone(), instance.instance_id);
                let record = (instance, card);
                let previous = self.records.insert(key, record.clone());
                assert_ne!(previous, Some(record), "duplicate Upserted");
            }
            NamespaceEvent::Removed(endpoint, id) => {
                assert!(
                    self.records.remove(&(endpoint, id)).is_some(),
                    "Removed of unknown {id}"
                );
            }
        }
    }

    async fn until(&mut self, stream: &mut NamespaceStream, expected: &[(&Instance, &ModelCard)]) {
        loop {
            let matches = self.records.len() == expected.len()
                && expected.iter().all(|(i, c)| {
                    self.records.get(&(i.endpoint.clone(), i.instance_id))
                        == Some(&((*i).clone(), (*c).clone()))
                });
            if matches {
                return;
            }
            self.apply(next(stream).await);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The cases.

async fn register_list_and_watch_agree<H: Harness>(h: &H) {
    let store = h.client().await;
    let ns = unique("ns");
    let ep = endpoint(&ns, "prefill");
    let (a, b) = (instance(&ep, 1), instance(&ep, 2));
    let (card_a, card_b) = (card("m", RouterMode::KV), card("m", RouterMode::RoundRobin));
    let mut watch = store.watch(&ep).await.unwrap();
    let _ra = store.register(a.clone(), card_a.clone()).await.unwrap();
    let _rb = store.register(b.clone(), card_b.clone()).await.unwrap();
    let mut view = View::default();
    view.until(&mut watch, &[&a, &b]).await;
    assert_quiet(&mut watch).await;
    assert_eq!(
        store.list_instances(&ep).await.unwrap(),
        vec![a.clone(), b.clone()]
    );
    assert_eq!(
        store.list_cards(&ep).await.unwrap(),
        vec![(1, card_a.clone()), (2, card_b.clone())]
    );
    assert_eq!(
        store.list_namespace(&ns).await.unwrap(),
        vec![(a, card_a), (b, card_b)]
    );
}

async fn watcher_started_after_registrations_sees_them<H: Harness>(h: &H) {
    let worker = h.client().await;
    let frontend = h.client().await;
    let ns = unique("ns");
    let ep = endpoint(&ns, "prefill");
    let (a, b) = (instance(&ep, 10), instance(&ep, 11));
    let _ra = worker
        .register(a.clone(), card("m", RouterMode::KV))
        .await
        .unwrap();
    let _rb = worker
        .register(b.clone(), card("m", RouterMode::KV))
        .await
        .unwrap();
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut view = View::default();
    view.until(&mut watch, &[&a, &b]).await;
    assert_quiet(&mut watch).await;
    let mut ns_watch = frontend.watch_namespace(&ns).await.unwrap();
    let mut ns_view = NsView::default();
    let c = card("m", RouterMode::KV);
    ns_view.until(&mut ns_watch, &[(&a, &c), (&b, &c)]).await;
}

async fn deregister_is_seen_promptly<H: Harness>(h: &H) {
    let worker = h.client().await;
    let frontend = h.client().await;
    let ep = endpoint(&unique("ns"), "prefill");
    let (a, b) = (instance(&ep, 20), instance(&ep, 21));
    let ra = worker
        .register(a.clone(), card("m", RouterMode::KV))
        .await
        .unwrap();
    let _rb = worker
        .register(b.clone(), card("m", RouterMode::KV))
        .await
        .unwrap();
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut view = View::default();
    view.until(&mut watch, &[&a, &b]).await;
    let started = Instant::now();
    ra.deregister().await.unwrap();
    assert_eq!(next(&mut watch).await, InstanceEvent::Removed(20));
    // Well before the TTL: a polite deregistration, not an expiry.
    assert!(
        started.elapsed() < h.ttl(),
        "deregistration took {:?}",
        started.elapsed()
    );
    assert_eq!(frontend.list_instances(&ep).await.unwrap(), vec![b]);
}

async fn dropped_registration_is_removed<H: Harness>(h: &H) {
    let worker = h.client().await;
    let ep = endpoint(&unique("ns"), "prefill");
    let a = instance(&ep, 30);
    let ra = worker
        .register(a.clone(), card("m", RouterMode::KV))
        .await
        .unwrap();
    let mut watch = worker.watch(&ep).await.unwrap();
    assert_eq!(next(&mut watch).await, InstanceEvent::Added(a));
    drop(ra);
    assert_eq!(next(&mut watch).await, InstanceEvent::Removed(30));
}

async fn killed_worker_lease_expires<H: Harness>(h: &H) {
    let frontend = h.client().await;
    let ep = endpoint(&unique("ns"), "prefill");
    let (dead, alive) = (instance(&ep, 40), instance(&ep, 41));
    let _ralive = frontend
        .register(alive.clone(), card("m", RouterMode::KV))
        .await
        .unwrap();
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut view = View::default();
    view.until(&mut watch, &[&alive]).await;
    h.register_then_kill(dead.clone(), card("m", RouterMode::KV), frontend.as_ref())
        .await;
    let killed = Instant::now();
    // The dead worker was seen, then expires within its TTL plus detection slack.
    view.until(&mut watch, &[&alive, &dead]).await;
    view.until(&mut watch, &[&alive]).await;
    assert_eq!(view.removals, 1, "exactly the dead worker was removed");
    let took = killed.elapsed();
    assert!(
        took < h.ttl() * 3 + Duration::from_secs(3),
        "expiry took {took:?}"
    );
    assert_eq!(frontend.list_instances(&ep).await.unwrap(), vec![alive]);
}

async fn reregister_with_changed_card_is_an_upsert<H: Harness>(h: &H) {
    let worker = h.client().await;
    let frontend = h.client().await;
    let ns = unique("ns");
    let ep = endpoint(&ns, "prefill");
    let a = instance(&ep, 50);
    let (v1, v2) = (card("m", RouterMode::RoundRobin), card("m", RouterMode::KV));
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut ns_watch = frontend.watch_namespace(&ns).await.unwrap();
    let first = worker.register(a.clone(), v1.clone()).await.unwrap();
    assert_eq!(
        next(&mut ns_watch).await,
        NamespaceEvent::Upserted(a.clone(), v1)
    );
    let second = worker.register(a.clone(), v2.clone()).await.unwrap();
    assert_eq!(
        next(&mut ns_watch).await,
        NamespaceEvent::Upserted(a.clone(), v2.clone())
    );
    assert_eq!(
        frontend.list_cards(&ep).await.unwrap(),
        vec![(50, v2.clone())]
    );
    // The instance itself did not change: one Added, no duplicate.
    assert_eq!(next(&mut watch).await, InstanceEvent::Added(a.clone()));
    assert_quiet(&mut watch).await;
    // The superseded registration must not take its successor's record with it.
    drop(first);
    tokio::time::sleep(h.ttl() + h.ttl() / 2).await;
    assert_eq!(frontend.list_cards(&ep).await.unwrap(), vec![(50, v2)]);
    assert_quiet(&mut watch).await;
    second.deregister().await.unwrap();
    assert_eq!(next(&mut watch).await, InstanceEvent::Removed(50));
}

async fn two_watchers_agree<H: Harness>(h: &H) {
    let worker = h.client().await;
    let (f1, f2) = (h.client().await, h.client().await);
    let ep = endpoint(&unique("ns"), "prefill");
    let mut w1 = f1.watch(&ep).await.unwrap();
    let mut w2 = f2.watch(&ep).await.unwrap();
    let instances: Vec<Instance> = (60..64).map(|id| instance(&ep, id)).collect();
    let mut registrations = Vec::new();
    for i in &instances {
        registrations.push(
            worker
                .register(i.clone(), card("m", RouterMode::KV))
                .await
                .unwrap(),
        );
    }
    let gone = registrations.remove(1);
    gone.deregister().await.unwrap();
    let expected: Vec<&Instance> = instances.iter().filter(|i| i.instance_id != 61).collect();
    let (mut v1, mut v2) = (View::default(), View::default());
    v1.until(&mut w1, &expected).await;
    v2.until(&mut w2, &expected).await;
    assert_quiet(&mut w1).await;
    assert_quiet(&mut w2).await;
    assert_eq!(v1.instances, v2.instances);
}

async fn malformed_records_are_skipped_and_never_stop_the_watch<H: Harness>(h: &H) {
    let worker = h.client().await;
    let frontend = h.client().await;
    let ns = unique("ns");
    let ep = endpoint(&ns, "prefill");
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut ns_watch = frontend.watch_namespace(&ns).await.unwrap();
    let good_before = instance(&ep, 70);
    let _r0 = worker
        .register(good_before.clone(), card("m", RouterMode::KV))
        .await
        .unwrap();
    assert_eq!(
        next(&mut watch).await,
        InstanceEvent::Added(good_before.clone())
    );
    // Not JSON; a good instance with an unreadable card; a record under another's key.
    h.write_raw(&record_key(&ep, 71), b"{not json".to_vec())
        .await;
    let bad_card = format!(
        "{{\"instance\":{},\"card\":{{\"name\":7}}}}",
        serde_json::to_string(&instance(&ep, 72)).unwrap()
    );
    h.write_raw(&record_key(&ep, 72), bad_card.into_bytes())
        .await;
    let misplaced =
        prefill_router::discovery::encode_record(&instance(&ep, 73), &card("m", RouterMode::KV));
    h.write_raw(&record_key(&ep, 74), misplaced).await;
    let good_after = instance(&ep, 75);
    let _r1 = worker
        .register(good_after.clone(), card("m", RouterMode::KV))
        .await
        .unwrap();
    // The watch goes on past the junk and reports only the good record.
    assert_eq!(
        next(&mut watch).await,
        InstanceEvent::Added(good_after.clone())
    );
    let c = card("m", RouterMode::KV);
    let mut ns_view = NsView::default();
    ns_view
        .until(&mut ns_watch, &[(&good_before, &c), (&good_after, &c)])
        .await;
    assert_quiet(&mut watch).await;
    assert_eq!(
        frontend.list_instances(&ep).await.unwrap(),
        vec![good_before.clone(), good_after.clone()]
    );
    assert_eq!(
        frontend.list_cards(&ep).await.unwrap(),
        vec![(70, c.clone()), (75, c.clone())]
    );
    assert_eq!(frontend.list_namespace(&ns).await.unwrap().len(), 2);
    // A watcher started now, with the junk in place, sees only the good records.
    let mut late = frontend.watch(&ep).await.unwrap();
    let mut view = View::default();
    view.until(&mut late, &[&good_before, &good_after]).await;
    assert_quiet(&mut late).await;
}

async fn endpoints_and_namespaces_are_isolated<H: Harness>(h: &H) {
    let store = h.client().await;
    let ns = unique("ns");
    let ep = endpoint(&ns, "comp");
    let near = [
        endpoint(&ns, "comp2"),
        EndpointId::new(&ns, "comp", "generate2"),
        EndpointId::new(format!("{ns}/comp"), "generate", "x"),
        endpoint(&format!("{ns}2"), "comp"),
    ];
    let mut watch = store.watch(&ep).await.unwrap();
    let mut ns_watch = store.watch_namespace(&ns).await.unwrap();
    let mut held = Vec::new();
    for (n, other) in near.iter().enumerate() {
        held.push(
            store
                .register(instance(other, 80 + n as u64), card("m", RouterMode::KV))
                .await
                .unwrap(),
        );
    }
    let mine = instance(&ep, 90);
    held.push(
        store
            .register(mine.clone(), card("m", RouterMode::KV))
            .await
            .unwrap(),
    );
    assert_eq!(next(&mut watch).await, InstanceEvent::Added(mine.clone()));
    assert_quiet(&mut watch).await;
    assert_eq!(store.list_instances(&ep).await.unwrap(), vec![mine.clone()]);
    // The namespace holds its own three endpoints, not `{ns}/comp` nor `{ns}2`.
    let in_ns = store.list_namespace(&ns).await.unwrap();
    assert_eq!(in_ns.len(), 3, "{in_ns:?}");
    assert!(in_ns.iter().all(|(i, _)| i.endpoint.namespace == ns));
    let mut ns_view = NsView::default();
    let c = card("m", RouterMode::KV);
    let (i80, i81) = (instance(&near[0], 80), instance(&near[1], 81));
    ns_view
        .until(&mut ns_watch, &[(&i80, &c), (&i81, &c), (&mine, &c)])
        .await;
    assert_quiet(&mut ns_watch).await;
}

async fn lagging_watcher_catches_up_without_loss_or_duplicates<H: Harness>(h: &H) {
    let worker = h.client().await;
    let frontend = h.client().await;
    let ep = endpoint(&unique("ns"), "prefill");
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut ns_watch = frontend.watch_namespace(&ep.namespace).await.unwrap();
    // Nobody reads the watches while a burst lands: their buffers overflow.
    let mut held = Vec::new();
    let instances: Vec<Instance> = (0..h.burst()).map(|id| instance(&ep, 1000 + id)).collect();
    for i in &instances {
        held.push(
            worker
                .register(i.clone(), card("m", RouterMode::KV))
                .await
                .unwrap(),
        );
    }
    // Half of them leave again before anyone looks.
    let mut survivors = Vec::new();
    for (n, registration) in held.into_iter().enumerate() {
        if n % 2 == 0 {
            registration.deregister().await.unwrap();
        } else {
            survivors.push(registration);
        }
    }
    let expected: Vec<&Instance> = instances.iter().skip(1).step_by(2).collect();
    let mut view = View::default();
    view.until(&mut watch, &expected).await;
    assert_quiet(&mut watch).await;
    let c = card("m", RouterMode::KV);
    let expected_ns: Vec<(&Instance, &ModelCard)> = expected.iter().map(|i| (*i, &c)).collect();
    let mut ns_view = NsView::default();
    ns_view.until(&mut ns_watch, &expected_ns).await;
}

async fn invalid_instance_is_rejected<H: Harness>(h: &H) {
    let store = h.client().await;
    let bad = instance(&EndpointId::new("", "prefill", "generate"), 1);
    let result = store.register(bad, ModelCard::named("m")).await;
    assert!(matches!(result, Err(DiscoveryError::InvalidInstance(_))));
}

// ---------------------------------------------------------------------------------------------
// Instantiation: the same case list for every backend.

macro_rules! conformance {
    ($module:ident, $harness:ty) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            conformance!(@cases $harness;
                register_list_and_watch_agree,
                watcher_started_after_registrations_sees_them,
                deregister_is_seen_promptly,
                dropped_registration_is_removed,
                killed_worker_lease_expires,
                reregister_with_changed_card_is_an_upsert,
                two_watchers_agree,
                malformed_records_are_skipped_and_never_stop_the_watch,
                endpoints_and_namespaces_are_isolated,
                lagging_watcher_catches_up_without_loss_or_duplicates,
                invalid_instance_is_rejected,
            );
        }
    };
    (@cases $harness:ty; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                if let Some(harness) = <$harness as Harness>::start().await {
                    tokio::time::timeout(Duration::from_secs(90), super::$case(&harness))
                        .await
                        .expect("conformance case timed out");
                }
            }
        )*
    };
}

conformance!(memory, MemoryHarness);
conformance!(file, FileHarness);
#[cfg(feature = "etcd")]
conformance!(etcd, etcd_harness::EtcdHarness);

// ---------------------------------------------------------------------------------------------
// File-store specifics: the on-disk layout and its lease by mtime.

mod file_store {
    use super::*;
    use prefill_router::discovery::encode_record;

    fn record_path(h: &FileHarness, key: &str) -> std::path::PathBuf {
        h.dir
            .path()
            .join("v1")
            .join("instances")
            .join(key.replace('/', "."))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn expired_record_files_are_ignored_and_reaped() {
        let h = FileHarness::start().await.unwrap();
        let ep = endpoint("ns", "prefill");
        let (stale, fresh) = (instance(&ep, 1), instance(&ep, 2));
        for i in [&stale, &fresh] {
            let bytes = encode_record(i, &card("m", RouterMode::KV));
            h.write_raw(&record_key(&ep, i.instance_id), bytes).await;
        }
        // A heartbeat two TTLs ago: expired, as a crashed worker's file would be.
        let stale_path = record_path(&h, &record_key(&ep, 1));
        std::fs::File::options()
            .write(true)
            .open(&stale_path)
            .unwrap()
            .set_modified(std::time::SystemTime::now() - h.ttl * 2)
            .unwrap();
        let store = h.client().await;
        assert_eq!(
            store.list_instances(&ep).await.unwrap(),
            vec![fresh.clone()]
        );
        let mut watch = store.watch(&ep).await.unwrap();
        assert_eq!(next(&mut watch).await, InstanceEvent::Added(fresh));
        // This process's reaper deletes the expired file.
        let started = Instant::now();
        while stale_path.exists() {
            assert!(
                started.elapsed() < EVENT_WAIT,
                "expired record never reaped"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn temp_files_are_never_read_as_records() {
        let h = FileHarness::start().await.unwrap();
        let ep = endpoint("ns", "prefill");
        let store = h.client().await;
        let mut watch = store.watch(&ep).await.unwrap();
        let half_written = encode_record(&instance(&ep, 1), &card("m", RouterMode::KV));
        let dir = h.dir.path().join("v1").join("instances");
        std::fs::write(dir.join(".tmp-half-written"), half_written).unwrap();
        assert!(store.list_instances(&ep).await.unwrap().is_empty());
        assert_quiet(&mut watch).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_are_published_by_atomic_rename_in_the_documented_layout() {
        let h = FileHarness::start().await.unwrap();
        let ep = endpoint("ns", "prefill");
        let a = instance(&ep, 0x2a);
        let _r = h
            .client()
            .await
            .register(a.clone(), card("m", RouterMode::KV))
            .await
            .unwrap();
        let path = record_path(&h, &record_key(&ep, 0x2a));
        assert!(path.ends_with("ns.prefill.generate.000000000000002a"));
        let bytes = std::fs::read(&path).unwrap();
        let (read, _) =
            prefill_router::discovery::decode_record(&record_key(&ep, 0x2a), &bytes).unwrap();
        assert_eq!(read, a);
        // Nothing but the record is left behind (the temp file was renamed, not copied).
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// The store restarting: etcd killed and restarted under live workers and watchers.

#[cfg(feature = "etcd")]
mod etcd_restart {
    use super::*;
    use prefill_router::discovery::{EtcdConfig, EtcdDiscovery};
    use std::process::{Child, Command, Stdio};

    /// An etcd server of our own, on spare loopback ports, killed on drop.
    struct OwnEtcd {
        child: Option<Child>,
        data: tempfile::TempDir,
        port: u16,
        peer_port: u16,
    }

    fn spare_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    impl OwnEtcd {
        fn endpoint(&self) -> String {
            format!("http://127.0.0.1:{}", self.port)
        }

        fn launch(&mut self) {
            let client = format!("http://127.0.0.1:{}", self.port);
            let peer = format!("http://127.0.0.1:{}", self.peer_port);
            let log = std::fs::File::create(self.data.path().join("etcd.log")).unwrap();
            let child = Command::new("etcd")
                .args(["--name", "restart-test", "--data-dir"])
                .arg(self.data.path().join("data"))
                .args([
                    "--listen-client-urls",
                    &client,
                    "--advertise-client-urls",
                    &client,
                ])
                .args([
                    "--listen-peer-urls",
                    &peer,
                    "--initial-advertise-peer-urls",
                    &peer,
                ])
                .arg("--initial-cluster")
                .arg(format!("restart-test={peer}"))
                .args(["--initial-cluster-state", "new"])
                .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
                .args(["--log-level", "warn", "--logger", "zap"])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("cannot start etcd");
            self.child = Some(child);
        }

        fn kill(&mut self) {
            if let Some(mut child) = self.child.take() {
                let _ = child.kill(); // SIGKILL: no graceful shutdown
                let _ = child.wait();
            }
        }

        async fn wait_healthy(&self) {
            let started = Instant::now();
            loop {
                let config = EtcdConfig::new([self.endpoint()]).with_root("health/");
                if let Ok(store) = EtcdDiscovery::connect(config).await {
                    if store.list_namespace("probe").await.is_ok() {
                        return;
                    }
                }
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "own etcd not healthy: {}",
                    std::fs::read_to_string(self.data.path().join("etcd.log")).unwrap_or_default()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    impl Drop for OwnEtcd {
        fn drop(&mut self) {
            self.kill();
        }
    }

    fn etcd_binary_available() -> bool {
        let found = Command::new("etcd")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            assert!(
                std::env::var_os("CI").is_none(),
                "the etcd binary is missing in CI: source .ci/etcd.sh in .ci/run"
            );
            eprintln!("NOTICE: no etcd binary; skipping the etcd restart test");
        }
        found
    }

    async fn register_retrying(
        store: &EtcdDiscovery,
        instance: &Instance,
    ) -> prefill_router::discovery::Registration {
        let started = Instant::now();
        loop {
            match store
                .register(instance.clone(), card("m", RouterMode::KV))
                .await
            {
                Ok(registration) => return registration,
                Err(error) => {
                    assert!(
                        started.elapsed() < Duration::from_secs(20),
                        "register: {error}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_killed_and_restarted_resumes_watch_without_loss_or_duplicates() {
        if !etcd_binary_available() {
            return;
        }
        let mut etcd = OwnEtcd {
            child: None,
            data: tempfile::tempdir().unwrap(),
            port: spare_port(),
            peer_port: spare_port(),
        };
        etcd.launch();
        etcd.wait_healthy().await;
        let ttl = Duration::from_secs(4);
        let config = EtcdConfig::new([etcd.endpoint()])
            .with_root("restart/")
            .with_ttl(ttl);
        let worker = EtcdDiscovery::connect(config.clone()).await.unwrap();
        let frontend = EtcdDiscovery::connect(config).await.unwrap();
        let ep = endpoint("ns", "prefill");
        let (a, b, c) = (instance(&ep, 1), instance(&ep, 2), instance(&ep, 3));
        let _ra = register_retrying(&worker, &a).await;
        let _rb = register_retrying(&worker, &b).await;
        let mut watch = frontend.watch(&ep).await.unwrap();
        let mut ns_watch = frontend.watch_namespace("ns").await.unwrap();
        let mut view = View::default();
        view.until(&mut watch, &[&a, &b]).await;

        etcd.kill();
        tokio::time::sleep(Duration::from_secs(1)).await;
        etcd.launch();
        etcd.wait_healthy().await;

        // A worker registering after the restart is seen by the resumed watch ...
        let _rc = register_retrying(&worker, &c).await;
        view.until(&mut watch, &[&a, &b, &c]).await;
        // ... and the workers that lived through the outage were never lost (no removal)
        // nor duplicated (the view rejects a repeated Added).
        assert_eq!(view.removals, 0);
        let k = card("m", RouterMode::KV);
        let mut ns_view = NsView::default();
        ns_view
            .until(&mut ns_watch, &[(&a, &k), (&b, &k), (&c, &k)])
            .await;
        // Their leases are kept alive across the restart: still there after a full TTL.
        tokio::time::sleep(ttl + ttl / 2).await;
        assert_eq!(
            frontend.list_instances(&ep).await.unwrap(),
            vec![a.clone(), b.clone(), c.clone()]
        );
        assert_quiet(&mut watch).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Mutants: deliberately broken backends. Each must make a suite case fail, which shows the
// suite's checks can fail at all.

mod mutants {
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
        async fn list_namespace(
            &self,
            ns: &str,
        ) -> Result<Vec<(Instance, ModelCard)>, DiscoveryError> {
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
        async fn register_then_kill(
            &self,
            instance: Instance,
            card: ModelCard,
            observer: &dyn Discovery,
        ) {
            let worker = self.client().await;
            let registration = worker.register(instance.clone(), card).await.unwrap();
            outlives_ttl_while_alive(observer, &instance, self.ttl).await;
            registration.abandon();
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
}
