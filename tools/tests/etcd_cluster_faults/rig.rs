//! A deployment on the cluster: prefill and decode workers, two frontends with traffic, and
//! the watchers of what the frontends see.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prefill_router::advert::SelectionMode;
use prefill_router::discovery::{Discovery, InstanceId, StoreStatus};
use prefill_router::snapshot::Route;
use tokio_util::sync::CancellationToken;

use crate::cluster::Cluster;
use crate::e2e::{self, Frontend, Worker};

/// Lease TTL of every worker (short, so that expiry cases run quickly).
pub const TTL: Duration = Duration::from_secs(3);

/// A worker with its own store client, as a worker process would have.
pub struct Member {
    pub worker: Worker,
    /// The worker's own client (its registration's keep-alive runs on it).
    #[allow(dead_code)]
    pub discovery: Arc<dyn Discovery>,
}

/// One frontend with its own store client, its traffic and its observations.
pub struct Front {
    pub frontend: Frontend,
    pub tally: Arc<Tally>,
    /// Stops this frontend's traffic and sampler.
    pub stop: CancellationToken,
}

/// What a frontend's traffic and watcher saw.
#[derive(Default)]
pub struct Tally {
    pub ok: std::sync::atomic::AtomicU64,
    pub errors: Mutex<Vec<String>>,
    /// Per prefill worker: the longest time it was missing from the published binding's
    /// routable set, and since when it is missing now.
    absences: Mutex<BTreeMap<InstanceId, (Duration, Option<Instant>)>>,
    /// The routable prefill ids at the last sample.
    pub routable: Mutex<BTreeSet<InstanceId>>,
}

impl Tally {
    /// The longest absence of `id` so far (an ongoing one counts).
    pub fn longest_absence(&self, id: InstanceId) -> Duration {
        let absences = self.absences.lock();
        match absences.get(&id) {
            Some((longest, since)) => (*longest).max(since.map_or(Duration::ZERO, |s| s.elapsed())),
            None => Duration::ZERO,
        }
    }

    pub fn ok(&self) -> u64 {
        self.ok.load(std::sync::atomic::Ordering::Relaxed)
    }
}

pub struct Rig {
    pub cluster: Arc<Cluster>,
    pub root: String,
    pub prefill: BTreeMap<InstanceId, Member>,
    pub decode: Member,
    pub fronts: Vec<Arc<Front>>,
    /// Workers the samplers track for absences.
    tracked: Arc<Mutex<BTreeSet<InstanceId>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn unique_root(case: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("prefill-cluster/{case}-{nanos}/")
}

/// The prefill ids routable on a frontend's published binding now.
///
/// # Panics
/// If an instance is listed twice (a resync must never duplicate one).
pub fn routable(front: &Frontend) -> BTreeSet<InstanceId> {
    match front.router.route() {
        Route::Prefill(binding) => {
            let listed = binding.dispatcher().view().routable();
            let ids: BTreeSet<InstanceId> = listed.iter().map(|i| i.instance_id).collect();
            assert_eq!(
                ids.len(),
                listed.len(),
                "an instance listed twice: {listed:?}"
            );
            ids
        }
        Route::Bypass(_) => BTreeSet::new(),
    }
}

/// Whether `id` is still in discovery as frontend's published binding sees it (routable or
/// not: a breaker opened by failed requests does not take it out of admission).
pub fn discovered(front: &Frontend, id: InstanceId) -> bool {
    match front.router.route() {
        Route::Prefill(binding) => binding.dispatcher().view().is_discovered(id),
        Route::Bypass(_) => false,
    }
}

impl Rig {
    /// Healed cluster, prefill workers 1 and 2 and a decode worker, two frontends Active on
    /// both, traffic flowing through each.
    pub async fn start(cluster: Arc<Cluster>, case: &str) -> Rig {
        cluster.heal().await;
        let root = unique_root(case);
        let mut prefill = BTreeMap::new();
        for id in [1, 2] {
            prefill.insert(id, Self::member(&cluster, &root, id).await);
        }
        let discovery = cluster.discovery(&root, TTL).await;
        let decode = Member {
            worker: e2e::start_decode(&discovery).await,
            discovery,
        };
        let mut rig = Rig {
            cluster,
            root,
            prefill,
            decode,
            fronts: Vec::new(),
            tracked: Arc::new(Mutex::new([1, 2].into())),
            tasks: Vec::new(),
        };
        for _ in 0..2 {
            rig.add_front().await;
        }
        rig.await_routable("both frontends route on workers 1 and 2", &[1, 2])
            .await;
        rig
    }

    /// A prefill worker registered through a store client of its own.
    pub async fn member(cluster: &Cluster, root: &str, id: InstanceId) -> Member {
        let discovery = cluster.discovery(root, TTL).await;
        let worker =
            e2e::start_prefill(&discovery, id, e2e::card(SelectionMode::RoundRobin, 16)).await;
        Member { worker, discovery }
    }

    /// Register one more prefill worker (same card, so the same target); tracked from now.
    pub async fn add_prefill(&mut self, id: InstanceId) {
        let member = Self::member(&self.cluster, &self.root, id).await;
        self.prefill.insert(id, member);
        self.tracked.lock().insert(id);
    }

    /// Stop checking `id` for absences (it is meant to leave).
    pub fn untrack(&self, id: InstanceId) {
        self.tracked.lock().remove(&id);
    }

