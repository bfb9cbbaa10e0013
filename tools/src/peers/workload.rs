//! The request streams every router is given, as text (the peers route on text, the engines
//! tokenize it): each one a list of requests with an arrival time (open loop) or an order
//! (closed loop).
//!
//! Prompts are made of *block words*: alphanumeric words that the built-in tokenizer and the
//! mock engine read as one token each, `block_tokens` words per block, so a block of a trace
//! or a shared prefix is exactly one engine block and prefixes are shared at block granularity
//! as in the trace (`docs/performance.md`, "Against the peers").

use std::time::Duration;

use crate::replay::TraceRecord;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerRequest {
    /// Arrival from the start of the run (open loop; closed loop keeps only the order).
    pub at: Duration,
    /// The prompt text.
    pub prompt: String,
    /// Tokens to generate.
    pub max_tokens: u32,
}

/// The workloads the harness replays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkloadKind {
    /// A time-compressed slice of the Mooncake conversation trace at the engines' block size.
    Conversation,
    /// A few long system prompts shared by every user, each request a short new question.
    SharedPrefix,
    /// Tenants with a long prefix each, picked by a Zipf(1) popularity.
    MultiTenant,
}

impl WorkloadKind {
    /// Every workload, in report order.
    pub const ALL: [WorkloadKind; 3] = [
        WorkloadKind::Conversation,
        WorkloadKind::SharedPrefix,
        WorkloadKind::MultiTenant,
    ];

    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::Conversation => "conversation",
            WorkloadKind::SharedPrefix => "shared-prefix",
            WorkloadKind::MultiTenant => "multi-tenant",
        }
    }

    /// The workload named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        WorkloadKind::ALL.into_iter().find(|w| w.name() == name)
    }
}

/// The shape of a generated workload.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadConfig {
    /// Tokens per engine KV block (and per prompt block).
    pub block_tokens: u32,
    /// Requests in the stream.
    pub requests: usize,
    /// Open-loop arrival rate, requests per second (the trace's own times are compressed to
    /// it on average).
    pub rate: f64,
    /// Tokens each request generates (the trace's lengths are scaled down to at most this).
    pub max_tokens: u32,
    /// Seed of every draw.
    pub seed: u64,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            block_tokens: 16,
            requests: 240,
            rate: 8.0,
            max_tokens: 16,
            seed: 1,
        }
    }
}

/// The text of block `id`: `block_tokens` one-token words that no other block uses.
fn block_text(id: u64, block_tokens: u32, out: &mut String) {
    for j in 0..block_tokens {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&format!("b{id}x{j}"));
    }
}

/// The prompt made of blocks `ids`, cut to `tokens` words.
fn prompt_of(ids: &[u64], block_tokens: u32, tokens: u32) -> String {
    let mut text = String::new();
    for &id in ids {
        block_text(id, block_tokens, &mut text);
    }
    text.split(' ')
        .take(tokens as usize)
        .collect::<Vec<_>>()
        .join(" ")
}

/// splitmix64: the harness's draws.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A uniform draw in [0, 1) from `seed` and `i`.
fn unit(seed: u64, i: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)] // 53 bits kept on purpose
    let x = (mix(seed ^ mix(i)) >> 11) as f64;
    x / (1u64 << 53) as f64
}

/// Poisson arrivals at `rate`: the time of request `i` given the previous one.
fn next_arrival(previous: Duration, rate: f64, seed: u64, i: u64) -> Duration {
    let gap = -(1.0 - unit(seed ^ 0xa77, i)).ln() / rate.max(1e-6);
    previous + Duration::from_secs_f64(gap.min(60.0))
}

/// The first `config.requests` records of the Mooncake conversation trace, each 512-token
/// block turned into one engine block, input and output lengths scaled by the same factor
/// (output at least 1, at most `max_tokens`), arrival times compressed so the mean rate is
/// `config.rate`.
pub fn conversation(trace: &[TraceRecord], config: &WorkloadConfig) -> Vec<PeerRequest> {
    let slice = &trace[..config.requests.min(trace.len())];
    let span = slice.last().map_or(0, |r| r.timestamp);
    #[allow(clippy::cast_precision_loss)] // milliseconds of one hour
    let speedup = if span == 0 {
        1.0
    } else {
        (slice.len() as f64 / config.rate.max(1e-6)) / (span as f64 / 1000.0)
    };
    let scale = f64::from(config.block_tokens) / 512.0;
    slice
        .iter()
        .map(|r| {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // small, positive
            let tokens = (f64::from(r.input_length) * scale).ceil().max(1.0) as u32;
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let output =
                ((f64::from(r.output_length) * scale).ceil() as u32).clamp(1, config.max_tokens);
            #[allow(clippy::cast_precision_loss)]
            let at = Duration::from_secs_f64(r.timestamp as f64 / 1000.0 * speedup);
            PeerRequest {
                at,
                prompt: prompt_of(&r.hash_ids, config.block_tokens, tokens),
                max_tokens: output,
            }
        })
        .collect()
}

/// A request of the whole blocks `ids` arriving at `at`.
fn request_of(ids: &[u64], at: Duration, config: &WorkloadConfig) -> PeerRequest {
    let tokens = u32::try_from(ids.len()).unwrap_or(u32::MAX) * config.block_tokens;
    PeerRequest {
        at,
        prompt: prompt_of(ids, config.block_tokens, tokens),
        max_tokens: config.max_tokens,
    }
}

