//! The replay driver: one paused current-thread runtime per run, requests spawned at their
//! trace arrival times, results folded into a [`ReplayReport`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;

use super::config::{PoolEvent, ReplayConfig, ReplayError, Spread, FLAP_DOWN, WAIT_FOR_HOP};
use super::engine::{prefill_endpoint, ReplayDecode, ReplayFactory};
use super::link::Shared;
use super::policy::Policy;
use super::report::ReplayReport;
use super::sessions::{session_key, sessions};
use super::summary::summarize;
use super::trace::{tokens, TraceRecord, BLOCK_TOKENS};
use prefill_router::advert::{ModelCard, RouterConfig};
use prefill_router::binding::PrefillError;
use prefill_router::binding::{WorkerSetTarget, WorkerSetTargetId};
use prefill_router::push::PushError;
use prefill_router::request::GenerateRequest;
use prefill_router::router::GenerateError;
use prefill_router::router::{AfterWait, FallbackPolicy, PrefillRouter, PrefillRouterConfig};

/// Replay `trace` under `config` on its own paused, single-threaded tokio runtime (so it must
/// not be called from within a tokio runtime).
///
/// # Errors
/// [`ReplayError::Join`] for a late join the trace cannot have ([`ReplayConfig::check`]),
/// [`ReplayError::External`] for an external policy that cannot run
/// ([`ReplayConfig::check_external`]),
/// [`ReplayError::Runtime`] if the runtime cannot be built (an OS resource failure).
pub fn run(config: &ReplayConfig, trace: &[TraceRecord]) -> Result<ReplayReport, ReplayError> {
    config.check(trace)?;
    config.check_external()?;
    let wall = std::time::Instant::now();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    let records: Arc<[TraceRecord]> = trace[..config.limit.unwrap_or(usize::MAX).min(trace.len())]
        .to_vec()
        .into();
    let mut report = runtime.block_on(replay(config, Arc::clone(&records)));
    report.wall_s = wall.elapsed().as_secs_f64();
    #[allow(clippy::cast_precision_loss)] // request counts far below 2^52
    let rate = report.requests as f64 / report.wall_s.max(1e-9);
    report.requests_per_s = rate;
    Ok(report)
}

/// The prompt the router gets for `record`: its [`tokens`](super::trace::tokens). Only the KV
/// policies read tokens; the others get an empty prompt and skip the work.
pub(crate) fn prompt(record: &TraceRecord, policy: Policy, unit: u32) -> Vec<u32> {
    if !policy.chained() {
        return Vec::new();
    }
    tokens(record, unit)
}

