//! Generated workloads in the trace format, for the shapes the Mooncake trace does not have:
//! one system prompt every request shares, many tenants with popular prompts and multi-turn
//! sessions, and chat conversations whose turns grow by less than a 512-token block. Seeded,
//! so a spec names one trace exactly.

use super::trace::{TraceRecord, BLOCK_TOKENS};
use crate::sim::SimRng;

/// A workload to generate (see [`Workload::parse`] for the spec syntax).
#[derive(Clone, Debug, PartialEq)]
pub enum Workload {
    /// Every request: the same `prefix` blocks, then 2–6 blocks of its own; Poisson arrivals.
    SharedPrefix {
        /// Arrivals per second.
        rate: f64,
        /// Requests.
        requests: usize,
        /// Shared blocks at the head of every prompt.
        prefix: usize,
        /// Seed.
        seed: u64,
    },
    /// `tenants` system prompts of 8–40 blocks with Zipf(1) popularity; each session picks a
    /// tenant and runs 1–8 turns, each turn its history plus 1–4 new blocks, 5–30 s apart;
    /// sessions start as a Poisson process so that requests arrive at about `rate`.
    MultiTenant {
        /// Requests per second, about.
        rate: f64,
        /// Requests.
        requests: usize,
        /// System prompts.
        tenants: usize,
        /// Seed.
        seed: u64,
    },
    /// Chat sessions in units of [`CHAT_UNIT`] tokens: a 16-token system line every session
    /// shares, a first message of 32–1,024 tokens, then 1–9 more turns, each adding the
    /// previous answer (32–512 tokens, the previous turn's output) and a message of 16–256
    /// tokens, 5–30 s after the answer; sessions start as a Poisson process so that requests
    /// arrive at about `rate`. Histories stay a few hundred to a few thousand tokens and grow
    /// by less than a 512-token block most turns: the shape issue #40 lost at small blocks.
    Conversation {
        /// Requests per second, about.
        rate: f64,
        /// Requests.
        requests: usize,
        /// Seed.
        seed: u64,
    },
}

/// Tokens per `hash_ids` entry of the [`Workload::Conversation`] traces.
pub const CHAT_UNIT: u32 = 16;

/// Why a workload spec does not parse.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad workload `{spec}`: {why} (shared-prefix:rate=R[,requests=N,prefix=B,seed=S] | multi-tenant:rate=R[,requests=N,tenants=T,seed=S] | conversation:rate=R[,requests=N,seed=S])")]
pub struct WorkloadError {
    spec: String,
    why: String,
}

/// Output tokens of every generated request.
const OUTPUT_TOKENS: u32 = 64;

impl Workload {
    /// Parse `shared-prefix:rate=5,requests=3000,prefix=30,seed=1` or
    /// `multi-tenant:rate=10,requests=4000,tenants=40,seed=1` (everything but `rate` optional).
    ///
    /// # Errors
    /// An unknown kind or key, a value that is not a number, or a rate that is not positive.
    pub fn parse(spec: &str) -> Result<Self, WorkloadError> {
        let bad = |why: &str| WorkloadError {
            spec: spec.to_owned(),
            why: why.to_owned(),
        };
        let (kind, rest) = spec.split_once(':').unwrap_or((spec, ""));
        let (mut rate, mut requests, mut extra, mut seed) = (None, 3_000usize, None, 1u64);
        for pair in rest.split(',').filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| bad("expected key=value"))?;
            let number = || value.parse::<u64>().map_err(|_| bad("not a whole number"));
            match key {
                "rate" => {
                    rate = Some(
                        value
                            .parse::<f64>()
                            .map_err(|_| bad("rate is not a number"))?,
                    );
                }
                "requests" => requests = usize::try_from(number()?).map_err(|_| bad("too many"))?,
                "seed" => seed = number()?,
                "prefix" if kind == "shared-prefix" => extra = Some(number()?),
                "tenants" if kind == "multi-tenant" => extra = Some(number()?),
                _ => return Err(bad(&format!("unknown key `{key}`"))),
            }
        }
        let rate = rate
            .filter(|r| r.is_finite() && *r > 0.0)
            .ok_or_else(|| bad("rate=R (> 0) is required"))?;
        let extra = |default: u64| usize::try_from(extra.unwrap_or(default)).unwrap_or(usize::MAX);
        match kind {
            "shared-prefix" => Ok(Workload::SharedPrefix {
                rate,
                requests,
                prefix: extra(30),
                seed,
            }),
            "multi-tenant" => Ok(Workload::MultiTenant {
                rate,
                requests,
                tenants: extra(40).max(1),
                seed,
            }),
            "conversation" => Ok(Workload::Conversation {
                rate,
                requests,
                seed,
            }),
            _ => Err(bad("unknown kind")),
        }
    }

    /// A short name for reports: the spec's kind and rate.
    pub fn label(&self) -> String {
        match self {
            Workload::SharedPrefix { rate, .. } => format!("shared-prefix {rate} req/s"),
            Workload::MultiTenant { rate, .. } => format!("multi-tenant {rate} req/s"),
            Workload::Conversation { rate, .. } => format!("conversation {rate} req/s"),
        }
    }

    /// Tokens per `hash_ids` entry of its trace: [`CHAT_UNIT`] for conversations, 512
    /// ([`BLOCK_TOKENS`]) for the others (as the Mooncake traces).
    pub fn unit_tokens(&self) -> u32 {
        match self {
            Workload::Conversation { .. } => CHAT_UNIT,
            _ => BLOCK_TOKENS,
        }
    }

    /// The requests, sorted by arrival.
    pub fn generate(&self) -> Vec<TraceRecord> {
        match *self {
            Workload::SharedPrefix {
                rate,
                requests,
                prefix,
                seed,
            } => shared_prefix(rate, requests, prefix, seed),
            Workload::MultiTenant {
                rate,
                requests,
                tenants,
                seed,
            } => multi_tenant(rate, requests, tenants, seed),
            Workload::Conversation {
                rate,
                requests,
                seed,
            } => conversation(rate, requests, seed),
        }
    }
}

