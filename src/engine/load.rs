//! Engine load (feature `engine`): each engine's own count of the requests it runs and queues,
//! read from its Prometheus `/metrics` at an interval ([`EngineLinkConfig::load_interval`],
//! off by default), next to the router's own bookings in the KV cost.
//!
//! Why scrape at all: a router's bookings see only its own requests. Work that reaches an engine
//! another way (a frontend that reports nothing, a client calling the engine directly) is
//! invisible to them, and the engine's queue is the only place it shows.
//!
//! The rules (protocols.md, "Load signals"): **missing means unknown, not idle** (an engine
//! whose metrics lack the gauges is scored by the bookings alone); **stale means saturated**
//! (an engine whose metrics stopped answering is the last choice until they answer again).
//!
//! - here: the pure part, [`parse_load`] and [`LoadReading`];
//! - `kv_events/load_scraper.rs`: the loop that reads one engine's `/metrics` (it runs beside
//!   the engine's KV event feed and reports on the same board).
//!
//! [`EngineLinkConfig::load_interval`]: super::EngineLinkConfig::load_interval

/// What an engine says it is doing, summed over its data-parallel ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    /// Requests it is running (prefilling or decoding).
    pub running: f64,
    /// Requests queued, not yet scheduled.
    pub waiting: f64,
    /// The share of its KV cache in use, 0 to 1 (`None`: not reported).
    pub kv_usage: Option<f64>,
}

impl EngineLoad {
    /// Requests in the engine: running plus waiting, rounded.
    pub fn requests(&self) -> u64 {
        // Finite and ≥ 0 by parse_load's checks; gauges are whole numbers anyway.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let n = (self.running + self.waiting).round() as u64;
        n
    }
}

/// Why a `/metrics` answer gave no load.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The answer lacks a gauge every engine of the family exports.
    #[error("no {0} gauge in the engine's metrics")]
    Missing(&'static str),
    /// A gauge's value is not a finite number ≥ 0.
    #[error("{metric} has the value {value:?}")]
    Invalid {
        /// The metric's name.
        metric: String,
        /// The value as written.
        value: String,
    },
}

/// The gauges of one engine family: running, waiting, KV cache usage (each name as exported).
struct Family {
    running: &'static [&'static str],
    waiting: &'static [&'static str],
    usage: &'static [&'static str],
}

/// vLLM (v1 names, and v0's usage gauge), then SGLang (its `sglang:` prefix up to v0.5.3 and
/// `sglang_` from v0.5.4: protocols.md).
const FAMILIES: [Family; 2] = [
    Family {
        running: &["vllm:num_requests_running"],
        waiting: &["vllm:num_requests_waiting"],
        usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    },
    Family {
        running: &["sglang:num_running_reqs", "sglang_num_running_reqs"],
        waiting: &["sglang:num_queue_reqs", "sglang_num_queue_reqs"],
        usage: &["sglang:token_usage", "sglang_token_usage"],
    },
];

/// The sum of every sample of `names` in `text` (one per data-parallel rank or label set);
/// `None` when there is none.
fn gauge(text: &str, names: &[&str]) -> Result<Option<f64>, LoadError> {
    let mut sum = None;
    for line in text.lines() {
        let line = line.trim_start();
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        if !names.contains(&name) {
            continue;
        }
        // The value follows the labels (which may hold spaces inside quotes): the first token
        // after the closing brace, or after the name; an optional timestamp may follow it.
        let rest = match line[name_end..].strip_prefix('{') {
            Some(labels) => labels.rfind('}').map_or("", |i| &labels[i + 1..]),
            None => &line[name_end..],
        };
        let raw = rest.split_whitespace().next().unwrap_or("");
        let value: f64 = raw
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| LoadError::Invalid {
                metric: name.to_owned(),
                value: raw.chars().take(32).collect(),
            })?;
        *sum.get_or_insert(0.0) += value;
    }
    Ok(sum)
}

/// The load in an engine's Prometheus text (vLLM's or SGLang's gauges; several data-parallel
/// ranks summed). Running and waiting must both be there; usage is optional.
pub fn parse_load(text: &str) -> Result<EngineLoad, LoadError> {
    let mut first_missing = None;
    for family in &FAMILIES {
        let running = gauge(text, family.running)?;
        let waiting = gauge(text, family.waiting)?;
        match (running, waiting) {
            (Some(running), Some(waiting)) => {
                return Ok(EngineLoad {
                    running,
                    waiting,
                    kv_usage: gauge(text, family.usage)?,
                })
            }
            (None, _) => {
                first_missing.get_or_insert(family.running[0]);
            }
            (Some(_), None) => {
                first_missing.get_or_insert(family.waiting[0]);
            }
        }
    }
    Err(LoadError::Missing(
        first_missing.unwrap_or(FAMILIES[0].running[0]),
    ))
}

/// What the router last learnt of an engine's load.
#[derive(Clone, Debug, PartialEq)]
pub enum LoadReading {
    /// The engine's gauges, as last read.
    Known(EngineLoad),
    /// The engine answers but exports no load (the reason): its bookings alone score it.
    Unknown(String),
    /// Its metrics have not answered for longer than the staleness bound: saturated.
    Stale,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_vllm_gauges_are_read_and_ranks_summed() {
        let text = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"tiny-llama\"} 2.0
vllm:num_requests_running{engine=\"1\",model_name=\"tiny-llama\"} 1.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny-llama\"} 4.0
vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"tiny-llama\",reason=\"capacity\"} 9.0
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny-llama\"} 0.25
";
        let load = parse_load(text).unwrap();
        assert_eq!(
            load,
            EngineLoad {
                running: 3.0,
                waiting: 4.0,
                kv_usage: Some(0.25)
            }
        );
        assert_eq!(load.requests(), 7);
    }

    #[test]
    fn sglang_gauges_under_either_prefix_are_read() {
        for prefix in ["sglang:", "sglang_"] {
            let text = format!(
                "{prefix}num_running_reqs{{tp_rank=\"0\"}} 1\n{prefix}num_queue_reqs 5 1700000000000\n"
            );
            let load = parse_load(&text).unwrap();
            assert_eq!(
                (load.running, load.waiting, load.kv_usage),
                (1.0, 5.0, None)
            );
        }
    }

    #[test]
    fn missing_gauges_are_unknown_not_idle() {
        assert_eq!(
            parse_load("process_cpu_seconds_total 3\n"),
            Err(LoadError::Missing("vllm:num_requests_running"))
        );
        assert_eq!(
            parse_load("vllm:num_requests_running 1\n"),
            Err(LoadError::Missing("vllm:num_requests_waiting"))
        );
        assert_eq!(
            parse_load(""),
            Err(LoadError::Missing("vllm:num_requests_running"))
        );
    }

    #[test]
    fn a_bad_value_is_a_typed_error_and_labels_may_hold_spaces() {
        for value in ["NaN", "-1", "+Inf", "many", ""] {
            let text = format!("vllm:num_requests_running {value}\nvllm:num_requests_waiting 0\n");
            assert!(
                matches!(parse_load(&text), Err(LoadError::Invalid { .. })),
                "{value}"
            );
        }
        let spaced = "vllm:num_requests_running{model_name=\"a b} c\"} 2\nvllm:num_requests_waiting{x=\"y\"} 1\n";
        assert_eq!(parse_load(spaced).unwrap().requests(), 3);
    }
}
