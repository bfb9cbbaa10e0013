//! The mock prefill and decode engines.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream;
use parking_lot::Mutex;

use super::cache::BlockCache;
use prefill_router::discovery::InstanceId;
use prefill_router::kv_events::EventBatch;
use prefill_router::push::block_hashes;
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse, PrefillInfo};
use prefill_router::transport::{Engine, EngineStream};

/// Timing and cache shape of a mock worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MockConfig {
    /// KV block size in tokens; a worker advertises it in its card (so it is what the card
    /// resolution picks for the hop).
    pub block_size: u32,
    /// Prefill time per uncached block (a trailing partial block costs a whole one).
    pub block_cost: Duration,
    /// Decode time per emitted token.
    pub token_interval: Duration,
    /// Blocks the worker's KV cache holds (LRU).
    pub cache_blocks: usize,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            block_size: 16,
            block_cost: Duration::from_micros(500),
            token_interval: Duration::from_millis(2),
            cache_blocks: 4096,
        }
    }
}

/// Counters of a mock worker, shared with whoever started it.
#[derive(Debug, Default)]
pub struct MockStats {
    /// Requests served.
    pub requests: AtomicU64,
    /// Whole prompt blocks seen by prefills.
    pub prompt_blocks: AtomicU64,
    /// Of those, blocks found in the cache (leading hits).
    pub cached_blocks: AtomicU64,
    /// Tokens emitted.
    pub tokens: AtomicU64,
    /// Streams dropped before their last response: the worker saw the caller's cancellation
    /// (the server drops an engine stream on a Cancel frame, a deadline or a closed
    /// connection).
    pub cancelled: AtomicU64,
}

/// Counts a stream as cancelled if it is dropped before [`Unfinished::finish`].
struct Unfinished {
    stats: Arc<MockStats>,
    finished: bool,
}

impl Unfinished {
    fn new(stats: &Arc<MockStats>) -> Self {
        Unfinished {
            stats: Arc::clone(stats),
            finished: false,
        }
    }