    /// Start a frontend (own store client), its sampler and its traffic.
    pub async fn add_front(&mut self) -> usize {
        let discovery = self.cluster.discovery(&self.root, TTL).await;
        let frontend = e2e::frontend(&discovery).await;
        let front = Arc::new(Front {
            frontend,
            tally: Arc::new(Tally::default()),
            stop: CancellationToken::new(),
        });
        self.fronts.push(Arc::clone(&front));
        self.tasks.push(tokio::spawn(sample(
            Arc::clone(&front),
            Arc::clone(&self.tracked),
        )));
        for stream in 0..2u32 {
            self.tasks
                .push(tokio::spawn(traffic(Arc::clone(&front), stream)));
        }
        self.fronts.len() - 1
    }

    /// Stop frontend `index`'s traffic and shut it down (its tallies stay readable).
    pub async fn stop_front(&self, index: usize) {
        let front = &self.fronts[index];
        front.stop.cancel();
        // Let its in-flight requests end before the hop goes.
        tokio::time::sleep(Duration::from_millis(200)).await;
        front.frontend.hop.shutdown().await;
    }

    /// Wait until every running frontend routes on exactly `ids`; how long it took.
    pub async fn await_routable(&self, what: &str, ids: &[InstanceId]) -> Duration {
        let want: BTreeSet<InstanceId> = ids.iter().copied().collect();
        let start = Instant::now();
        loop {
            let all = self
                .fronts
                .iter()
                .filter(|f| !f.stop.is_cancelled())
                .all(|f| routable(&f.frontend) == want);
            if all {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < e2e::WAIT,
                "timed out waiting until {what}: {:?}",
                self.fronts
                    .iter()
                    .map(|f| routable(&f.frontend))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Let traffic run for `period`.
    pub async fn run_for(&self, period: Duration) {
        tokio::time::sleep(period).await;
    }

    /// The requirements every case shares: no request failed, none was dispatched outside
    /// admission, every frontend served requests, and no tracked worker was missing from a
    /// frontend's routable set for as long as its TTL.
    pub fn assert_clean(&self, case: &str) {
        for (i, front) in self.fronts.iter().enumerate() {
            let errors = front.tally.errors.lock();
            assert!(
                errors.is_empty(),
                "{case}: frontend {i} lost {} requests: {:?}",
                errors.len(),
                &errors[..errors.len().min(5)]
            );
            assert!(front.tally.ok() > 0, "{case}: frontend {i} served nothing");
            assert_eq!(
                front.frontend.outside_admission(),
                0,
                "{case}: frontend {i} dispatched outside admission"
            );
            for id in self.tracked.lock().iter() {
                let absent = front.tally.longest_absence(*id);
                assert!(
                    absent < TTL,
                    "{case}: worker {id} was missing from frontend {i} for {absent:?}"
                );
            }
        }
    }

    /// One line of what the case saw.
    pub fn summary(&self) -> String {
        self.fronts
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let absences: Vec<String> = self
                    .tracked
                    .lock()
                    .iter()
                    .map(|id| format!("{id}:{:?}", f.tally.longest_absence(*id)))
                    .collect();
                format!(
                    "frontend {i}: {} ok, {} failed, longest absences [{}]",
                    f.tally.ok(),
                    f.tally.errors.lock().len(),
                    absences.join(" ")
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The store's reachability as frontend `index`'s hop reports it.
    pub fn store(&self, index: usize) -> StoreStatus {
        self.fronts[index].frontend.hop.status().store
    }

    /// Frontend `index`'s metrics, in the Prometheus text format.
    pub fn metrics(&self, index: usize) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        self.fronts[index]
            .frontend
            .hop
            .register_metrics(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    /// Stop traffic and tear everything down (the cluster is healed by the next case).
    pub async fn finish(mut self) {
        for front in &self.fronts {
            front.stop.cancel();
        }
        for task in self.tasks.drain(..) {
            let _ = tokio::time::timeout(e2e::WAIT, task).await;
        }
        for front in &self.fronts {
            front.frontend.hop.shutdown().await;
        }
        for (_, mut member) in std::mem::take(&mut self.prefill) {
            member.worker.deregister().await;
        }
        self.decode.worker.deregister().await;
    }
}

/// Sample a frontend's routable set every 5 ms and keep the longest absences.
async fn sample(front: Arc<Front>, tracked: Arc<Mutex<BTreeSet<InstanceId>>>) {
    while !front.stop.is_cancelled() {
        let now = routable(&front.frontend);
        let tracked = tracked.lock().clone();
        {
            let mut absences = front.tally.absences.lock();
            for id in tracked {
                let entry = absences.entry(id).or_insert((Duration::ZERO, None));
                match (now.contains(&id), entry.1) {
                    (false, None) => entry.1 = Some(Instant::now()),
                    (true, Some(since)) => {
                        entry.0 = entry.0.max(since.elapsed());
                        entry.1 = None;
                    }
                    _ => {}
                }
            }
        }
        *front.tally.routable.lock() = now;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Requests one after another until the frontend stops; every failure is kept.
async fn traffic(front: Arc<Front>, stream: u32) {
    let mut seed = stream.wrapping_mul(1_000_003);
    while !front.stop.is_cancelled() {
        seed = seed.wrapping_add(1);
        match front.frontend.request(seed).await {
            Ok(_) => {
                front
                    .tally
                    .ok
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Err(error) => front.tally.errors.lock().push(error),
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