async fn replay(config: &ReplayConfig, records: Arc<[TraceRecord]>) -> ReplayReport {
    // The cache holds as many tokens at every block size.
    let block = config.block_tokens.max(1);
    let cache_blocks = config.cache_blocks.map_or(usize::MAX, |c| {
        (c.saturating_mul(BLOCK_TOKENS as usize) / block as usize).max(1)
    });
    let pool = config.workers.max(1) as u64;
    let ids: BTreeSet<u64> = (1..=pool).collect();
    // Every policy's workers key their caches by the chained hashes of the prompt's blocks at
    // the run's block size (a block is cached whole or not at all).
    let keys: Vec<Vec<u64>> = records
        .iter()
        .map(|r| prefill_router::push::block_hashes(&tokens(r, config.unit_tokens), block))
        .collect();
    let shared = Arc::new(Shared {
        trace: Arc::clone(&records),
        keys,
        subscribers: Mutex::new(Vec::new()),
        event_loss_every: config.event_loss_every,
        event_delay: config.event_delay,
        batches: AtomicU64::new(0),
        stale_credit: AtomicU64::new(0),
        cost: config.cost.clone(),
        policy: config.policy,
        seed: config.seed,
        cache_blocks,
        block_tokens: block,
        unit_tokens: config.unit_tokens,
        external: config
            .external
            .clone()
            .filter(|_| config.policy == Policy::External),
        external_subscribers: Mutex::new(Vec::new()),
        workers: Mutex::new(BTreeMap::new()),
        served: Mutex::new(vec![None; records.len()]),
        builds: AtomicU64::new(0),
        affinity_ttl: config.session_affinity,
        overload_wait: config.overload_wait,
        affinity: Arc::default(),
        load_reports: config.load_reports,
        report_delay: config.report_delay,
        reporters: Mutex::new(Vec::new()),
    });
    shared.add_workers(ids.iter().copied());
    let card = ModelCard {
        name: "replay-model".to_owned(),
        kv_cache_block_size: block,
        router_config: Some(RouterConfig {
            router_mode: config.policy.router_mode(),
            kv_router_config: config.kv.clone(),
            ..RouterConfig::default()
        }),
        ..ModelCard::default()
    };
    let card = Arc::new(card);
    let (admitted, admitted_rx) = watch::channel(ids.clone());
    let first = WorkerSetTarget::new(
        WorkerSetTargetId::new("replay/prefill", 1),
        prefill_endpoint(),
        Arc::clone(&card),
        admitted_rx,
    );
    // Independent frontends: each its own router, hence its own binding, dispatcher, KV
    // index, bookings and affinity table, over the one pool.
    let frontends = config.frontends.max(1);
    let routers: Vec<Arc<PrefillRouter<ReplayFactory>>> = (0..frontends)
        .map(|frontend| frontend_router(config, &shared, frontend))
        .collect();
    // A late joiner (the last frontend) gets its target, hence its binding, when it joins.
    let joiner = config.join.map(|join| (join, frontends - 1));
    let running = joiner.map_or(frontends, |(_, last)| last);
    for router in &routers[..running] {
        router.set_target(Some(first.clone()));
        // Virtual time: the build finishes at once, the wait costs nothing real.
        let _ = router.wait_active(Duration::from_secs(60)).await;
    }
    let routers: Arc<[Arc<PrefillRouter<ReplayFactory>>]> = routers.into();
    let decode = Arc::new(ReplayDecode {
        cost: config.cost.clone(),
        shared: Arc::clone(&shared),
        workers: config.workers,
        local: Arc::default(),
    });
    let ttft: Arc<Mutex<Vec<Option<Duration>>>> = Arc::new(Mutex::new(vec![None; records.len()]));
    // The frontend each open-loop request went to.
    let mut assigned = vec![0usize; records.len()];
    // Requests refused with the typed overload error.
    let shed: Arc<Mutex<Vec<bool>>> = Arc::new(Mutex::new(vec![false; records.len()]));
    let start = Instant::now();
    let join_target = first.clone();
    let mut tasks = Vec::with_capacity(records.len());
    if let Some(event) = config.event {
        let routers = Arc::clone(&routers);
        let shared = Arc::clone(&shared);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + event.at()).await;
            // The second generation: new cold workers, or the same ones.
            let next_ids: BTreeSet<u64> = match event {
                PoolEvent::Retarget { .. } => (pool + 1..=2 * pool).collect(),
                PoolEvent::Flap { .. } => ids.clone(),
            };
            let (next_tx, next_rx) = watch::channel(next_ids.clone());
            let second = WorkerSetTarget::new(
                WorkerSetTargetId::new("replay/prefill", 2),
                prefill_endpoint(),
                Arc::clone(&card),
                next_rx,
            );
            match event {
                PoolEvent::Retarget { .. } => {
                    shared.add_workers(next_ids);
                    for router in routers.iter() {
                        router.set_target(Some(second.clone()));
                    }
                    admitted.send_replace(BTreeSet::new());
                }
                PoolEvent::Flap { rebuild, .. } => {
                    for router in routers.iter() {
                        router.set_target(None);
                    }
                    tokio::time::sleep(FLAP_DOWN).await;
                    let back = if rebuild { second } else { first };
                    for router in routers.iter() {
                        router.set_target(Some(back.clone()));
                    }
                }
            }
            // Keep the admission channels open for the rest of the replay.
            let _keep = (admitted, next_tx);
            std::future::pending::<()>().await;
        }));
    }
    let tenth = records.len().div_ceil(10).max(1);
    let outcome = Outcome {
        ttft: Arc::clone(&ttft),
        shed: Arc::clone(&shed),
    };
    if let Some(closed) = config.closed_loop {
        let queue = Arc::new(Mutex::new(
            sessions(&records).into_iter().collect::<VecDeque<_>>(),
        ));
        for _ in 0..closed.users.max(1) {
            let (queue, routers, decode) = (
                Arc::clone(&queue),
                Arc::clone(&routers),
                Arc::clone(&decode),
            );
            let (records, outcome) = (Arc::clone(&records), outcome.clone());
            let (policy, affinity, spread, unit) = (
                config.policy,
                config.session_affinity,
                config.spread,
                config.unit_tokens,
            );
            tasks.push(tokio::spawn(async move {
                // Each user: the next session's turns in order, each after the previous one
                // completed and a think time.
                loop {
                    let Some(turns) = queue.lock().pop_front() else {
                        return;
                    };
                    for index in turns {
                        let request =
                            replay_request(&records[index], index, policy, affinity, unit);
                        let router =
                            &routers[frontend_of(spread, &records[index], index, routers.len())];
                        outcome.serve(router, &decode, index, request).await;
                        tokio::time::sleep(closed.think).await;
                    }
                }
            }));
        }
    }
    let open_loop = if config.closed_loop.is_some() {
        &records[..0]
    } else {
        &records[..]
    };
    // Frontends taking requests: all but a late joiner until it joins.
    let mut live = running;
    for (index, record) in open_loop.iter().enumerate() {
        if let Some((join, last)) = joiner.filter(|_| live < frontends) {
            if Duration::from_millis(record.timestamp) >= join.at {
                tokio::time::sleep_until(start + join.at).await;
                if config.progress {
                    eprintln!(
                        "replay {}: frontend {last} joins at trace time {:.0} s ({}), request {index}",
                        config.policy_name(),
                        join.at.as_secs_f64(),
                        if join.snapshot { "KV snapshot" } else { "cold" }
                    );
                }
                routers[last].set_target(Some(join_target.clone()));
                let _ = routers[last].wait_active(Duration::from_secs(60)).await;
                live = frontends;
            }
        }
        tokio::time::sleep_until(start + Duration::from_millis(record.timestamp)).await;
        if config.progress && index > 0 && index % tenth == 0 {
            eprintln!(
                "replay {}: {}% ({index} of {} requests, trace time {:.0} s)",
                config.policy_name(),
                index * 100 / records.len(),
                records.len(),
                start.elapsed().as_secs_f64()
            );
        }
        let request = replay_request(
            record,
            index,
            config.policy,
            config.session_affinity,
            config.unit_tokens,
        );
        let frontend = frontend_of(config.spread, record, index, live);
        assigned[index] = frontend;
        let router = Arc::clone(&routers[frontend]);
        let (decode, outcome) = (Arc::clone(&decode), outcome.clone());
        tasks.push(tokio::spawn(async move {
            outcome.serve(&router, &decode, index, request).await;
        }));
    }
    let controller = config.event.map(|_| tasks.remove(0));
    for task in tasks {
        let _ = task.await;
    }
    if let Some(controller) = controller {
        controller.abort();
    }
    let virtual_s = start.elapsed().as_secs_f64();
    for router in routers.iter() {
        router.shutdown();
    }
    let ttft = ttft.lock().clone();
    let shed = shed.lock().clone();
    summarize(
        config, &records, &shared, &ttft, &shed, &assigned, virtual_s,
    )
}

