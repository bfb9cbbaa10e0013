//! Discovery propagation: how long from `register` returning until a watcher in another client
//! of the same store sees `Added`, and from `deregister` until it sees `Removed`.
//!
//! `cargo bench --bench discovery -- --warm-up-time 1 --measurement-time 3`
//! (with `--features etcd` and `PREFILL_ETCD_ENDPOINT` set, etcd too).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use futures::StreamExt;
use prefill_router::advert::ModelCard;
use prefill_router::discovery::{
    Discovery, EndpointId, FileConfig, FileDiscovery, Instance, InstanceEvent, InstanceStream,
    MemoryConfig, MemoryDiscovery,
};

/// Time `iters` register→Added and deregister→Removed round trips; returns (add, remove).
async fn propagation(
    worker: Arc<dyn Discovery>,
    watch: &mut InstanceStream,
    endpoint: &EndpointId,
    iters: u64,
) -> (Duration, Duration) {
    let (mut add, mut remove) = (Duration::ZERO, Duration::ZERO);
    for id in 0..iters {
        let instance = Instance {
            endpoint: endpoint.clone(),
            instance_id: id,
            address: SocketAddr::from(([127, 0, 0, 1], 9000)),
        };
        let started = Instant::now();
        let registration = worker
            .register(instance.clone(), ModelCard::named("bench"))
            .await
            .expect("register");
        loop {
            match watch.next().await.expect("watch ended") {
                InstanceEvent::Added(seen) if seen == instance => break,
                _ => {}
            }
        }
        add += started.elapsed();
        let started = Instant::now();
        registration.deregister().await.expect("deregister");
        loop {
            match watch.next().await.expect("watch ended") {
                InstanceEvent::Removed(seen) if seen == id => break,
                _ => {}
            }
        }
        remove += started.elapsed();
    }
    (add, remove)
}

fn bench_backend(
    c: &mut Criterion,
    name: &str,
    runtime: &tokio::runtime::Runtime,
    worker: Arc<dyn Discovery>,
    frontend: Arc<dyn Discovery>,
) {
    let endpoint = EndpointId::new("bench", name, "generate");
    let mut watch = runtime.block_on(frontend.watch(&endpoint)).expect("watch");
    let mut group = c.benchmark_group(format!("discovery/{name}"));
    // Each measured iteration is one register→Added; its deregister→Removed is timed
    // separately below, so the two figures are not mixed.
    group.bench_function("register_to_added", |b| {
        b.iter_custom(|iters| {
            runtime
                .block_on(propagation(worker.clone(), &mut watch, &endpoint, iters))
                .0
        })
    });
    group.bench_function("deregister_to_removed", |b| {
        b.iter_custom(|iters| {
            runtime
                .block_on(propagation(worker.clone(), &mut watch, &endpoint, iters))
                .1
        })
    });
    group.finish();
}

fn discovery(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let _guard = runtime.enter();

    let memory = MemoryDiscovery::new(MemoryConfig::default());
    bench_backend(
        c,
        "memory",
        &runtime,
        Arc::new(memory.clone()),
        Arc::new(memory),
    );

    let dir = tempfile::tempdir().expect("tempdir");
    bench_backend(
        c,
        "file",
        &runtime,
        Arc::new(FileDiscovery::new(FileConfig::new(dir.path()))),
        Arc::new(FileDiscovery::new(FileConfig::new(dir.path()))),
    );

    #[cfg(feature = "etcd")]
    if let Ok(endpoint) = std::env::var("PREFILL_ETCD_ENDPOINT") {
        use prefill_router::discovery::{EtcdConfig, EtcdDiscovery};
        let config =
            EtcdConfig::new([endpoint]).with_root(format!("bench-{}/", std::process::id()));
        let worker = runtime
            .block_on(EtcdDiscovery::connect(config.clone()))
            .expect("etcd");
        let frontend = runtime
            .block_on(EtcdDiscovery::connect(config))
            .expect("etcd");
        bench_backend(c, "etcd", &runtime, Arc::new(worker), Arc::new(frontend));
    }
}

// In a private module: `criterion_group!` generates an undocumented `pub fn`.
mod group {
    use super::*;
    criterion_group!(benches, discovery);
}
criterion_main!(group::benches);
