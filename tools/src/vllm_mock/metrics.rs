//! `GET /metrics`: the Prometheus text of the vLLM 0.32 metrics a router reads, with vLLM's
//! names, help texts, types and labels (`engine="0"`, `model_name` = the served model name,
//! labels in vLLM's alphabetical order). Counters are atomics; the two histograms sit under a
//! short lock.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// Why a request finished, as `vllm:request_success_total` labels it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finished {
    /// A stop token (`finish_reason: "stop"`).
    Stop,
    /// `max_tokens` reached (`"length"`).
    Length,
    /// The client went away (`"abort"`).
    Abort,
}

const FINISHED: [(&str, Finished); 3] = [
    ("stop", Finished::Stop),
    ("length", Finished::Length),
    ("abort", Finished::Abort),
];

/// vLLM's buckets of `vllm:time_to_first_token_seconds`.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets of `vllm:e2e_request_latency_seconds`.
const E2E_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

/// The engine's counters and gauges.
#[derive(Debug)]
pub struct Metrics {
    /// Requests prefilling or decoding.
    pub running: AtomicU64,
    /// Requests waiting for a prefill slot.
    pub waiting: AtomicU64,
    /// KV blocks the running requests hold.
    pub blocks_in_use: AtomicU64,
    /// Prompt tokens looked up in the prefix cache.
    pub queries: AtomicU64,
    /// Prompt tokens found in it.
    pub hits: AtomicU64,
    /// Prompt tokens a decode leg looked up from a remote prefill (KV transfer).
    pub external_queries: AtomicU64,
    /// Prompt tokens it got that way.
    pub external_hits: AtomicU64,
    /// Prompt tokens of finished prefills.
    pub prompt_tokens: AtomicU64,
    /// Cached prompt tokens (local and transferred).
    pub prompt_tokens_cached: AtomicU64,
    /// Tokens generated.
    pub generation_tokens: AtomicU64,
    success: [AtomicU64; 3],
    ttft: Mutex<Histogram>,
    e2e: Mutex<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            blocks_in_use: AtomicU64::new(0),
            queries: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            external_queries: AtomicU64::new(0),
            external_hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            prompt_tokens_cached: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            success: Default::default(),
            ttft: Mutex::new(Histogram::new(&TTFT_BUCKETS)),
            e2e: Mutex::new(Histogram::new(&E2E_BUCKETS)),
        }
    }
}

/// What the text needs besides the counters.
#[derive(Debug, Clone)]
pub struct MetricsLabels {
    /// The served model name.
    pub model: String,
    /// Tokens per block.
    pub block_size: usize,
    /// The cache's capacity in blocks.
    pub num_gpu_blocks: usize,
}

impl Metrics {
    /// Add `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// A request finished for `why`.
    pub fn finished(&self, why: Finished) {
        let i = FINISHED.iter().position(|(_, f)| *f == why).unwrap_or(0);
        self.success[i].fetch_add(1, Ordering::Relaxed);
    }

    /// A first token came `secs` after the request arrived.
    pub fn observe_ttft(&self, secs: f64) {
        self.ttft.lock().observe(secs);
    }

    /// A request ended `secs` after it arrived.
    pub fn observe_e2e(&self, secs: f64) {
        self.e2e.lock().observe(secs);
    }

