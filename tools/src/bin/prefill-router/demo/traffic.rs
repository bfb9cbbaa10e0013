//! Multi-turn chat traffic through the frontend, and what it observed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use parking_lot::Mutex;
use prefill_router::discovery::InstanceId;
use prefill_router::request::GenerateRequest;
use prefill_router::rng::SplitMix64;
use prefill_router::PrefillHop;

/// Instance ids at or above this are decode workers (a response prefilled there bypassed).
pub const DECODE_IDS: InstanceId = 100;

/// The shape of the traffic.
#[derive(Clone, Debug)]
pub struct TrafficShape {
    /// Concurrent conversations.
    pub sessions: usize,
    /// Shared system-prompt tokens at the start of every prompt.
    pub system_tokens: usize,
    /// New user tokens per turn.
    pub turn_tokens: usize,
    /// Tokens generated per turn.
    pub max_tokens: u32,
    /// Turns before a conversation starts over.
    pub turns_per_conversation: usize,
    /// Pause between a reply and the next turn.
    pub think: Duration,
    /// A request that has not finished by then is lost.
    pub deadline: Duration,
    /// Attempts per turn when the frontend answers with an error.
    pub attempts: usize,
}

/// How one request went.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Time from the call to the first token.
    pub ttft: Duration,
    /// The prefill worker, or `None` when the request bypassed to decode.
    pub prefill_worker: Option<InstanceId>,
    /// Leading prompt blocks found in the prefill worker's cache.
    pub cached_blocks: u32,
    /// Whole prompt blocks.
    pub prompt_blocks: u32,
}

/// What the traffic saw (shared by all sessions).
#[derive(Debug, Default)]
pub struct Tally {
    /// Requests answered through the prefill hop.
    pub via_prefill: AtomicU64,
    /// Requests answered by decode alone (bypass).
    pub bypassed: AtomicU64,
    /// Attempts that failed with an error and were retried.
    pub retried: AtomicU64,
    /// Turns that failed on every attempt.
    pub failed: AtomicU64,
    /// Requests that did not finish by their deadline, or finished with the wrong token count.
    pub lost: AtomicU64,
    /// Samples of the current phase.
    pub samples: Mutex<Vec<Sample>>,
}

impl Tally {
    /// Take the samples collected so far.
    pub fn take_samples(&self) -> Vec<Sample> {
        std::mem::take(&mut *self.samples.lock())
    }
}

/// The frontend the traffic goes through.
pub struct Frontend {
    /// Both hops: the topology watcher, the prefill router and the decode hop.
    pub hop: PrefillHop,
}

/// Deterministic tokens, so both routing modes see the same ones.
fn tokens(rng: &mut SplitMix64, n: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % 50_000) as u32).collect()
}

/// One conversation: run turns until `stop` is set or `turns` are done (`None`: no limit).
pub async fn converse(
    frontend: Arc<Frontend>,
    tally: Arc<Tally>,
    shape: TrafficShape,
    seed: u64,
    turns: Option<usize>,
    stop: Arc<AtomicBool>,
) {
    let mut rng = SplitMix64::new(seed);
    let system = tokens(&mut SplitMix64::new(0xC0FFEE), shape.system_tokens);
    let mut history: Vec<u32> = Vec::new();
    let mut turn_in_conversation = 0;
    let mut done = 0;
    while !stop.load(Ordering::Relaxed) && turns.is_none_or(|t| done < t) {
        if turn_in_conversation == shape.turns_per_conversation {
            history.clear();
            turn_in_conversation = 0;
        }
        history.extend(tokens(&mut rng, shape.turn_tokens));
        let mut prompt = system.clone();
        prompt.extend_from_slice(&history);
        let reply = turn(&frontend, &tally, &shape, prompt).await;
        history.extend(reply);
        turn_in_conversation += 1;
        done += 1;
        tokio::time::sleep(shape.think).await;
    }
}

/// One turn, with retries on errors; returns the reply's tokens.
async fn turn(
    frontend: &Frontend,
    tally: &Tally,
    shape: &TrafficShape,
    prompt: Vec<u32>,
) -> Vec<u32> {
    for attempt in 1..=shape.attempts {
        let request = GenerateRequest::new(prompt.clone(), shape.max_tokens);
        match tokio::time::timeout(shape.deadline, once(frontend, request)).await {
            Err(_) => {
                tally.lost.fetch_add(1, Ordering::Relaxed);
                tracing::error!("request lost: no answer within {:?}", shape.deadline);
                return Vec::new();
            }
            Ok(Ok((sample, tokens))) => {
                if tokens.len() != shape.max_tokens as usize {
                    tally.lost.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(
                        got = tokens.len(),
                        "request answered with the wrong token count"
                    );
                }
                let counter = if sample.prefill_worker.is_some() {
                    &tally.via_prefill
                } else {
                    &tally.bypassed
                };
                counter.fetch_add(1, Ordering::Relaxed);
                tally.samples.lock().push(sample);
                return tokens;
            }
            Ok(Err(error)) => {
                tracing::info!(attempt, %error, "request failed");
                if attempt < shape.attempts {
                    tally.retried.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
    tally.failed.fetch_add(1, Ordering::Relaxed);
    Vec::new()
}

/// One attempt: the sample and every token.
async fn once(frontend: &Frontend, request: GenerateRequest) -> Result<(Sample, Vec<u32>), String> {
    let start = Instant::now();
    let prompt_tokens = request.token_ids.len();
    let mut stream = frontend
        .hop
        .generate(request)
        .await
        .map_err(|e| e.to_string())?;
    let mut tokens = Vec::new();
    let mut sample: Option<Sample> = None;
    while let Some(item) = stream.next().await {
        let response = item.map_err(|e| e.to_string())?;
        if sample.is_none() {
            let info = response.prefill.clone().unwrap_or_default();
            let block = info.block_size.max(1) as usize;
            sample = Some(Sample {
                ttft: start.elapsed(),
                prefill_worker: (info.worker < DECODE_IDS).then_some(info.worker),
                cached_blocks: info.cached_blocks,
                prompt_blocks: u32::try_from(prompt_tokens / block).unwrap_or(u32::MAX),
            });
        }
        tokens.extend_from_slice(&response.token_ids);
    }
    sample
        .map(|s| (s, tokens))
        .ok_or_else(|| "empty response stream".to_owned())
}