/// Four system prompts of 48 blocks, picked uniformly, each followed by a question of 2 new
/// blocks; Poisson arrivals at `config.rate`.
pub fn shared_prefix(config: &WorkloadConfig) -> Vec<PeerRequest> {
    const SYSTEMS: u64 = 4;
    const SYSTEM_BLOCKS: u64 = 48;
    const QUESTION_BLOCKS: u64 = 2;
    let mut at = Duration::ZERO;
    (0..config.requests as u64)
        .map(|i| {
            at = next_arrival(at, config.rate, config.seed, i);
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let system = ((unit(config.seed, i) * SYSTEMS as f64) as u64).min(SYSTEMS - 1);
            let mut ids: Vec<u64> = (0..SYSTEM_BLOCKS).map(|b| system * 1000 + b).collect();
            ids.extend((0..QUESTION_BLOCKS).map(|b| 1_000_000 + i * 10 + b));
            request_of(&ids, at, config)
        })
        .collect()
}

/// Twenty tenants with a 24-block prefix each, picked by Zipf(1) popularity, each request
/// its tenant's prefix and 4 new blocks; Poisson arrivals at `config.rate`.
pub fn multi_tenant(config: &WorkloadConfig) -> Vec<PeerRequest> {
    const TENANTS: usize = 20;
    const PREFIX_BLOCKS: u64 = 24;
    const OWN_BLOCKS: u64 = 4;
    #[allow(clippy::cast_precision_loss)]
    let weights: Vec<f64> = (1..=TENANTS).map(|k| 1.0 / k as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut at = Duration::ZERO;
    (0..config.requests as u64)
        .map(|i| {
            at = next_arrival(at, config.rate, config.seed, i);
            let mut draw = unit(config.seed ^ 0x7e4a, i) * total;
            let mut tenant = TENANTS - 1;
            for (k, w) in weights.iter().enumerate() {
                if draw < *w {
                    tenant = k;
                    break;
                }
                draw -= w;
            }
            let tenant = tenant as u64;
            let mut ids: Vec<u64> = (0..PREFIX_BLOCKS)
                .map(|b| 5_000_000 + tenant * 1000 + b)
                .collect();
            ids.extend((0..OWN_BLOCKS).map(|b| 9_000_000 + i * 10 + b));
            request_of(&ids, at, config)
        })
        .collect()
}

/// The best hit rate any router can reach on `requests` with unbounded caches: the share of
/// whole prompt blocks whose prefix an earlier request already had (one cache shared by all),
/// on the blocks the router hashes (the built-in tokenizer's tokens, chained per block).
pub fn ceiling(requests: &[PeerRequest], block_tokens: u32) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for request in requests {
        let tokens = prefill_router::http::tokenizer::tokenize(&request.prompt);
        let mut cached = true;
        for block in prefill_router::push::block_hashes(&tokens, block_tokens) {
            total += 1;
            cached &= !seen.insert(block);
            if cached {
                hits += 1;
            }
        }
    }
    #[allow(clippy::cast_precision_loss)]
    if total == 0 {
        0.0
    } else {
        hits as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(ms: u64, input: u32, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp: ms,
            input_length: input,
            output_length: 512,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn a_trace_block_becomes_one_engine_block_of_one_token_words() {
        let trace = [record(0, 1024, &[0, 1]), record(1000, 700, &[0, 2])];
        let config = WorkloadConfig {
            block_tokens: 16,
            requests: 2,
            rate: 2.0,
            ..WorkloadConfig::default()
        };
        let requests = conversation(&trace, &config);
        let first: Vec<_> = prefill_router::http::tokenizer::tokenize(&requests[0].prompt);
        let second: Vec<_> = prefill_router::http::tokenizer::tokenize(&requests[1].prompt);
        assert_eq!(first.len(), 32);
        assert_eq!(second.len(), 22, "700 tokens at 512 per block scale to 22");
        assert_eq!(
            first[..16],
            second[..16],
            "the shared block 0 is one shared engine block"
        );
        assert_ne!(first[16], second[16]);
        assert_eq!(requests[0].max_tokens, 16, "512 output tokens scale to 16");
        assert_eq!(
            requests[1].at,
            Duration::from_secs(1),
            "2 requests at 2/s span 1 s"
        );
    }

    #[test]
    fn shared_prefix_requests_share_one_of_four_system_prompts() {
        let config = WorkloadConfig::default();
        let requests = shared_prefix(&config);
        assert_eq!(requests.len(), config.requests);
        let systems: std::collections::HashSet<_> = requests
            .iter()
            .map(|r| r.prompt.split(' ').next().unwrap().to_owned())
            .collect();
        assert_eq!(systems.len(), 4);
        assert!(requests.windows(2).all(|w| w[0].at <= w[1].at));
        let ceiling = ceiling(&requests, config.block_tokens);
        assert!(
            ceiling > 0.9 && ceiling < 0.96,
            "48 of 50 blocks shared: {ceiling}"
        );
    }

    #[test]
    fn multi_tenant_popularity_falls_with_rank() {
        let config = WorkloadConfig {
            requests: 2000,
            ..WorkloadConfig::default()
        };
        let requests = multi_tenant(&config);
        let count = |tenant: u64| {
            let word = format!("b{}x0", 5_000_000 + tenant * 1000);
            requests
                .iter()
                .filter(|r| r.prompt.starts_with(&format!("{word} ")))
                .count()
        };
        assert!(count(0) > 2 * count(3), "{} vs {}", count(0), count(3));
        assert!(count(19) > 0);
    }

    #[test]
    fn the_same_seed_gives_the_same_stream_and_another_seed_another() {
        let config = WorkloadConfig::default();
        assert_eq!(multi_tenant(&config), multi_tenant(&config));
        let other = WorkloadConfig {
            seed: 2,
            ..config.clone()
        };
        assert_ne!(multi_tenant(&config), multi_tenant(&other));
    }
}
