//! A retarget storm over the real watcher: the prefill pool rolls generations, clears and
//! returns as fast as discovery carries it, while request streams run through a `PrefillHop`.
//! Used by `tests/retarget_storm.rs` (short) and `examples/retarget_storm.rs` (100,000).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prefill_router::advert::{ModelCard, SelectionMode};
use prefill_router::discovery::{Discovery, Instance, InstanceId, Registration};
use prefill_router::transport::{serve, ServerConfig, ServerHandle};
use prefill_router_tools::mock::MockPrefill;
use tokio::net::TcpListener;

use super::{card, frontend, mock, prefill_ep, start_decode};

/// How big a storm.
#[derive(Clone, Debug)]
pub struct StormConfig {
    /// Target changes to cause.
    pub retargets: u64,
    /// Concurrent request streams.
    pub streams: usize,
    /// Print a progress line every tenth of the way.
    pub progress: bool,
}

/// What a storm saw.
#[derive(Debug, Default)]
pub struct StormReport {
    /// Target changes the watcher made.
    pub retargets: u64,
    /// Requests served (through prefill or bypassing to decode).
    pub served: u64,
    /// Requests that failed, and the first few errors.
    pub failed: u64,
    pub first_errors: Vec<String>,
    /// Dispatches to a worker outside its binding's admission set (must be 0).
    pub outside_admission: u64,
    /// Requests that loaded one snapshot (no retarget between their start and end) and were
    /// prefilled by a worker of another target (must be 0), out of `quiet_checked`.
    pub on_replaced_target: u64,
    pub quiet_checked: u64,
    /// Resident set size after warm-up and at the end, and the peak, in KiB.
    pub rss_start_kib: u64,
    pub rss_end_kib: u64,
    pub rss_peak_kib: u64,
    pub elapsed: Duration,
}

impl StormReport {
    /// Whether every requirement held.
    pub fn clean(&self) -> bool {
        self.failed == 0 && self.outside_admission == 0 && self.on_replaced_target == 0
    }
}

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// A prefill worker's server, registered or not.
struct Pool {
    address: SocketAddr,
    id: InstanceId,
    card: ModelCard,
    _server: ServerHandle,
    registration: Option<Registration>,
}

impl Pool {
    async fn start(id: InstanceId, card: ModelCard) -> Pool {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .unwrap();
        let engine = MockPrefill::new(id, mock(card.kv_cache_block_size));
        let server = serve(listener, engine, ServerConfig::default()).unwrap();
        Pool {
            address: server.local_addr(),
            id,
            card,
            _server: server,
            registration: None,
        }
    }

    async fn up(&mut self, discovery: &Arc<dyn Discovery>) {
        let instance = Instance {
            endpoint: prefill_ep(),
            instance_id: self.id,
            address: self.address,
        };
        self.registration = Some(
            discovery
                .register(instance, self.card.clone())
                .await
                .unwrap(),
        );
    }

    async fn down(&mut self) {
        if let Some(r) = self.registration.take() {
            r.deregister().await.unwrap();
        }
    }
}