/// An exponential gap of mean `1 / rate` seconds, in milliseconds.
fn exponential_ms(rng: &mut SimRng, rate: f64) -> f64 {
    #[allow(clippy::cast_precision_loss)] // 53 random bits into (0, 1]
    let u = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    -u.ln() / rate * 1e3
}

fn record(timestamp_ms: f64, hash_ids: Vec<u64>) -> TraceRecord {
    record_of(timestamp_ms, hash_ids, BLOCK_TOKENS, OUTPUT_TOKENS)
}

fn record_of(timestamp_ms: f64, hash_ids: Vec<u64>, unit: u32, output: u32) -> TraceRecord {
    let units = u32::try_from(hash_ids.len()).unwrap_or(u32::MAX);
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // non-negative ms
    TraceRecord {
        timestamp: timestamp_ms as u64,
        input_length: units.saturating_mul(unit),
        output_length: output,
        hash_ids,
    }
}

fn conversation(rate: f64, requests: usize, seed: u64) -> Vec<TraceRecord> {
    let mut rng = SimRng::new(seed);
    // Id 0: the system line. Mean turns per session 5.5: sessions start at rate / 5.5.
    let mut next_id = 1u64;
    let mut fresh = |units: u64| {
        let ids: Vec<u64> = (next_id..next_id + units).collect();
        next_id += units;
        ids
    };
    let session_rate = rate / 5.5;
    let mut out = Vec::with_capacity(requests + 10);
    let mut start = 0.0;
    while out.len() < requests {
        start += exponential_ms(&mut rng, session_rate);
        let mut history = vec![0u64];
        history.extend(fresh(rng.between(2, 64)));
        let mut t = start;
        let turns = rng.between(2, 10);
        for turn in 0..turns {
            let answer = rng.between(2, 32);
            let output = u32::try_from(answer).unwrap_or(u32::MAX) * CHAT_UNIT;
            out.push(record_of(t, history.clone(), CHAT_UNIT, output));
            if turn + 1 == turns {
                break;
            }
            // The answer joins the history, then the next message, after a think time.
            history.extend(fresh(answer));
            history.extend(fresh(rng.between(1, 16)));
            #[allow(clippy::cast_precision_loss)] // seconds
            let think = rng.between(5_000, 30_000) as f64;
            // The answer took about 25 ms a token to stream.
            t += think + f64::from(output) * 25.0;
        }
    }
    out.sort_by_key(|r| r.timestamp);
    out.truncate(requests);
    out
}

fn shared_prefix(rate: f64, requests: usize, prefix: usize, seed: u64) -> Vec<TraceRecord> {
    let mut rng = SimRng::new(seed);
    let mut next_id = prefix as u64;
    let mut t = 0.0;
    (0..requests)
        .map(|_| {
            t += exponential_ms(&mut rng, rate);
            let own = rng.between(2, 6);
            let ids: Vec<u64> = (0..prefix as u64).chain(next_id..next_id + own).collect();
            next_id += own;
            record(t, ids)
        })
        .collect()
}

