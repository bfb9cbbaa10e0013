//! The engine: a request waits for a prefill slot, prefills for a time that depends on its
//! uncached tokens, stores its blocks (publishing the events), then decodes at a steady rate.
//! Nothing busy-waits: every wait is a tokio timer or a semaphore.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{mpsc, Semaphore};
use tokio::time::Instant;

use super::cache::PrefixCache;
use super::config::MockVllmConfig;
use super::events::Publisher;
use super::hash::block_hashes;
use super::metrics::{Finished, Metrics, MetricsLabels};

/// Where a request's prompt KV comes from besides the engine's own cache.
#[derive(Clone, Debug, PartialEq)]
pub enum Transfer {
    /// Nothing: a plain request (or a decode leg whose params are unusable: it recomputes).
    None,
    /// A prefill leg (`do_remote_decode`): it answers with the handle a decode engine pulls.
    Produce,
    /// A decode leg (`do_remote_prefill` with usable params): `tokens` of the prompt's KV come
    /// from the prefill engine, which had `cached_tokens` of them cached itself.
    Pull {
        /// `remote_num_tokens`, at most the prompt's length.
        tokens: usize,
        /// `remote_prefill_cached_tokens` (what vLLM reports as the decode's cached tokens).
        cached_tokens: usize,
    },
}

/// One request as the engine runs it.
#[derive(Clone, Debug)]
pub struct Job {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate (at least 1).
    pub max_tokens: usize,
    /// Token ids that end the request (`stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// The P/D role of the request.
    pub transfer: Transfer,
}

/// What a finished (or cut) request did.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: usize,
    /// `"length"` or `"stop"`.
    pub finish_reason: &'static str,
    /// The stop token that ended it, if one did.
    pub stop_reason: Option<u32>,
    /// A prefill leg's KV block ids (`remote_block_ids[0]`).
    pub block_ids: Vec<u64>,
}

/// What a streaming request receives: tokens one by one, then the outcome.
#[derive(Debug)]
pub enum Step {
    /// The next generated token.
    Token(u32),
    /// The end.
    Done(Outcome),
}

/// The deterministic "greedy" output of `prompt`: the same on every engine, derived from the
/// prompt's tokens and the tokens generated so far, in `[4, vocab)` (0 to 3 are the special
/// tokens of the tiny model).
pub fn output_tokens(prompt: &[u32], n: usize, vocab: u32) -> Vec<u32> {
    let span = u64::from(vocab.max(5) - 4);
    let mut state: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in prompt {
        state = (state ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        // splitmix64 of the running state.
        let mut z = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let token = 4 + (z % span) as u32;
        out.push(token);
        state = (state ^ u64::from(token)).wrapping_mul(0x0100_0000_01b3);
    }
    out
}

/// A gauge counted up for as long as the guard lives.
struct Gauge<'a>(&'a AtomicU64, u64);

impl<'a> Gauge<'a> {
    fn new(gauge: &'a AtomicU64, n: u64) -> Self {
        gauge.fetch_add(n, Ordering::Relaxed);
        Gauge(gauge, n)
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
}

/// Counts an abort when a request is dropped before it finished.
struct Abort<'a>(Option<&'a Metrics>);

impl Drop for Abort<'_> {
    fn drop(&mut self) {
        if let Some(m) = self.0 {
            m.finished(Finished::Abort);
        }
    }
}

/// The engine's state, shared by the HTTP handlers.
#[derive(Debug)]
pub struct Engine {
    /// The configuration it runs with.
    pub config: MockVllmConfig,
    /// Its counters.
    pub metrics: Metrics,
    cache: Mutex<PrefixCache>,
    publisher: Option<Publisher>,
    prefills: Semaphore,
    prefilling: AtomicUsize,
    next_block_id: AtomicU64,
}

impl Engine {
    /// An engine of `config`, publishing through `publisher` if given.
    pub fn new(config: MockVllmConfig, publisher: Option<Publisher>) -> Self {
        Engine {
            cache: Mutex::new(PrefixCache::new(config.block_size, config.num_gpu_blocks)),
            prefills: Semaphore::new(config.cost.max_batch.max(1)),
            prefilling: AtomicUsize::new(0),
            next_block_id: AtomicU64::new(1),
            metrics: Metrics::default(),
            publisher,
            config,
        }
    }

    /// The labels `/metrics` needs.
    pub fn labels(&self) -> MetricsLabels {
        MetricsLabels {
            model: self.config.model.clone(),
            block_size: self.config.block_size,
            num_gpu_blocks: self.config.num_gpu_blocks,
        }
    }

    /// Whether `hash` is in the prefix cache (for tests).
    pub fn cached(&self, hash: u64) -> bool {
        self.cache.lock().contains(hash)
    }

    /// Blocks in the prefix cache.
    pub fn cached_blocks(&self) -> usize {
        self.cache.lock().len()
    }

    /// `POST /reset_prefix_cache`: drop the cache, publish `AllBlocksCleared`.
    pub fn reset_prefix_cache(&self) {
        let mut cache = self.cache.lock();
        cache.clear();
        if let Some(p) = &self.publisher {
            p.publish(&[super::cache::CacheEvent::Cleared]);
        }
    }

