//! The chaos run (issue #27): `serve` and `worker` processes on a three-member etcd cluster of
//! their own (every process given the whole member list), two frontends behind a load
//! balancer that honours `/ready`, three prefill and two decode workers, 8 clients streaming
//! chat completions, and a fault every few seconds drawn from a seeded RNG. Every request must
//! succeed.
//!
//! ```text
//! cargo test --release --all-features --test chaos -- --nocapture
//! CHAOS_SECS=600 CHAOS_SEED=42 cargo test --release --all-features --test chaos -- --nocapture
//! ```
//!
//! Faults (one at a time, each recovered before the next; drawn as shuffled decks so every
//! kind comes up once per deck): SIGKILL a prefill or a decode worker, SIGTERM a prefill or a
//! decode worker (graceful drain), SIGSTOP a prefill worker for 1.5-3 s, SIGTERM a frontend (it
//! drains: `/ready` 503 for the drain delay, then it stops accepting), SIGSTOP the etcd
//! leader for 1.5-3 s, SIGKILL an etcd member and restart it on its data dir; and once, at 60%
//! of the run, member 0 (first in every process's list, so the one they all start on) is
//! killed for good, after which etcd faults stop (one more loss would cost the quorum).
//!
//! A decode worker SIGKILLed mid-stream (issue #42) holds streams in flight, among them long
//! generations (two of the clients ask for LONG_TOKENS): `serve` continues each on another
//! decode worker with the prompt plus the tokens already sent (migration), and every stream's
//! text must equal an uninterrupted run's, token for token. The run reports the migrations,
//! and the TTFT and longest inter-token gap of the streams in flight at a decode kill against
//! the others.

#[path = "../frontend/mod.rs"]
mod frontend;

mod etcd;
mod load;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use frontend::{Cluster, Proc};
use load::{quantile_ms, Balancer, Load};

/// Lease TTL of every process: etcd's request timeout in the CLI is 5 s, and a lease
/// keep-alive pinned to a stopped member waits that long before it moves on, so a TTL under
/// about 8 s could lapse during a member stall. 10 s is the CLI's default.
const TTL_MS: &str = "10000";
/// How long a SIGTERMed frontend keeps serving with `/ready` 503: the balancer polls every
/// 50 ms, so 1.5 s leaves it many polls to stop sending there.
const DRAIN_DELAY_MS: &str = "1500";
const CLIENTS: usize = 8;
/// Completions must not pause longer than this anywhere in the run (a stopped prefill
/// worker holds the requests on it for up to 3 s; nothing should hold all of them longer).
const MAX_GAP: Duration = Duration::from_secs(10);
/// After each fault is over, this many more requests must complete within RECOVER.
const RECOVER: Duration = Duration::from_secs(15);

/// SplitMix64: a small seeded generator, so a run can be repeated from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo + 1))
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Fault {
    KillPrefill,
    KillDecode,
    TermPrefill,
    TermDecode,
    StopPrefill,
    TermFrontend,
    StopEtcdLeader,
    KillEtcdMember,
    LoseEtcdMember,
}

