//! [`DynamoCrate`]: the replay policy whose routers are the `dynamo-kv-router` crate's pieces,
//! wired as Dynamo's KV router wires them for a prefill pool:
//!
//! 1. the prompt's per-block hashes, `compute_block_hash_for_seq` (the crate's XXH3 of each
//!    whole block's tokens), and their rolling sequence hashes (`compute_seq_hash_for_block`);
//! 2. the radix tree's match of those blocks ([`Indexer`]), fed every worker's KV events: each
//!    stored block under the engine's own chained hash (`ExternalSequenceBlockHash`, the
//!    replay's cache key) with the crate's hash of its tokens (`LocalBlockHash`);
//! 3. the overlap turned into scheduling signals by the crate's `OverlapAnalysis`;
//! 4. `LocalScheduler::schedule_request` (tracked): its queue projects every worker's load
//!    from its `ActiveSequencesMultiWorker`, `DefaultWorkerSelector` picks at the default
//!    `KvRouterConfig`, and the pick is booked in the sequences;
//! 5. when the prefill ends, `mark_prefill_completed` then `free` (on a prefill worker the
//!    request ends with its prefill).
//!
//! The one departure: ties are broken by a seeded generator (`DefaultWorkerSelector::new_seeded`,
//! the same reservoir draw over tied workers) instead of the process-wide one, so every replay
//! of a configuration gives the same numbers.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dynamo_kv_router::indexer::TieredMatchDetails;
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, compute_seq_hash_for_block, BlockHashOptions,
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, RoutingConstraints, WorkerConfigLike,
};
use dynamo_kv_router::scheduling::{OverlapAnalysis, ScheduleMode, ScheduleRequest};
use dynamo_kv_router::selector::DefaultWorkerSelector;
use dynamo_kv_router::{
    ActiveSequencesMultiWorker, KvRouterConfig, LocalScheduler, NoopSequencePublisher,
};
use futures_util::future::{BoxFuture, FutureExt};
use prefill_router_tools::replay::{
    External, ExternalError, ExternalKvEvent, ExternalPolicy, ExternalRequest, ExternalRouter,
    ExternalSetup,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::indexer::Indexer;

/// The policy's name in reports.
pub const POLICY_NAME: &str = "dynamo-crate";

/// The worker type the crate's logs and sequences label the pool with.
const WORKER_TYPE: &str = "prefill";

/// How often the crate's scheduler re-checks its queue (what its own tests use; its queue
/// holds nothing at the default `router_queue_threshold` of none, so the period only wakes an
/// idle task).
const RECHECK: Duration = Duration::from_secs(60);

/// Dynamo's KV router (the `dynamo-kv-router` crate) as a replay policy.
#[derive(Clone, Debug)]
pub struct DynamoCrate {
    /// The router's configuration (default: the crate's `KvRouterConfig::default()`).
    pub config: KvRouterConfig,
    /// Seed of the selector's tie-breaking draw.
    pub seed: u64,
}

impl Default for DynamoCrate {
    fn default() -> Self {
        DynamoCrate {
            config: KvRouterConfig::default(),
            seed: 0x5eed,
        }
    }
}

impl DynamoCrate {
    /// The policy for [`ReplayConfig::external`](prefill_router_tools::replay::ReplayConfig::external).
    pub fn into_external(self) -> External {
        External::new(self)
    }
}

impl ExternalPolicy for DynamoCrate {
    fn name(&self) -> &str {
        POLICY_NAME
    }

    fn router(&self, setup: &ExternalSetup) -> Result<Arc<dyn ExternalRouter>, ExternalError> {
        Ok(Arc::new(DynamoRouter::new(
            self.config.clone(),
            self.seed ^ setup.frontend,
            setup,
        )?))
    }
}

/// A worker of the replayed pool as the crate's scheduler sees it: one data-parallel rank, no
/// advertised capacity (the replay's engines publish none).
#[derive(Clone, Debug, PartialEq, Eq)]
struct PoolWorker;

impl WorkerConfigLike for PoolWorker {
    fn data_parallel_start_rank(&self) -> u32 {
        0
    }
    fn data_parallel_size(&self) -> u32 {
        1
    }
    fn max_num_batched_tokens(&self) -> Option<u64> {
        None
    }
    fn total_kv_blocks(&self) -> Option<u64> {
        None
    }
}

type Scheduler = LocalScheduler<NoopSequencePublisher, PoolWorker, DefaultWorkerSelector>;

/// One binding's Dynamo router: the crate's indexer, scheduler and sequences.
pub struct DynamoRouter {
    config: KvRouterConfig,
    block_tokens: u32,
    indexer: Indexer,
    scheduler: Scheduler,
    slots: Arc<ActiveSequencesMultiWorker<NoopSequencePublisher>>,
    /// Ends the scheduler's tasks when the router drops.
    cancel: CancellationToken,
    /// The pool as the scheduler watches it (kept open for the router's life).
    _workers: watch::Sender<HashMap<u64, PoolWorker>>,
    /// Numbers the events given to the tree.
    event_id: AtomicU64,
}

impl DynamoRouter {
    /// A router over `setup`'s workers. Must be called within a tokio runtime (the crate's
    /// scheduler spawns its tasks).
    ///
    /// # Errors
    /// [`ExternalError::Router`] if the radix tree's thread cannot start or the scheduler's
    /// queue profile cannot be built from `config`.
    pub fn new(
        config: KvRouterConfig,
        seed: u64,
        setup: &ExternalSetup,
    ) -> Result<Self, ExternalError> {
        let router_error = |e: String| ExternalError::Router(e);
        let indexer = Indexer::start().map_err(|e| router_error(e.to_string()))?;
        let workers: HashMap<u64, PoolWorker> =
            setup.workers.iter().map(|&id| (id, PoolWorker)).collect();
        let slots = Arc::new(ActiveSequencesMultiWorker::new(
            NoopSequencePublisher,
            setup.block_tokens as usize,
            setup.workers.iter().map(|&id| (id, (0, 1))).collect(),
            config.router_replica_sync,
            setup.frontend,
            WORKER_TYPE,
        ));
        let (workers_tx, workers_rx) = watch::channel(workers);
        let profile = config
            .policy_profile(None)
            .map_err(|e| router_error(e.to_string()))?;
        let cancel = CancellationToken::new();
        let scheduler = LocalScheduler::new(
            Arc::clone(&slots),
            workers_rx,
            profile,
            setup.block_tokens,
            DefaultWorkerSelector::new_seeded(Some(config.clone()), WORKER_TYPE, seed),
            None,
            None,
            None,
            None,
            RECHECK,
            config.router_track_prefill_tokens,
            cancel.clone(),
            WORKER_TYPE,
            true,
        );
        Ok(DynamoRouter {
            config,
            block_tokens: setup.block_tokens,
            indexer,
            scheduler,
            slots,
            cancel,
            _workers: workers_tx,
            event_id: AtomicU64::new(0),
        })
    }

    /// Requests the crate's sequences hold now, over every worker.
    pub fn active_requests(&self) -> usize {
        self.slots.active_request_counts().values().sum()
    }

    /// Blocks the crate's sequences count as active now, over every worker.
    pub fn active_blocks(&self) -> usize {
        self.slots.active_blocks().values().sum()
    }

    /// Events the radix tree refused so far, by event kind and error (see
    /// [`Indexer::refused`]).
    pub fn refused_events(&self) -> BTreeMap<String, u64> {
        self.indexer.refused()
    }

    /// The crate's per-block hashes of `tokens` (whole blocks only).
    fn local_hashes(&self, tokens: &[u32]) -> Vec<LocalBlockHash> {
        compute_block_hash_for_seq(tokens, self.block_tokens, BlockHashOptions::default())
    }

    /// `event` of worker `worker` as the crate's router event.
    fn router_event(&self, worker: u64, event: &ExternalKvEvent) -> RouterEvent {
        let data = match event {
            ExternalKvEvent::Stored { parent, blocks } => {
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(ExternalSequenceBlockHash),
                    start_position: None,
                    blocks: blocks
                        .iter()
                        .map(|b| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(b.hash),
                            // One whole block: exactly one hash.
                            tokens_hash: self
                                .local_hashes(&b.tokens)
                                .first()
                                .copied()
                                .unwrap_or(LocalBlockHash(0)),
                            mm_extra_info: None,
                        })
                        .collect(),
                })
            }
            ExternalKvEvent::Removed { blocks } => KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: blocks
                    .iter()
                    .copied()
                    .map(ExternalSequenceBlockHash)
                    .collect(),
            }),
            ExternalKvEvent::Cleared => KvCacheEventData::Cleared,
        };
        RouterEvent::new(
            worker,
            KvCacheEvent {
                event_id: self.event_id.fetch_add(1, Ordering::Relaxed),
                data,
                dp_rank: 0,
            },
        )
    }

    /// The crate's scheduling request for `request` among `routable`, with the tree's overlap.
    fn schedule_request(
        &self,
        request: &ExternalRequest,
        routable: Vec<u64>,
    ) -> Result<ScheduleRequest, ExternalError> {
        let local = self.local_hashes(&request.tokens);
        let device = self
            .indexer
            .find(local.clone())
            .map_err(|e| ExternalError::Router(e.to_string()))?;
        let tiered = TieredMatchDetails {
            device,
            ..TieredMatchDetails::default()
        };
        let overlap = OverlapAnalysis::new(&self.config, self.block_tokens, &tiered).signals();
        // Active blocks are tracked by the blocks' rolling sequence hashes.
        let token_seq = self
            .config
            .router_track_active_blocks
            .then(|| compute_seq_hash_for_block(&local));
        Ok(ScheduleRequest {
            mode: ScheduleMode::Tracked {
                request_id: request.id.to_string(),
            },
            token_seq,
            block_hashes: Some(local),
            isl_tokens: request.prompt_tokens as usize,
            lora_name: None,
            // The prefill hop generates one token.
            expected_output_tokens: None,
            affinity_target: None,
            pinned_worker: None,
            allowed_worker_ids: Some(routable.into_iter().collect::<HashSet<u64>>()),
            routing_constraints: RoutingConstraints::default(),
            router_config_override: None,
            priority_jump: 0.0,
            strict_priority: 0,
            policy_class: None,
            session_context: None,
            overlap,
            kv_transfer_candidates: None,
            retain_kv_transfer_chain: false,
            shared_cache_hits: None,
        })
    }
}

