//! A short retarget storm over the real watcher (the full 100,000 is
//! `cargo run --release --example retarget_storm`): every request served, none dispatched
//! outside admission or on a replaced target.

mod e2e;

use e2e::storm::{storm, StormConfig, StormReport};

fn check(backend: &str, report: &StormReport, wanted: u64) {
    eprintln!("{backend}: {report:?}");
    assert!(report.retargets >= wanted, "{backend}: {report:?}");
    assert!(report.served > 0, "{backend}: no request served");
    assert!(
        report.quiet_checked > 0,
        "{backend}: no request checked against its target"
    );
    assert!(report.clean(), "{backend}: {report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retarget_storm_on_memory_loses_nothing_and_never_routes_on_a_replaced_target() {
    let discovery: std::sync::Arc<dyn prefill_router::discovery::Discovery> =
        std::sync::Arc::new(prefill_router::discovery::MemoryDiscovery::new(
            prefill_router::discovery::MemoryConfig::default(),
        ));
    let config = StormConfig {
        retargets: 2_000,
        streams: 8,
        progress: false,
    };
    let report = storm(discovery, config).await;
    check("memory", &report, 2_000);
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retarget_storm_on_etcd_loses_nothing_and_never_routes_on_a_replaced_target() {
    let Some(discovery) = e2e::etcd_store(std::time::Duration::from_secs(5)).await else {
        return;
    };
    let config = StormConfig {
        retargets: 300,
        streams: 8,
        progress: false,
    };
    let report = storm(discovery, config).await;
    check("etcd", &report, 300);
}