    /// Hold the full blocks of `tokens` in the cache and publish what changed (under the
    /// cache's lock: batches leave in the order the cache changed).
    fn commit(&self, tokens: &[u32]) {
        let hashes = block_hashes(tokens, self.config.block_size);
        let mut cache = self.cache.lock();
        let events = cache.commit(&hashes, tokens);
        if let Some(p) = &self.publisher {
            p.publish(&events);
        }
    }

    /// Run `job` arriving at `arrived`: each token to `stream` as it comes if given (the
    /// request stops when the receiver is gone), the whole decode slept at once otherwise.
    pub async fn run(
        &self,
        job: Job,
        arrived: Instant,
        stream: Option<&mpsc::Sender<Step>>,
    ) -> Option<Outcome> {
        let m = &self.metrics;
        let mut abort = Abort(Some(m));
        let bs = self.config.block_size.max(1);
        let prompt_len = job.prompt.len();
        let cost = &self.config.cost;
        // Queued until a prefill slot frees.
        let permit = {
            let _waiting = Gauge::new(&m.waiting, 1);
            self.prefills.acquire().await.ok()?
        };
        let total_blocks = (prompt_len + job.max_tokens).div_ceil(bs) as u64;
        let _running = Gauge::new(&m.running, 1);
        let _blocks = Gauge::new(&m.blocks_in_use, total_blocks);
        let hashes = block_hashes(&job.prompt, bs);
        let local = self.cache.lock().hits(&hashes, prompt_len) * bs;
        let (pulled, cached_tokens) = match job.transfer {
            Transfer::Pull {
                tokens,
                cached_tokens,
            } => (tokens.min(prompt_len).saturating_sub(local), cached_tokens),
            _ => (0, local),
        };
        let compute = prompt_len - local - pulled;
        let running = self.prefilling.fetch_add(1, Ordering::Relaxed);
        let pulled_blocks = pulled.div_ceil(bs) as u32;
        let time = cost.prefill_time(compute as u32, running)
            + self.config.transfer_per_block.saturating_mul(pulled_blocks);
        tokio::time::sleep(time).await;
        self.prefilling.fetch_sub(1, Ordering::Relaxed);
        drop(permit);
        self.commit(&job.prompt);
        Metrics::add(&m.queries, prompt_len as u64);
        Metrics::add(&m.hits, local as u64);
        if matches!(job.transfer, Transfer::Pull { .. }) {
            Metrics::add(&m.external_queries, (prompt_len - local) as u64);
            Metrics::add(&m.external_hits, pulled as u64);
        }
        Metrics::add(&m.prompt_tokens, prompt_len as u64);
        Metrics::add(&m.prompt_tokens_cached, (local + pulled) as u64);
        m.observe_ttft(arrived.elapsed().as_secs_f64());

        let planned = output_tokens(&job.prompt, job.max_tokens, self.config.vocab_size);
        let mut out = Outcome {
            cached_tokens,
            finish_reason: "length",
            ..Outcome::default()
        };
        for (i, &token) in planned.iter().enumerate() {
            if i > 0 && stream.is_some() {
                tokio::time::sleep(cost.decode_per_token).await;
            }
            out.tokens.push(token);
            Metrics::add(&m.generation_tokens, 1);
            if let Some(tx) = stream {
                tx.send(Step::Token(token)).await.ok()?;
            }
            if job.stop_token_ids.contains(&token) {
                out.finish_reason = "stop";
                out.stop_reason = Some(token);
                break;
            }
        }
        if stream.is_none() {
            tokio::time::sleep(cost.decode_time(out.tokens.len() as u32)).await;
        }
        // Blocks the decode filled (the last token's KV is not computed yet).
        let mut all = job.prompt;
        all.extend_from_slice(&out.tokens[..out.tokens.len().saturating_sub(1)]);
        if all.len() / bs > prompt_len / bs {
            self.commit(&all);
        }
        if job.transfer == Transfer::Produce {
            let n = prompt_len.div_ceil(bs) as u64;
            let first = self.next_block_id.fetch_add(n, Ordering::Relaxed);
            let span = self.config.num_gpu_blocks.max(2) as u64 - 1;
            out.block_ids = (0..n).map(|i| 1 + (first + i - 1) % span).collect();
        }
        abort.0 = None;
        m.finished(if out.finish_reason == "stop" {
            Finished::Stop
        } else {
            Finished::Length
        });
        m.observe_e2e(arrived.elapsed().as_secs_f64());
        Some(out)
    }

    /// How long a prefill of `uncached` tokens takes on an idle engine.
    pub fn idle_prefill_time(&self, uncached: u32) -> Duration {
        self.config.cost.prefill_time(uncached, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_a_function_of_the_prompt_alone() {
        let a = output_tokens(&[5, 6, 7], 8, 1024);
        assert_eq!(a, output_tokens(&[5, 6, 7], 8, 1024));
        assert_eq!(a[..3], output_tokens(&[5, 6, 7], 3, 1024)[..]);
        assert_ne!(a, output_tokens(&[5, 6, 8], 8, 1024));
        assert!(a.iter().all(|&t| (4..1024).contains(&t)));
    }
}