/// Frontend `frontend`'s router over `shared`'s pool.
fn frontend_router(
    config: &ReplayConfig,
    shared: &Arc<Shared>,
    frontend: usize,
) -> Arc<PrefillRouter<ReplayFactory>> {
    let name = if config.frontends > 1 {
        format!("replay-{frontend}")
    } else {
        "replay".to_owned()
    };
    Arc::new(PrefillRouter::new(
        ReplayFactory {
            shared: Arc::clone(shared),
            frontend: frontend as u64,
            // Only a late joiner asks for snapshots: the others start with the caches.
            snapshot: config.join.is_some_and(|j| j.snapshot) && frontend + 1 == config.frontends,
        },
        PrefillRouterConfig {
            // A request the hop cannot take waits a little (a flap), then is lost: it is
            // never silently served elsewhere.
            fallback: FallbackPolicy::WaitUpTo {
                timeout: WAIT_FOR_HOP,
                then: AfterWait::Reject,
            },
            jitter_seed: Some(config.seed ^ frontend as u64),
            name,
            conditional: config.conditional,
            ..PrefillRouterConfig::default()
        },
    ))
}

/// The frontend (of `frontends`) that the balancer in front sends request `index` to.
fn frontend_of(spread: Spread, record: &TraceRecord, index: usize, frontends: usize) -> usize {
    let frontends = frontends.max(1);
    match spread {
        Spread::RoundRobin => index % frontends,
        Spread::Session => {
            let key = session_key(record);
            let hash = key.bytes().fold(prefill_router::rng::GAMMA, |h, b| {
                prefill_router::rng::finalize(h ^ u64::from(b))
            });
            (hash % frontends as u64) as usize
        }
    }
}

/// The request of trace record `index`.
fn replay_request(
    record: &TraceRecord,
    index: usize,
    policy: Policy,
    affinity: Option<Duration>,
    unit: u32,
) -> GenerateRequest {
    GenerateRequest {
        token_ids: prompt(record, policy, unit),
        max_tokens: record.output_length.max(1),
        request_id: Some(index as u64),
        session: affinity.map(|_| session_key(record)),
        ..GenerateRequest::default()
    }
}

/// Where the requests' outcomes go: first-token times, and which were shed as overloaded.
#[derive(Clone)]
struct Outcome {
    ttft: Arc<Mutex<Vec<Option<Duration>>>>,
    shed: Arc<Mutex<Vec<bool>>>,
}

impl Outcome {
    /// Send request `index` through the router and record how it fared; returns when its
    /// stream ended (or it failed).
    async fn serve(
        &self,
        router: &PrefillRouter<ReplayFactory>,
        decode: &ReplayDecode,
        index: usize,
        request: GenerateRequest,
    ) {
        let arrived = Instant::now();
        let mut stream = match router.generate(request, decode).await {
            Ok(stream) => stream,
            Err(GenerateError::Prefill(PrefillError::Push(PushError::Overloaded { .. }))) => {
                self.shed.lock()[index] = true;
                return;
            }
            Err(_) => return,
        };
        let mut first = None;
        while let Some(item) = stream.next().await {
            if item.is_err() {
                return;
            }
            first.get_or_insert_with(|| arrived.elapsed());
        }
        self.ttft.lock()[index] = first;
    }
}