/// Run one storm on `discovery`.
pub async fn storm(discovery: Arc<dyn Discovery>, config: StormConfig) -> StormReport {
    let mut decode = start_decode(&discovery).await;
    // Two cards on one endpoint: each selection of a card is a generation (first-wins
    // admission), and a card that returns gets its dormant generation back (reuse).
    let mut pools = [
        Pool::start(1, card(SelectionMode::RoundRobin, 16)).await,
        Pool::start(2, card(SelectionMode::RoundRobin, 32)).await,
    ];
    let front = Arc::new(frontend(&discovery).await);
    let mut view = front.hop.topology();

    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let replaced = Arc::new(AtomicU64::new(0));
    let quiet = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(Mutex::new(Vec::new()));
    // Which worker serves each generation, as first seen on a quiet request.
    let owners = Arc::new(Mutex::new(BTreeMap::<u64, InstanceId>::new()));
    let mut streams = Vec::new();
    for stream in 0..config.streams {
        let (front, stop) = (Arc::clone(&front), Arc::clone(&stop));
        let (served, failed, replaced, quiet) = (
            Arc::clone(&served),
            Arc::clone(&failed),
            Arc::clone(&replaced),
            Arc::clone(&quiet),
        );
        let (errors, owners) = (Arc::clone(&errors), Arc::clone(&owners));
        streams.push(tokio::spawn(async move {
            let mut seed = (stream as u32).wrapping_mul(1_000_003);
            while !stop.load(Ordering::Relaxed) {
                seed = seed.wrapping_add(1);
                let (epoch, generation) = {
                    let s = front.router.load();
                    (s.epoch(), s.binding().map(|b| b.id().generation))
                };
                let outcome = front.request(seed).await;
                let same = front.router.load().epoch() == epoch;
                match outcome {
                    Ok(worker) => {
                        served.fetch_add(1, Ordering::Relaxed);
                        if let (true, Some(generation), Some(worker)) = (same, generation, worker) {
                            quiet.fetch_add(1, Ordering::Relaxed);
                            let mut owners = owners.lock();
                            let owner = *owners.entry(generation).or_insert(worker);
                            if owner != worker {
                                replaced.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Err(error) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        let mut errors = errors.lock();
                        if errors.len() < 10 {
                            let now = front.router.load();
                            errors.push(format!(
                                "{error} (epoch {epoch} -> {}, generation {generation:?} -> {:?}, {} routable now)",
                                now.epoch(),
                                now.binding().map(|b| b.id().generation),
                                now.binding().map_or(0, |b| b.dispatcher().view().routable().len())
                            ));
                        }
                    }
                }
            }
        }));
    }

    let start = Instant::now();
    let mut rss_start = 0;
    let warm_up = (config.retargets / 100).max(1);
    let mut current: Option<usize> = None;
    let mut last = 0usize;
    let mut rng: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut done = 0u64;
    let tenth = (config.retargets / 10).max(1);
    while done < config.retargets {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let before = view.borrow().retargets;
        match current {
            // Return: the last pool comes back (its binding is reused); or the other one.
            None => {
                let next = if rng % 4 == 0 { 1 - last } else { last };
                pools[next].up(&discovery).await;
                current = Some(next);
            }
            // Clear: the pool leaves.
            Some(now) if rng % 3 == 0 => {
                pools[now].down().await;
                last = now;
                current = None;
            }
            // Roll: the other card arrives (rejected by first-wins admission), then the old
            // pool leaves: one change, old generation to new.
            Some(now) => {
                let next = 1 - now;
                pools[next].up(&discovery).await;
                pools[now].down().await;
                last = next;
                current = Some(next);
            }
        }
        let changed = tokio::time::timeout(
            Duration::from_secs(10),
            view.wait_for(|v| v.retargets > before),
        )
        .await
        .map(|v| v.map(|v| v.retargets));
        done = match changed {
            Ok(Ok(retargets)) => retargets,
            _ => panic!("the watcher never retargeted after op {done}"),
        };
        // Requests interleave with the changes: at least one ends after each, and a full
        // round of the streams on every tenth target (quiet windows, checked against it).
        let wanted = if done % 10 == 0 {
            config.streams as u64
        } else {
            1
        };
        let ended = served.load(Ordering::Relaxed) + failed.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while served.load(Ordering::Relaxed) + failed.load(Ordering::Relaxed) < ended + wanted {
            assert!(
                Instant::now() < deadline,
                "requests stalled after retarget {done}"
            );
            tokio::time::sleep(Duration::from_micros(50)).await;
        }
        if done >= warm_up && rss_start == 0 {
            rss_start = status_kib("VmRSS:");
        }
        if config.progress && done % tenth == 0 {
            eprintln!(
                "storm: {done}/{} retargets, {:.1}s, {} requests served, RSS {} KiB",
                config.retargets,
                start.elapsed().as_secs_f64(),
                served.load(Ordering::Relaxed),
                status_kib("VmRSS:")
            );
        }
    }
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    for stream in streams {
        stream.await.unwrap();
    }
    let report = StormReport {
        retargets: view.borrow().retargets,
        served: served.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        first_errors: errors.lock().clone(),
        outside_admission: front.outside_admission(),
        on_replaced_target: replaced.load(Ordering::Relaxed),
        quiet_checked: quiet.load(Ordering::Relaxed),
        rss_start_kib: rss_start,
        rss_end_kib: status_kib("VmRSS:"),
        rss_peak_kib: status_kib("VmHWM:"),
        elapsed,
    };
    front.hop.shutdown().await;
    for pool in &mut pools {
        pool.down().await;
    }
    decode.deregister().await;
    report
}