impl Drop for DynamoRouter {
    fn drop(&mut self) {
        self.cancel.cancel();
        // Worth knowing beside the figures: a refused event leaves the tree behind the cache.
        let refused = self.indexer.refused();
        if !refused.is_empty() {
            eprintln!("{POLICY_NAME}: the radix tree refused KV events: {refused:?}");
        }
    }
}

impl ExternalRouter for DynamoRouter {
    fn apply_events(&self, worker: u64, events: &[ExternalKvEvent]) {
        for event in events {
            self.indexer.apply(self.router_event(worker, event));
        }
    }

    fn select(
        &self,
        request: ExternalRequest,
        routable: Vec<u64>,
    ) -> BoxFuture<'_, Result<u64, ExternalError>> {
        let scheduled = self.schedule_request(&request, routable);
        async move {
            let response = self
                .scheduler
                .schedule_request(scheduled?)
                .await
                .map_err(|e| ExternalError::Router(e.to_string()))?;
            Ok(response.best_worker.worker_id)
        }
        .boxed()
    }

    fn release(&self, id: u64) -> BoxFuture<'_, Result<(), ExternalError>> {
        async move {
            let id = id.to_string();
            let failed = |e: dynamo_kv_router::SequenceError| ExternalError::Router(e.to_string());
            self.scheduler
                .mark_prefill_completed(&id)
                .await
                .map_err(failed)?;
            self.scheduler.free(&id).await.map_err(failed)
        }
        .boxed()
    }
}
