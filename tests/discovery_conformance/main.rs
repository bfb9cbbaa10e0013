//! One conformance suite, run unchanged against every discovery backend.
//!
//! Each case is a generic async fn over a [`Harness`]; the `conformance!` macro instantiates
//! the whole list for a backend, so no backend can skip a case. Backends: memory, file,
//! (feature `etcd`) etcd against `PREFILL_ETCD_ENDPOINT`, and (feature `kubernetes`) Kubernetes
//! against an in-test API server. Without that variable the etcd cases print a notice and
//! pass, unless `CI` is set, where they fail.
//!
//! A killed worker is a real process: the test binary re-invokes itself (`child_worker_entry`)
//! to register, and is SIGKILLed. For the in-process memory backend the "kill" is
//! `Registration::abandon`, which stops the keep-alive exactly as a death would.
//!
//! Files: `harness.rs` (what each backend provides), `cases.rs` (the suite), `support.rs`
//! (helpers and the watchers' beliefs), `child.rs` (the killed worker process),
//! `file_store.rs` and `etcd_restart.rs` (backend specifics), `mutants.rs` (broken backends
//! the suite must reject), and for feature `kubernetes`: `k8s_server.rs` (the in-test API
//! server), `k8s_harness.rs` (the cases against the backend: it refuses `register`, so the
//! in-test cluster plays the worker side and ids are relabelled), `kubernetes.rs` and
//! `kubernetes/faults.rs` (the backend's own tests and its fault tests).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use prefill_router::advert::{ModelCard, SelectionMode};
use prefill_router::discovery::{
    record_key, Discovery, DiscoveryError, EndpointId, FileConfig, FileDiscovery, Instance,
    InstanceEvent, InstanceId, InstanceStream, MemoryConfig, MemoryDiscovery, NamespaceEvent,
    NamespaceStream,
};

/// How long any single expected event may take (debug builds on a loaded 2-core box).
const EVENT_WAIT: Duration = Duration::from_secs(15);
/// How long "nothing more happens" is observed.
const QUIET: Duration = Duration::from_millis(600);

mod cases;
mod child;
#[cfg(feature = "etcd")]
mod etcd_keepalive;
#[cfg(feature = "etcd")]
mod etcd_restart;
mod file_store;
mod harness;
#[cfg(feature = "kubernetes")]
mod k8s_harness;
#[cfg(feature = "kubernetes")]
mod k8s_server;
#[cfg(feature = "kubernetes")]
mod kubernetes;
mod mutants;
mod support;

use cases::*;
use child::*;
use harness::*;
use support::*;

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
// Named so that the filter `kubernetes` selects it with the backend's own tests.
#[cfg(feature = "kubernetes")]
conformance!(kubernetes_conformance, k8s_harness::K8sHarness);
