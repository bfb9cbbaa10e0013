//! Scale-out figures on etcd (docs/scale-out.md): what a worker costs the store, and how
//! fast a frontend absorbs the watch events of a 1,000-worker namespace.
//!
//! ```sh
//! bash .ci/etcd-cluster.sh cargo run --release --features etcd --example scale_out
//! ```
//! Uses `PREFILL_ETCD_CLUSTER` (all members; their `/metrics` are summed) or
//! `PREFILL_ETCD_ENDPOINT`.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use prefill_router::advert::ModelCard;
use prefill_router::discovery::{
    Discovery, EndpointId, EtcdConfig, EtcdDiscovery, Instance, NamespaceEvent, Registration,
};
use prefill_router::{PrefillHop, PrefillHopConfig};

/// Sum of a Prometheus counter over every member (`name` with any labels matching `filter`).
fn counter(urls: &[String], name: &str, filter: &str) -> f64 {
    let mut total = 0.0;
    for url in urls {
        let host = url.trim_start_matches("http://");
        let Ok(mut stream) = std::net::TcpStream::connect(host) else {
            continue;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = write!(stream, "GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n");
        let mut body = String::new();
        let _ = stream.read_to_string(&mut body);
        for line in body.lines() {
            if line.starts_with(name)
                && line[name.len()..].starts_with(['{', ' '])
                && line.contains(filter)
            {
                if let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
                    total += v;
                }
            }
        }
    }
    total
}

fn fresh_root() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("prefill-scale/{nanos}/")
}

async fn store(urls: &[String], root: &str, ttl: Duration) -> Arc<dyn Discovery> {
    let config = EtcdConfig::new(urls.to_vec()).with_root(root).with_ttl(ttl);
    Arc::new(EtcdDiscovery::connect(config).await.unwrap())
}

