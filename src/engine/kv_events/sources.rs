//! Where an engine publishes its KV events: `GET /kv_event_sources` (vLLM), one publisher per
//! data-parallel rank, with the engine's own bind addresses turned into ones we can dial.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::Deserialize;

/// One rank's publisher, as the subscriber dials it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventSource {
    /// The data-parallel rank.
    pub rank: u32,
    /// The PUB endpoint (`tcp://host:port`).
    pub endpoint: String,
    /// The ROUTER endpoint that replays buffered batches, if the engine has one.
    pub replay: Option<String>,
    /// The topic its batches carry (`""`: every topic).
    pub topic: String,
}

/// Why an engine's event sources are unusable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// The answer is not the JSON object of ranks vLLM sends.
    #[error("kv_event_sources is not a JSON object of ranks: {0}")]
    Malformed(String),
    /// No rank publishes over ZMQ with events enabled.
    #[error("the engine publishes no KV events (start it with --kv-events-config, publisher zmq)")]
    NotPublishing,
    /// An endpoint this subscriber cannot dial (only `tcp://` is supported).
    #[error("unsupported KV event endpoint {0:?} (tcp:// only)")]
    Unsupported(String),
}

#[derive(Deserialize)]
struct RankConfig {
    #[serde(default)]
    enable_kv_cache_events: bool,
    #[serde(default)]
    publisher: String,
    #[serde(default)]
    endpoint: String,
    #[serde(default)]
    replay_endpoint: Option<String>,
    #[serde(default)]
    topic: String,
}

/// Ranks with more than this many entries are refused (an answer is a handful of ranks).
const MAX_RANKS: usize = 1024;

/// Parse the engine's answer to `GET /kv_event_sources`; `host` is the engine's address,
/// dialled where the engine bound a wildcard (`*`, `0.0.0.0`, `::`).
///
/// # Errors
/// [`SourceError`] when the answer is unreadable, publishes nothing, or names an endpoint that
/// is not `tcp://`.
pub fn parse_sources(body: &[u8], host: IpAddr) -> Result<Vec<KvEventSource>, SourceError> {
    let ranks: BTreeMap<String, RankConfig> =
        serde_json::from_slice(body).map_err(|e| SourceError::Malformed(e.to_string()))?;
    if ranks.len() > MAX_RANKS {
        return Err(SourceError::Malformed(format!("{} ranks", ranks.len())));
    }
    let mut sources = Vec::new();
    for (rank, config) in ranks {
        let rank: u32 = rank
            .parse()
            .map_err(|_| SourceError::Malformed(format!("rank {rank:?}")))?;
        if !config.enable_kv_cache_events || config.publisher != "zmq" {
            continue;
        }
        sources.push(KvEventSource {
            rank,
            endpoint: dialable(&config.endpoint, host)?,
            replay: config
                .replay_endpoint
                .filter(|e| !e.is_empty())
                .map(|e| dialable(&e, host))
                .transpose()?,
            topic: config.topic,
        });
    }
    if sources.is_empty() {
        return Err(SourceError::NotPublishing);
    }
    Ok(sources)
}

/// `tcp://*:5557` as `tcp://<host>:5557`; a named host is kept.
fn dialable(endpoint: &str, host: IpAddr) -> Result<String, SourceError> {
    let unsupported = || SourceError::Unsupported(endpoint.to_owned());
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(unsupported)?;
    let (bound, port) = rest.rsplit_once(':').ok_or_else(unsupported)?;
    let port: u16 = port.parse().map_err(|_| unsupported())?;
    let wildcard = matches!(bound, "*" | "0.0.0.0" | "[::]" | "::" | "[*]");
    let host = if wildcard {
        match host {
            IpAddr::V4(ip) => ip.to_string(),
            IpAddr::V6(ip) => format!("[{ip}]"),
        }
    } else {
        bound.to_owned()
    };
    Ok(format!("tcp://{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[test]
    fn vllms_answer_gives_dialable_endpoints_per_rank() {
        // The shape vLLM 0.32 answers (protocols.md, "ZMQ transport").
        let body = br#"{"0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","buffer_steps":10000,"hwm":100000,"max_queue_size":100000,"topic":"kv-events"},
                        "1":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://10.0.0.5:5567","replay_endpoint":null,"topic":"kv-events"}}"#;
        let sources = parse_sources(body, LOCAL).unwrap();
        assert_eq!(
            sources,
            vec![
                KvEventSource {
                    rank: 0,
                    endpoint: "tcp://127.0.0.1:5557".into(),
                    replay: Some("tcp://127.0.0.1:5558".into()),
                    topic: "kv-events".into(),
                },
                KvEventSource {
                    rank: 1,
                    endpoint: "tcp://10.0.0.5:5567".into(),
                    replay: None,
                    topic: "kv-events".into(),
                },
            ]
        );
    }

    #[test]
    fn an_engine_without_events_is_a_typed_error() {
        assert_eq!(parse_sources(b"{}", LOCAL), Err(SourceError::NotPublishing));
        let off = br#"{"0":{"enable_kv_cache_events":false,"publisher":"null","endpoint":"tcp://*:5557"}}"#;
        assert_eq!(parse_sources(off, LOCAL), Err(SourceError::NotPublishing));
        assert!(matches!(
            parse_sources(b"[1]", LOCAL),
            Err(SourceError::Malformed(_))
        ));
        let ipc =
            br#"{"0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"ipc:///tmp/x"}}"#;
        assert!(matches!(
            parse_sources(ipc, LOCAL),
            Err(SourceError::Unsupported(_))
        ));
    }
}