    fn finish(&mut self) {
        self.finished = true;
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.finished {
            self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl MockStats {
    /// Cached blocks over prompt blocks, 0 when nothing was prefilled.
    pub fn hit_rate(&self) -> f64 {
        let total = self.prompt_blocks.load(Ordering::Relaxed);
        if total == 0 {
            return 0.0;
        }
        #[allow(clippy::cast_precision_loss)] // counters far below 2^52
        let rate = self.cached_blocks.load(Ordering::Relaxed) as f64 / total as f64;
        rate
    }
}

/// One worker's cache and counters, and the prefill step both engines share.
#[derive(Debug)]
struct Worker {
    id: InstanceId,
    config: MockConfig,
    cache: Mutex<BlockCache>,
    stats: Arc<MockStats>,
}

impl Worker {
    fn new(id: InstanceId, config: MockConfig) -> Self {
        Worker {
            id,
            cache: Mutex::new(BlockCache::new(config.cache_blocks)),
            config,
            stats: Arc::default(),
        }
    }

    fn with_events(id: InstanceId, config: MockConfig, epoch: u64) -> Self {
        Worker {
            id,
            cache: Mutex::new(BlockCache::with_events(config.cache_blocks, epoch)),
            config,
            stats: Arc::default(),
        }
    }

    /// The prompt tokens the cache lacks now (leading hits only, nothing touched).
    fn uncached_tokens(&self, token_ids: &[u32]) -> u64 {
        let hashes = block_hashes(token_ids, self.config.block_size);
        let hits = self.cache.lock().leading_hits(&hashes);
        let block = self.config.block_size.max(1) as usize;
        token_ids.len().saturating_sub(hits * block) as u64
    }

    /// Look the prompt up in the cache (holding its blocks from now on) and return what the
    /// prefill found and how long computing the rest takes.
    fn prefill(&self, token_ids: &[u32]) -> (PrefillInfo, Duration) {
        let hashes = block_hashes(token_ids, self.config.block_size);
        let hits = self.cache.lock().prefill(&hashes);
        let block = self.config.block_size.max(1) as usize;
        let uncached_tokens = token_ids.len().saturating_sub(hits * block);
        let uncached_blocks = uncached_tokens.div_ceil(block);
        self.stats
            .prompt_blocks
            .fetch_add(hashes.len() as u64, Ordering::Relaxed);
        self.stats
            .cached_blocks
            .fetch_add(hits as u64, Ordering::Relaxed);
        let info = PrefillInfo {
            engine_params: None,
            worker: self.id,
            prompt_tokens: u32::try_from(token_ids.len()).unwrap_or(u32::MAX),
            cached_blocks: u32::try_from(hits).unwrap_or(u32::MAX),
            block_size: self.config.block_size,
        };
        let cost = self
            .config
            .block_cost
            .saturating_mul(u32::try_from(uncached_blocks).unwrap_or(u32::MAX));
        (info, cost)
    }
}

/// The `i`-th token the mocks emit after a prompt of `prompt_len` tokens: a function of the
/// position alone, so tests can check a stream's content, and a continuation (the prompt plus
/// the tokens so far, as migration sends) goes on exactly where the first worker stopped.
pub fn output_token(prompt_len: usize, i: u32) -> u32 {
    u32::try_from(prompt_len)
        .unwrap_or(u32::MAX)
        .wrapping_add(i)
}

/// A mock prefill worker: one response with the first token and the [`PrefillInfo`], after
/// `block_cost` per uncached prompt block. Whatever `max_tokens` says, a prefill worker emits
/// one token (the hop asks for exactly that).
#[derive(Debug)]
pub struct MockPrefill {
    worker: Worker,
}

impl MockPrefill {
    /// A prefill worker known to discovery as `id`.
    pub fn new(id: InstanceId, config: MockConfig) -> Arc<Self> {
        Arc::new(MockPrefill {
            worker: Worker::new(id, config),
        })
    }

    /// A prefill worker whose cache publishes its KV events (incarnation `epoch`, larger than
    /// any earlier incarnation's of this worker); take them with
    /// [`take_kv_events`](Self::take_kv_events) and hand them to the router's
    /// [`Dispatcher::apply_kv_events`](prefill_router::push::Dispatcher::apply_kv_events).
    pub fn with_kv_events(id: InstanceId, config: MockConfig, epoch: u64) -> Arc<Self> {
        Arc::new(MockPrefill {
            worker: Worker::with_events(id, config, epoch),
        })
    }

    /// The cache's KV event batches since the last call (empty for a worker built without
    /// events).
    pub fn take_kv_events(&self) -> Vec<EventBatch> {
        self.worker.cache.lock().take_event_batches()
    }

    /// Its counters.
    pub fn stats(&self) -> Arc<MockStats> {
        Arc::clone(&self.worker.stats)
    }
}

/// A prefill worker built [`with_kv_events`](MockPrefill::with_kv_events) publishes its
/// cache's batches on the request plane ([`prefill_router::transport::serve_with_kv_events`]).
impl prefill_router::transport::KvEventSource for MockPrefill {
    fn take_kv_events(&self) -> Vec<EventBatch> {
        MockPrefill::take_kv_events(self)
    }

    /// The cache's snapshot: copied under the lock its batches are taken under, its chains
    /// built after the lock is released.
    fn kv_snapshot(&self) -> Option<prefill_router::kv_events::KvSnapshot> {
        let copy = self.worker.cache.lock().snapshot_copy();
        copy.map(crate::mock::SnapshotCopy::into_snapshot)
    }
}

impl Engine for MockPrefill {
    /// The prompt tokens its cache lacks now (what the KV dispatcher books for it), so the
    /// worker's load reports and the frontends' bookings count the same unit.
    fn prefill_work(&self, request: &GenerateRequest) -> u64 {
        self.worker.uncached_tokens(&request.token_ids)
    }

    fn generate(&self, request: GenerateRequest) -> EngineStream {
        let (info, cost) = self.worker.prefill(&request.token_ids);
        self.worker.stats.requests.fetch_add(1, Ordering::Relaxed);
        self.worker.stats.tokens.fetch_add(1, Ordering::Relaxed);
        let response = GenerateResponse {
            text: None,
            usage: None,
            token_ids: vec![output_token(request.token_ids.len(), 0)],
            finish: Some(FinishReason::Length),
            prefill: Some(info),
        };
        let mut unfinished = Unfinished::new(&self.worker.stats);
        Box::pin(stream::once(async move {
            if !cost.is_zero() {
                tokio::time::sleep(cost).await;
            }
            unfinished.finish();
            Ok(response)
        }))
    }
}

/// A mock decode worker: emits `max_tokens` tokens, one per `token_interval`. With a prefill
/// handoff the first response echoes it; without one (bypass) the worker prefills locally
/// first, at its own cache's cost, and reports that instead.
#[derive(Debug)]
pub struct MockDecode {
    worker: Worker,
}

impl MockDecode {
    /// A decode worker known to discovery as `id`.
    pub fn new(id: InstanceId, config: MockConfig) -> Arc<Self> {
        Arc::new(MockDecode {
            worker: Worker::new(id, config),
        })
    }

    /// Its counters.
    pub fn stats(&self) -> Arc<MockStats> {
        Arc::clone(&self.worker.stats)
    }
}

/// Where a decode stream is.
struct DecodeState {
    emitted: u32,
    max_tokens: u32,
    prompt_len: usize,
    /// Time to wait before the next token (the local prefill before the first one).
    delay: Duration,
    interval: Duration,
    prefill: Option<PrefillInfo>,
    stats: Arc<MockStats>,
    /// Finished once the last token is out.
    unfinished: Unfinished,
}

impl Engine for MockDecode {
    fn generate(&self, request: GenerateRequest) -> EngineStream {
        self.worker.stats.requests.fetch_add(1, Ordering::Relaxed);
        let (prefill, delay) = match request.handoff {
            Some(handoff) => (handoff, Duration::ZERO),
            None => self.worker.prefill(&request.token_ids),
        };
        let state = DecodeState {
            emitted: 0,
            max_tokens: request.max_tokens,
            prompt_len: request.token_ids.len(),
            delay,
            interval: self.worker.config.token_interval,
            prefill: Some(prefill),
            unfinished: Unfinished::new(&self.worker.stats),
            stats: Arc::clone(&self.worker.stats),
        };
        Box::pin(stream::unfold(state, |mut s| async move {
            if s.emitted >= s.max_tokens {
                s.unfinished.finish();
                return None;
            }
            if !s.delay.is_zero() {
                tokio::time::sleep(s.delay).await;
            }
            s.delay = s.interval;
            let i = s.emitted;
            s.emitted += 1;
            s.stats.tokens.fetch_add(1, Ordering::Relaxed);
            if s.emitted == s.max_tokens {
                s.unfinished.finish();
            }
            let response = GenerateResponse {
                text: None,
                usage: None,
                token_ids: vec![output_token(s.prompt_len, i)],
                finish: (s.emitted == s.max_tokens).then_some(FinishReason::Length),
                prefill: s.prefill.take(),
            };
            Some((Ok(response), s))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    fn quick() -> MockConfig {
        MockConfig {
            block_size: 4,
            block_cost: Duration::from_millis(10),
            token_interval: Duration::from_millis(1),
            cache_blocks: 64,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn prefill_time_is_proportional_to_uncached_blocks() {
        let engine = MockPrefill::new(7, quick());
        let prompt: Vec<u32> = (0..16).collect();
        let start = tokio::time::Instant::now();
        let first: Vec<_> = engine
            .generate(GenerateRequest::new(prompt.clone(), 1))
            .collect()
            .await;
        let cold = start.elapsed();
        assert_eq!(cold, Duration::from_millis(40), "4 uncached blocks");
        let info = first[0].as_ref().unwrap().prefill.clone().unwrap();
        assert_eq!((info.worker, info.cached_blocks), (7, 0));

        let mut longer = prompt;
        longer.extend(100..106); // one more whole block and a partial one
        let start = tokio::time::Instant::now();
        let second: Vec<_> = engine
            .generate(GenerateRequest::new(longer, 1))
            .collect()
            .await;
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(20),
            "2 uncached blocks"
        );
        let info = second[0].as_ref().unwrap().prefill.clone().unwrap();
        assert_eq!(info.cached_blocks, 4);
        assert!((engine.stats().hit_rate() - 4.0 / 9.0).abs() < 1e-9);
    }

    #[tokio::test(start_paused = true)]
    async fn a_publishing_prefill_worker_is_indexed_exactly_as_its_cache() {
        use prefill_router::kv_events::KvIndex;
        let engine = MockPrefill::with_kv_events(5, quick(), 1);
        let mut index = KvIndex::default();
        let prompt: Vec<u32> = (0..16).collect();
        let _: Vec<_> = engine
            .generate(GenerateRequest::new(prompt.clone(), 1))
            .collect()
            .await;
        for batch in engine.take_kv_events() {
            index.apply(5, &batch);
        }
        let hashes = block_hashes(&prompt, 4);
        assert_eq!(index.overlap(&hashes, 5), 4);
        assert!(engine.take_kv_events().is_empty(), "drained");
        assert!(MockPrefill::new(6, quick()).take_kv_events().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn decode_emits_max_tokens_at_a_steady_rate() {
        let engine = MockDecode::new(1, quick());
        let mut request = GenerateRequest::new(vec![1, 2, 3], 5);
        request.handoff = Some(PrefillInfo {
            engine_params: None,
            worker: 9,
            prompt_tokens: 3,
            cached_blocks: 0,
            block_size: 4,
        });
        let start = tokio::time::Instant::now();
        let out: Vec<_> = engine.generate(request).collect().await;
        assert_eq!(out.len(), 5);
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(4),
            "first token at once"
        );
        let first = out[0].as_ref().unwrap();
        assert_eq!(first.prefill.as_ref().unwrap().worker, 9);
        assert_eq!(out[4].as_ref().unwrap().finish, Some(FinishReason::Length));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_dropped_before_its_end_counts_as_cancelled() {
        let prefill = MockPrefill::new(1, quick());
        let done: Vec<_> = prefill
            .generate(GenerateRequest::new((0..8).collect(), 1))
            .collect()
            .await;
        assert_eq!(done.len(), 1);
        let mut s = prefill.generate(GenerateRequest::new((100..108).collect(), 1));
        assert!(
            futures_util::poll!(s.next()).is_pending(),
            "prefill under way"
        );
        drop(s);
        assert_eq!(prefill.stats().cancelled.load(Ordering::Relaxed), 1);

        let decode = MockDecode::new(2, quick());
        let all: Vec<_> = decode
            .generate(GenerateRequest::new(vec![1], 3))
            .collect()
            .await;
        assert_eq!(all.len(), 3);
        let mut s = decode.generate(GenerateRequest::new(vec![1], 3));
        let _first = s.next().await;
        drop(s);
        assert_eq!(decode.stats().cancelled.load(Ordering::Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn decode_without_handoff_prefills_locally_first() {
        let engine = MockDecode::new(1, quick());
        let start = tokio::time::Instant::now();
        let out: Vec<_> = engine
            .generate(GenerateRequest::new((0..8).collect(), 1))
            .collect()
            .await;
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(20),
            "2 blocks locally"
        );
        assert_eq!(out[0].as_ref().unwrap().prefill.as_ref().unwrap().worker, 1);
    }
}