fn instance(component: &str, id: u64) -> Instance {
    Instance {
        endpoint: EndpointId::new("scale", component, "generate"),
        instance_id: id,
        address: "127.0.0.1:9".parse().unwrap(),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let urls: Vec<String> = std::env::var("PREFILL_ETCD_CLUSTER")
        .or_else(|_| std::env::var("PREFILL_ETCD_ENDPOINT"))
        .expect("set PREFILL_ETCD_CLUSTER or PREFILL_ETCD_ENDPOINT")
        .split(',')
        .map(str::to_owned)
        .collect();
    println!("etcd members: {}", urls.len());

    // 1. What an idle worker costs: raft proposals and keep-alive messages per second.
    let ttl = Duration::from_secs(3);
    let workers = 50u64;
    let root = fresh_root();
    let stores: Vec<Arc<dyn Discovery>> = {
        let mut v = Vec::new();
        for _ in 0..5 {
            v.push(store(&urls, &root, ttl).await);
        }
        v
    };
    let mut registrations: Vec<Registration> = Vec::new();
    for id in 0..workers {
        let s = &stores[(id % 5) as usize];
        registrations.push(
            s.register(instance("prefill", id), ModelCard::named("m"))
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let window = Duration::from_secs(10);
    let proposals0 = counter(&urls, "etcd_server_proposals_committed_total", "");
    let keepalives0 = counter(&urls, "grpc_server_msg_received_total", "LeaseKeepAlive");
    tokio::time::sleep(window).await;
    let proposals = counter(&urls, "etcd_server_proposals_committed_total", "") - proposals0;
    let keepalives =
        counter(&urls, "grpc_server_msg_received_total", "LeaseKeepAlive") - keepalives0;
    let secs = window.as_secs_f64();
    // proposals_committed is reported by every member for the same entries: per member.
    let per_member = proposals / urls.len() as f64;
    println!(
        "idle workers: {workers} registered, TTL {ttl:?} (keep-alive every {:?}): {:.3} raft writes/s per worker, {:.3} keep-alive messages/s per worker",
        ttl / 3,
        per_member / secs / workers as f64,
        keepalives / secs / workers as f64
    );
    let churn0 = counter(&urls, "etcd_server_proposals_committed_total", "") / urls.len() as f64;
    let started = Instant::now();
    let one = stores[0]
        .register(instance("prefill", 10_000), ModelCard::named("m"))
        .await
        .unwrap();
    one.deregister().await.unwrap();
    let churn =
        counter(&urls, "etcd_server_proposals_committed_total", "") / urls.len() as f64 - churn0;
    println!(
        "one worker's register + deregister: {churn:.0} raft writes ({:?})",
        started.elapsed()
    );
    for r in registrations {
        r.deregister().await.unwrap();
    }

    // 2. Watch fan-in at 1,000 workers: how fast a frontend absorbs registrations.
    let root = fresh_root();
    let frontend = store(&urls, &root, Duration::from_secs(10)).await;
    let mut events = frontend.watch_namespace("scale").await.unwrap();
    let decode_store = store(&urls, &root, Duration::from_secs(10)).await;
    let _decode = decode_store
        .register(instance("decode", 1_000_000), ModelCard::named("m"))
        .await
        .unwrap();
    let hop = PrefillHop::start(Arc::clone(&frontend), "scale", PrefillHopConfig::default())
        .await
        .unwrap();
    let writers: Vec<Arc<dyn Discovery>> = {
        let mut v = Vec::new();
        for _ in 0..32 {
            v.push(store(&urls, &root, Duration::from_secs(10)).await);
        }
        v
    };
    let total = 1_000u64;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (w, writer) in writers.iter().enumerate() {
        let writer = Arc::clone(writer);
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            for id in (w as u64..total).step_by(32) {
                mine.push(
                    writer
                        .register(instance("prefill", id), ModelCard::named("m"))
                        .await
                        .unwrap(),
                );
            }
            mine
        }));
    }
    let mut seen = 0u64;
    let mut last_event = start;
    while seen < total {
        match tokio::time::timeout(Duration::from_secs(30), events.next()).await {
            Ok(Some(NamespaceEvent::Upserted(i, _))) if i.endpoint.component == "prefill" => {
                seen += 1;
                last_event = Instant::now();
            }
            Ok(Some(_)) => {}
            _ => break,
        }
    }
    let mut held = Vec::new();
    for t in tasks {
        held.extend(t.await.unwrap());
    }
    let written = start.elapsed();
    let absorbed = last_event - start;
    // The hop's binding admits every worker once its view has them all.
    let hop_deadline = Instant::now() + Duration::from_secs(30);
    let routable = loop {
        let n = match hop.router().route() {
            prefill_router::snapshot::Route::Prefill(b) => b.dispatcher().view().routable().len(),
            _ => 0,
        };
        if n as u64 >= total || Instant::now() > hop_deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let hop_done = start.elapsed();
    println!(
        "1,000-worker namespace: {seen} registrations seen by the frontend's watch in {absorbed:?} ({:.0} events/s, writes done in {written:?} by 32 writers); PrefillHop routable on {routable} workers after {hop_done:?}",
        seen as f64 / absorbed.as_secs_f64()
    );
    hop.shutdown().await;
    // A frontend that starts (or resyncs) on the full namespace: one listing of 1,000 records.
    let late = store(&urls, &root, Duration::from_secs(10)).await;
    let start = Instant::now();
    let hop = PrefillHop::start(late, "scale", PrefillHopConfig::default())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let n = loop {
        let n = match hop.router().route() {
            prefill_router::snapshot::Route::Prefill(b) => b.dispatcher().view().routable().len(),
            _ => 0,
        };
        if n as u64 >= total || Instant::now() > deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let burst = start.elapsed();
    println!(
        "a frontend starting on the 1,000-worker namespace: Active and routable on {n} workers after {burst:?} ({:.0} records/s absorbed from one listing)",
        n as f64 / burst.as_secs_f64()
    );
    hop.shutdown().await;
    for r in held {
        drop(r);
    }
}