fn multi_tenant(rate: f64, requests: usize, tenants: usize, seed: u64) -> Vec<TraceRecord> {
    let mut rng = SimRng::new(seed);
    // Tenant system prompts: ids from 1; Zipf(1) weights 1/(k+1).
    let mut next_id = 1u64;
    let prompts: Vec<Vec<u64>> = (0..tenants)
        .map(|_| {
            let len = rng.between(8, 40);
            let ids = (next_id..next_id + len).collect();
            next_id += len;
            ids
        })
        .collect();
    #[allow(clippy::cast_precision_loss)] // tenant counts are small
    let weights: Vec<f64> = (0..tenants).map(|k| 1.0 / (k as f64 + 1.0)).collect();
    let total: f64 = weights.iter().sum();
    // Mean turns per session is 4.5: sessions start at rate / 4.5.
    let session_rate = rate / 4.5;
    let mut out = Vec::with_capacity(requests + 8);
    let mut start = 0.0;
    while out.len() < requests {
        start += exponential_ms(&mut rng, session_rate);
        #[allow(clippy::cast_precision_loss)] // 53 random bits into [0, 1)
        let mut target = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
        let tenant = weights
            .iter()
            .position(|w| {
                target -= w;
                target < 0.0
            })
            .unwrap_or(tenants - 1);
        let mut history = prompts[tenant].clone();
        let mut t = start;
        for _ in 0..rng.between(1, 8) {
            let new = rng.between(1, 4);
            history.extend(next_id..next_id + new);
            next_id += new;
            out.push(record(t, history.clone()));
            #[allow(clippy::cast_precision_loss)] // seconds
            let think = rng.between(5_000, 30_000) as f64;
            t += think;
        }
    }
    out.sort_by_key(|r| r.timestamp);
    out.truncate(requests);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_are_typed_errors() {
        assert_eq!(
            Workload::parse("shared-prefix:rate=5"),
            Ok(Workload::SharedPrefix {
                rate: 5.0,
                requests: 3_000,
                prefix: 30,
                seed: 1
            })
        );
        assert!(matches!(
            Workload::parse("multi-tenant:rate=2.5,tenants=7,requests=10"),
            Ok(Workload::MultiTenant {
                tenants: 7,
                requests: 10,
                ..
            })
        ));
        for bad in [
            "shared-prefix",
            "shared-prefix:rate=0",
            "shared-prefix:rate=x",
            "shared-prefix:rate=1,tenants=3",
            "nope:rate=1",
            "multi-tenant:rate=1,requests=-1",
        ] {
            assert!(Workload::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn shared_prefix_requests_share_exactly_the_prefix_at_the_asked_rate() {
        let trace = Workload::parse("shared-prefix:rate=10,requests=2000")
            .unwrap()
            .generate();
        assert_eq!(trace.len(), 2_000);
        for r in &trace {
            assert_eq!(&r.hash_ids[..30], &(0..30).collect::<Vec<u64>>()[..]);
            assert!((32..=36).contains(&r.hash_ids.len()));
            assert_eq!(r.input_length, r.hash_ids.len() as u32 * BLOCK_TOKENS);
        }
        let span_s = trace.last().unwrap().timestamp as f64 / 1e3;
        let rate = 2_000.0 / span_s;
        assert!((8.5..11.5).contains(&rate), "{rate}");
        // Unique tails: no two requests share block 30.
        let mut tails: Vec<u64> = trace.iter().map(|r| r.hash_ids[30]).collect();
        tails.sort_unstable();
        tails.dedup();
        assert_eq!(tails.len(), 2_000);
    }

    #[test]
    fn conversation_turns_extend_their_history_by_less_than_a_block_mostly() {
        let workload = Workload::parse("conversation:rate=5,requests=2000").unwrap();
        assert_eq!(workload.unit_tokens(), CHAT_UNIT);
        let trace = workload.generate();
        assert_eq!(trace.len(), 2_000);
        assert!(trace.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        let sessions = crate::replay::sessions::sessions(&trace);
        let (mut later, mut small) = (0, 0);
        for turns in sessions.iter().filter(|s| s.len() > 1) {
            for pair in turns.windows(2) {
                let (a, b) = (&trace[pair[0]], &trace[pair[1]]);
                assert!(
                    b.hash_ids.starts_with(&a.hash_ids),
                    "a turn carries its history"
                );
                later += 1;
                small += usize::from(b.input_length - a.input_length < BLOCK_TOKENS);
            }
        }
        assert!(later > 1_000, "{later}");
        assert!(
            small * 2 > later,
            "{small} of {later} turns grow by under 512 tokens"
        );
        for r in &trace {
            assert_eq!(r.input_length, r.hash_ids.len() as u32 * CHAT_UNIT);
            assert_eq!(r.hash_ids[0], 0, "the shared system line");
        }
    }

    #[test]
    fn multi_tenant_turns_extend_their_history_and_arrive_in_order() {
        let trace = Workload::parse("multi-tenant:rate=10,requests=3000")
            .unwrap()
            .generate();
        assert_eq!(trace.len(), 3_000);
        assert!(trace.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        // Some request's prompt is another's prompt plus new blocks (a later turn).
        let mut prompts: Vec<&[u64]> = trace.iter().map(|r| &r.hash_ids[..]).collect();
        prompts.sort_unstable();
        let extended = prompts
            .windows(2)
            .filter(|w| w[1].len() > w[0].len() && w[1].starts_with(w[0]))
            .count();
        assert!(extended > 500, "{extended}");
    }
}