impl Fault {
    const DECK: [Fault; 8] = [
        Fault::KillPrefill,
        Fault::KillDecode,
        Fault::TermPrefill,
        Fault::TermDecode,
        Fault::StopPrefill,
        Fault::TermFrontend,
        Fault::StopEtcdLeader,
        Fault::KillEtcdMember,
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::KillPrefill => "kill-prefill",
            Fault::KillDecode => "kill-decode",
            Fault::TermPrefill => "term-prefill",
            Fault::TermDecode => "term-decode",
            Fault::StopPrefill => "stop-prefill",
            Fault::TermFrontend => "term-frontend",
            Fault::StopEtcdLeader => "stop-etcd-leader",
            Fault::KillEtcdMember => "kill-etcd-member",
            Fault::LoseEtcdMember => "lose-etcd-member",
        }
    }

    fn on_etcd(self) -> bool {
        matches!(self, Fault::StopEtcdLeader | Fault::KillEtcdMember)
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// The processes of the run (killed when dropped: `Proc`'s guard).
struct Fleet {
    cluster: Cluster,
    prefill: Vec<(u64, Proc)>,
    decode: Vec<(u64, Proc)>,
    frontends: Vec<Option<Proc>>,
    next_id: u64,
    /// `discovery_outages_total` of frontends that have exited, summed.
    outages_of_stopped: u64,
    /// `migrations_total` of frontends that have exited, summed.
    migrations_of_stopped: u64,
}

const PREFILL_ARGS: [&str; 4] = ["--ttl-ms", TTL_MS, "--drain-timeout-ms", "10000"];
/// 20 tokens at 10 ms: streams of ~200 ms, so faults land on streams in flight.
const DECODE_ARGS: [&str; 6] = [
    "--ttl-ms",
    TTL_MS,
    "--drain-timeout-ms",
    "10000",
    "--token-interval-us",
    "10000",
];
const SERVE_ARGS: [&str; 10] = [
    "--ttl-ms",
    TTL_MS,
    "--request-timeout-ms",
    "30000",
    "--drain-delay-ms",
    DRAIN_DELAY_MS,
    "--shutdown-timeout-ms",
    "10000",
    "--fallback",
    "decode",
];

impl Fleet {
    fn prefill_worker(&mut self) -> (u64, Proc) {
        self.next_id += 1;
        let id = self.next_id;
        (id, self.cluster.worker("prefill", id, &PREFILL_ARGS))
    }

    fn decode_worker(&mut self) -> (u64, Proc) {
        self.next_id += 1;
        let id = 1_000 + self.next_id;
        (id, self.cluster.worker("decode", id, &DECODE_ARGS))
    }

    fn frontend(&mut self, i: usize, balancer: &Balancer) {
        let (proc, addr) = self.cluster.serve(&SERVE_ARGS);
        self.frontends[i] = Some(proc);
        balancer.set(i, Some(addr));
    }
}

/// A counter or gauge of a Prometheus text body.
fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Frontend `i`'s counters the run reports: `prefill_router_discovery_outages_total`, and
/// `prefill_router_migrations_total` summed over its reasons.
fn counters(balancer: &Balancer, i: usize) -> (u64, u64) {
    let addr = balancer.addr(i).expect("a running frontend's address");
    let body = frontend::get(addr, "/metrics").body;
    let outages = metric(&body, "prefill_router_discovery_outages_total").unwrap_or(0.0);
    let migrations = frontend::counter_sum(&body, "prefill_router_migrations_total");
    (outages as u64, migrations as u64)
}

#[test]
fn chaos_on_a_three_member_store_fails_no_request() {
    let secs = env_u64("CHAOS_SECS").unwrap_or(75);
    let seed = env_u64("CHAOS_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
            % 1_000_000
    });
    let run_for = Duration::from_secs(secs);
    // The processes' warnings ("discovery store unreachable; routing on the last view", a
    // worker's drain) on this test's stderr, for the record; `serve` and `worker` log only
    // errors by default. Set before any thread starts.
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var("RUST_LOG", "warn");
    }
    // Plain lines, so a log can be grepped.
    std::env::set_var("NO_COLOR", "1");
    eprintln!("CHAOS seed={seed} secs={secs} (CHAOS_SEED={seed} CHAOS_SECS={secs} to repeat)");
    let mut rng = Rng(seed);

    // Declared first, dropped last: the store outlives the processes on it.
    let mut members = etcd::Members::start();
    let cluster = Cluster::on_etcd_members(&members.urls());
    eprintln!("CHAOS etcd members {}", cluster.store());
    let mut fleet = Fleet {
        cluster,
        prefill: Vec::new(),
        decode: Vec::new(),
        frontends: vec![None, None],
        next_id: 0,
        outages_of_stopped: 0,
        migrations_of_stopped: 0,
    };
    for _ in 0..3 {
        let w = fleet.prefill_worker();
        fleet.prefill.push(w);
    }
    for _ in 0..2 {
        let w = fleet.decode_worker();
        fleet.decode.push(w);
    }
    let balancer = Arc::new(Balancer::new(2));
    for i in 0..2 {
        fleet.frontend(i, &balancer);
        let addr = balancer.addr(i).unwrap();
        frontend::until("frontend active", || {
            frontend::get(addr, "/ready").json()["lifecycle"] == "active"
        });
    }

    let epoch = Instant::now();
    let load = Load::start(Arc::clone(&balancer), CLIENTS, epoch);
    let t = || epoch.elapsed().as_secs_f64();
    let mut counts: BTreeMap<Fault, usize> = BTreeMap::new();
    let mut deck: Vec<Fault> = Vec::new();
    let mut lost: Option<usize> = None;
    let mut dealt = 0;
    let mut worker_stops = Vec::new();
    let mut frontend_stops = Vec::new();
    let mut recoveries = Vec::new();
    // When each decode worker was SIGKILLed (from the start of the run).
    let mut decode_kills = Vec::new();
    while epoch.elapsed() < run_for {
        // The gap between faults: traffic runs undisturbed for 1.5-3.5 s.
        std::thread::sleep(rng.millis(1_500, 3_500));
        if epoch.elapsed() >= run_for {
            break;
        }
        // The loss for good comes after a whole first deck (so every etcd fault ran on three
        // members at least once) and 60% into the run.
        let fault = if lost.is_none()
            && dealt >= Fault::DECK.len()
            && epoch.elapsed() >= run_for.mul_f64(0.6)
        {
            Fault::LoseEtcdMember
        } else {
            dealt += 1;
            if deck.is_empty() {
                deck = Fault::DECK
                    .iter()
                    .copied()
                    .filter(|f| lost.is_none() || !f.on_etcd())
                    .collect();
                // Fisher-Yates from the seeded RNG.
                for k in (1..deck.len()).rev() {
                    let j = rng.below(k + 1);
                    deck.swap(k, j);
                }
            }
            deck.pop().unwrap()
        };
        *counts.entry(fault).or_default() += 1;
        let before = load.completed();
        match fault {
            Fault::KillPrefill => {
                let k = rng.below(fleet.prefill.len());
                let (id, proc) = fleet.prefill.remove(k);
                eprintln!("FAULT t={:.1}s kill prefill-{id}", t());
                proc.kill();
                let w = fleet.prefill_worker();
                eprintln!("  t={:.1}s prefill-{} up", t(), w.0);
                fleet.prefill.push(w);
            }
            Fault::KillDecode => {
                // Its streams in flight (a few long generations among them) move to the
                // other decode worker; the replacement starts after the kill.
                let k = rng.below(fleet.decode.len());
                let (id, proc) = fleet.decode.remove(k);
                eprintln!("FAULT t={:.1}s kill decode-{id}", t());
                decode_kills.push(epoch.elapsed());
                proc.kill();
                let w = fleet.decode_worker();
                eprintln!("  t={:.1}s decode-{} up", t(), w.0);
                fleet.decode.push(w);
            }
            Fault::TermPrefill | Fault::TermDecode => {
                let prefill = fault == Fault::TermPrefill;
                let pool = if prefill {
                    &mut fleet.prefill
                } else {
                    &mut fleet.decode
                };
                let k = rng.below(pool.len());
                let (id, proc) = pool.remove(k);
                let role = if prefill { "prefill" } else { "decode" };
                eprintln!("FAULT t={:.1}s term {role}-{id}", t());
                let (status, event) = proc.stop();
                eprintln!("  t={:.1}s {role}-{id} exited {status}: {event}", t());
                worker_stops.push(event);
                let w = if prefill {
                    fleet.prefill_worker()
                } else {
                    fleet.decode_worker()
                };
                eprintln!("  t={:.1}s {role}-{} up", t(), w.0);
                if prefill {
                    fleet.prefill.push(w);
                } else {
                    fleet.decode.push(w);
                }
            }
            Fault::StopPrefill => {
                let k = rng.below(fleet.prefill.len());
                let pause = rng.millis(1_500, 3_000);
                let (id, proc) = &fleet.prefill[k];
                eprintln!("FAULT t={:.1}s stop prefill-{id} for {pause:?}", t());
                proc.signal(libc::SIGSTOP);
                std::thread::sleep(pause);
                proc.signal(libc::SIGCONT);
            }
            Fault::TermFrontend => {
                let k = rng.below(2);
                // The load balancer needs the other one: wait (bounded) until it is ready.
                frontend::until("the other frontend ready", || balancer.ready(1 - k));
                let proc = fleet.frontends[k].take().unwrap();
                let (outages, migrations) = counters(&balancer, k);
                fleet.outages_of_stopped += outages;
                fleet.migrations_of_stopped += migrations;
                eprintln!("FAULT t={:.1}s term frontend-{k}", t());
                let (status, event) = proc.stop();
                balancer.set(k, None);
                eprintln!("  t={:.1}s frontend-{k} exited {status}: {event}", t());
                frontend_stops.push(event);
                fleet.frontend(k, &balancer);
                eprintln!("  t={:.1}s frontend-{k} up", t());
            }
            Fault::StopEtcdLeader => {
                let leader = members.leader().expect("a leader");
                let pause = rng.millis(1_500, 3_000);
                eprintln!(
                    "FAULT t={:.1}s stop etcd-{leader} (leader) for {pause:?}",
                    t()
                );
                members.stop(leader);
                std::thread::sleep(pause);
                members.resume(leader);
                eprintln!(
                    "  t={:.1}s etcd healthy, leader {:?}",
                    t(),
                    members.leader()
                );
            }
            Fault::KillEtcdMember => {
                let running = members.running();
                let m = running[rng.below(running.len())];
                let down = rng.millis(1_000, 3_000);
                eprintln!("FAULT t={:.1}s kill etcd-{m} for {down:?}", t());
                members.kill(m);
                std::thread::sleep(down);
                members.restart(m);
                eprintln!(
                    "  t={:.1}s etcd-{m} back, leader {:?}",
                    t(),
                    members.leader()
                );
            }
            Fault::LoseEtcdMember => {
                eprintln!("FAULT t={:.1}s kill etcd-0 for good", t());
                members.kill(0);
                lost = Some(0);
                // Two members left: one more down would cost the quorum, so no more etcd faults.
                deck.retain(|f| !f.on_etcd());
                let took = members.await_healthy();
                eprintln!(
                    "  t={:.1}s etcd on 2 of 3 (leader {:?} after {took:?})",
                    t(),
                    members.leader()
                );
            }
        }
        // Requests keep completing once the fault is over.
        let recovering = Instant::now();
        while load.completed() < before + CLIENTS {
            assert!(
                recovering.elapsed() < RECOVER,
                "no {CLIENTS} requests completed within {RECOVER:?} after {fault:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        recoveries.push(recovering.elapsed());
    }
    let elapsed = epoch.elapsed();
    let mut outages_total = fleet.outages_of_stopped;
    let mut migrations_total = fleet.migrations_of_stopped;
    for i in 0..2 {
        if fleet.frontends[i].is_some() {
            let (outages, migrations) = counters(&balancer, i);
            outages_total += outages;
            migrations_total += migrations;
        }
    }
    for i in 0..2 {
        if let Some(addr) = balancer.addr(i) {
            let body = frontend::get(addr, "/metrics").body;
            let lines: Vec<&str> = body
                .lines()
                .filter(|l| !l.starts_with('#') && !l.ends_with(" 0"))
                .filter(|l| {
                    [
                        "retr", "fail", "bypass", "fallback", "drain", "breaker", "outage",
                        "error", "migrat",
                    ]
                    .iter()
                    .any(|w| l.contains(w))
                })
                .collect();
            eprintln!("CHAOS frontend-{i} metrics (since its last start): {lines:?}");
        }
    }
    let sent = load.sent.load(std::sync::atomic::Ordering::Relaxed);
    let tally = load.finish();

    let mut ttft: Vec<Duration> = tally.done.iter().map(|d| d.ttft).collect();
    let mut total: Vec<Duration> = tally.done.iter().map(|d| d.total).collect();
    let mut ends: Vec<Duration> = tally.done.iter().map(|d| d.at).collect();
    ends.sort_unstable();
    // The longest pause between completions, and when it ended (to find the fault behind it).
    let (max_gap, max_gap_end) = ends
        .windows(2)
        .map(|w| (w[1] - w[0], w[1]))
        .chain(ends.first().map(|&e| (e, e)))
        .max()
        .unwrap_or((elapsed, elapsed));
    let faults: usize = counts.values().sum();
    let kinds: Vec<String> = counts
        .iter()
        .map(|(f, n)| format!("{}={n}", f.name()))
        .collect();
    let requests = tally.done.len() + tally.failed.len();
    // Requests held by a fault (a stopped prefill worker or member): first token after 1 s.
    let slow = ttft.iter().filter(|d| **d > Duration::from_secs(1)).count();
    let worst_recovery = recoveries.iter().max().copied().unwrap_or_default();
    // The streams in flight at a decode worker's SIGKILL (the migrated ones are among them)
    // against the rest: TTFT and the longest wait between two tokens, p99.
    let (across, others): (Vec<&load::Done>, Vec<&load::Done>) = tally
        .done
        .iter()
        .partition(|d| decode_kills.iter().any(|&k| d.spans(k)));
    let p99 = |done: &[&load::Done], f: fn(&load::Done) -> Duration| {
        let mut xs: Vec<Duration> = done.iter().map(|d| f(d)).collect();
        quantile_ms(&mut xs, 0.99)
    };
    let across_long = across.iter().filter(|d| d.long).count();
    eprintln!(
        "CHAOS seed={seed} secs={:.0} requests={requests} failed={} resent={} attempts={sent} faults={faults} {} \
         ttft_p50_ms={:.1} ttft_p99_ms={:.1} ttft_max_ms={:.0} ttft_over_1s={slow} total_p50_ms={:.1} total_p99_ms={:.1} max_gap_ms={:.0} \
         max_gap_end_s={:.1} worst_recovery_ms={:.0} discovery_outages={outages_total} \
         migrations={migrations_total} across_decode_kill={} (long {across_long}) \
         across_ttft_p99_ms={:.1} across_token_gap_p99_ms={:.1} \
         other_ttft_p99_ms={:.1} other_token_gap_p99_ms={:.1}",
        elapsed.as_secs_f64(),
        tally.failed.len(),
        tally.resent,
        kinds.join(" "),
        quantile_ms(&mut ttft, 0.5),
        quantile_ms(&mut ttft, 0.99),
        quantile_ms(&mut ttft, 1.0),
        quantile_ms(&mut total, 0.5),
        quantile_ms(&mut total, 0.99),
        max_gap.as_secs_f64() * 1e3,
        max_gap_end.as_secs_f64(),
        worst_recovery.as_secs_f64() * 1e3,
        across.len(),
        p99(&across, |d| d.ttft),
        p99(&across, |d| d.longest_gap),
        p99(&others, |d| d.ttft),
        p99(&others, |d| d.longest_gap),
    );

    assert!(
        tally.failed.is_empty(),
        "{} failed requests: {:?}",
        tally.failed.len(),
        tally.failed
    );
    assert!(
        requests >= 20 * secs as usize,
        "steady load: {requests} requests in {secs} s"
    );
    assert!(max_gap < MAX_GAP, "completions paused for {max_gap:?}");
    assert!(lost.is_some(), "the run lost a member for good");
    // A decode worker killed with streams on it: they moved (and came out whole, above).
    assert!(
        migrations_total > 0,
        "{} decode kills and no stream migrated",
        decode_kills.len()
    );
    // Every kind once (the decks make it so after 8 faults before the loss).
    for kind in Fault::DECK {
        assert!(counts.contains_key(&kind), "no {kind:?} in {counts:?}");
    }
    for event in &worker_stops {
        assert_eq!(event["drained"], true, "a worker drained in time: {event}");
        assert_eq!(event["cancelled"], 0, "no stream was cut: {event}");
    }
    for event in &frontend_stops {
        assert_eq!(event["closed_at_bound"], 0, "a frontend drained: {event}");
    }
}
