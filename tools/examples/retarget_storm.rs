//! A retarget storm at scale: 100,000 target changes (generation rolls, clears, returns) over
//! the real topology watcher while 8 request streams run through a `PrefillHop`, on the
//! in-memory store or on etcd. Exits non-zero if a request was lost, dispatched outside
//! admission or on a replaced target.
//!
//! ```sh
//! cargo run --release -p prefill-router-tools --example retarget_storm                       # memory, 100,000
//! PREFILL_ETCD_ENDPOINT=http://127.0.0.1:2379 \
//!   cargo run --release -p prefill-router-tools --features etcd --example retarget_storm -- --backend etcd
//! cargo run --release -p prefill-router-tools --example retarget_storm -- --retargets 10000 --streams 4
//! ```

#[path = "../tests/e2e/mod.rs"]
mod e2e;

use std::sync::Arc;

use e2e::storm::{storm, StormConfig};
use prefill_router::discovery::{Discovery, MemoryConfig, MemoryDiscovery};

fn usage() -> ! {
    eprintln!("usage: retarget_storm [--backend memory|etcd] [--retargets N] [--streams N]");
    std::process::exit(2)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut backend = "memory".to_owned();
    let mut config = StormConfig {
        retargets: 100_000,
        streams: 8,
        progress: true,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        match arg.as_str() {
            "--backend" => backend = value,
            "--retargets" => config.retargets = value.parse().unwrap_or_else(|_| usage()),
            "--streams" => config.streams = value.parse().unwrap_or_else(|_| usage()),
            _ => usage(),
        }
    }
    let discovery: Arc<dyn Discovery> = match backend.as_str() {
        "memory" => Arc::new(MemoryDiscovery::new(MemoryConfig::default())),
        #[cfg(feature = "etcd")]
        "etcd" => match e2e::etcd_store(std::time::Duration::from_secs(5)).await {
            Some(discovery) => discovery,
            None => {
                eprintln!("set PREFILL_ETCD_ENDPOINT (e.g. `source .ci/etcd.sh`)");
                std::process::exit(2)
            }
        },
        _ => usage(),
    };
    let report = storm(discovery, config).await;
    println!(
        "backend {backend}: {} retargets in {:.1} s ({:.0}/s), {} requests served, {} failed, \
         {} outside admission, {} on a replaced target (of {} checked); RSS {} KiB after \
         warm-up, {} KiB at the end, peak {} KiB",
        report.retargets,
        report.elapsed.as_secs_f64(),
        report.retargets as f64 / report.elapsed.as_secs_f64(),
        report.served,
        report.failed,
        report.outside_admission,
        report.on_replaced_target,
        report.quiet_checked,
        report.rss_start_kib,
        report.rss_end_kib,
        report.rss_peak_kib
    );
    if !report.clean() {
        eprintln!("first errors: {:?}", report.first_errors);
        std::process::exit(1);
    }
}