    /// The Prometheus text.
    pub fn render(&self, labels: &MetricsLabels) -> String {
        let m = escape(&labels.model);
        let base = format!("engine=\"0\",model_name=\"{m}\"");
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::with_capacity(8 * 1024);
        let mut gauge = |name: &str, help: &str, samples: &[(String, f64)]| {
            let _ = writeln!(out, "# HELP vllm:{name} {help}\n# TYPE vllm:{name} gauge");
            for (l, v) in samples {
                let _ = writeln!(out, "vllm:{name}{{{l}}} {}", num(*v));
            }
        };
        gauge(
            "num_requests_running",
            "Number of requests in model execution batches.",
            &[(base.clone(), get(&self.running) as f64)],
        );
        gauge(
            "num_requests_waiting",
            "Number of requests waiting to be processed.",
            &[(base.clone(), get(&self.waiting) as f64)],
        );
        gauge(
            "num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            &[
                (
                    format!("{base},reason=\"capacity\""),
                    get(&self.waiting) as f64,
                ),
                (format!("{base},reason=\"deferred\""), 0.0),
            ],
        );
        let usage = if labels.num_gpu_blocks == 0 {
            0.0
        } else {
            (get(&self.blocks_in_use) as f64 / labels.num_gpu_blocks as f64).min(1.0)
        };
        gauge(
            "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            &[(base.clone(), usage)],
        );
        let mut counter = |name: &str, help: &str, samples: &[(String, u64)]| {
            let _ = writeln!(
                out,
                "# HELP vllm:{name}_total {help}\n# TYPE vllm:{name}_total counter"
            );
            for (l, v) in samples {
                let _ = writeln!(out, "vllm:{name}_total{{{l}}} {}", num(*v as f64));
            }
        };
        let one = |a: &AtomicU64| [(base.clone(), get(a))];
        counter(
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            &one(&self.queries),
        );
        counter(
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            &one(&self.hits),
        );
        counter(
            "external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
            &one(&self.external_queries),
        );
        counter(
            "external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
            &one(&self.external_hits),
        );
        counter(
            "prompt_tokens",
            "Number of prefill tokens processed.",
            &one(&self.prompt_tokens),
        );
        counter(
            "prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            &one(&self.prompt_tokens_cached),
        );
        counter(
            "generation_tokens",
            "Number of generation tokens processed.",
            &one(&self.generation_tokens),
        );
        let success: Vec<(String, u64)> = FINISHED
            .iter()
            .enumerate()
            .map(|(i, (reason, _))| {
                (
                    format!("engine=\"0\",finished_reason=\"{reason}\",model_name=\"{m}\""),
                    get(&self.success[i]),
                )
            })
            .collect();
        counter(
            "request_success",
            "Count of successfully processed requests.",
            &success,
        );
        for (name, help, h) in [
            (
                "time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                &self.ttft,
            ),
            (
                "e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                &self.e2e,
            ),
        ] {
            let h = h.lock();
            let _ = writeln!(
                out,
                "# HELP vllm:{name} {help}\n# TYPE vllm:{name} histogram"
            );
            for (b, c) in h.bounds.iter().zip(&h.counts) {
                let _ = writeln!(
                    out,
                    "vllm:{name}_bucket{{engine=\"0\",le=\"{}\",model_name=\"{m}\"}} {}",
                    num(*b),
                    num(*c as f64)
                );
            }
            let _ = writeln!(
                out,
                "vllm:{name}_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"{m}\"}} {}",
                num(h.count as f64)
            );
            let _ = writeln!(out, "vllm:{name}_count{{{base}}} {}", num(h.count as f64));
            let _ = writeln!(out, "vllm:{name}_sum{{{base}}} {}", num(h.sum));
        }
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sha256_cbor\"}} 1.0",
            labels.block_size, labels.num_gpu_blocks
        );
        out
    }
}

/// A number as Python's prometheus client writes it (`2.0`, `0.25`, `1e-05`).
fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_has_vllms_names_and_the_load_parser_reads_it() {
        let m = Metrics::default();
        Metrics::add(&m.running, 2);
        Metrics::add(&m.waiting, 3);
        m.observe_ttft(0.03);
        m.finished(Finished::Length);
        let text = m.render(&MetricsLabels {
            model: "tiny-llama".into(),
            block_size: 32,
            num_gpu_blocks: 100,
        });
        assert!(text
            .contains("vllm:num_requests_running{engine=\"0\",model_name=\"tiny-llama\"} 2.0\n"));
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.04\",model_name=\"tiny-llama\"} 1.0\n"));
        assert!(text.contains("vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"tiny-llama\"} 1.0\n"));
        let load = prefill_router::engine::parse_load(&text).unwrap();
        assert_eq!((load.running, load.waiting), (2.0, 3.0));
    }
}
