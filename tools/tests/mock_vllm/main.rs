//! The mock vLLM engine (`prefill_router_tools::vllm_mock`, `docs/engines.md`, "The mock vLLM
//! engine"): its protocol, cache, metrics and KV events in-process; `prefill-router serve` in
//! front of mock engines as processes; and (`live_vllm_*`, when `.ci/vllm.sh` names real
//! engines) the same requests to real vLLM and to the mock, their shapes compared.

#[path = "../frontend/mod.rs"]
mod frontend;

mod events;
mod live;
mod protocol;
mod serve;

use std::net::SocketAddr;

use prefill_router_tools::vllm_mock::{MockVllm, MockVllmConfig};
use serde_json::Value;

/// An engine on a free port, fast timing (1 ms + 10 µs per token, 2 ms per output token).
pub async fn engine(tune: impl FnOnce(&mut MockVllmConfig)) -> MockVllm {
    let mut config = MockVllmConfig::default();
    config.cost.prefill_overhead = std::time::Duration::from_millis(1);
    config.cost.prefill_per_token = std::time::Duration::from_micros(10);
    config.cost.decode_per_token = std::time::Duration::from_millis(2);
    tune(&mut config);
    MockVllm::start(config).await.expect("mock engine starts")
}

/// `frontend::post` off the runtime's threads (the engine runs on them).
pub async fn post(addr: SocketAddr, path: &str, body: Value) -> frontend::Response {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || frontend::post(addr, &path, &body))
        .await
        .unwrap()
}

/// `frontend::request_with` off the runtime's threads.
pub async fn post_with(
    addr: SocketAddr,
    path: &str,
    body: Value,
    headers: Vec<(String, String)>,
) -> frontend::Response {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || {
        let h: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        frontend::request_with(addr, "POST", &path, Some(body.to_string().as_bytes()), &h)
    })
    .await
    .unwrap()
}

/// `frontend::get` off the runtime's threads.
pub async fn get(addr: SocketAddr, path: &str) -> frontend::Response {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || frontend::get(addr, &path))
        .await
        .unwrap()
}

/// The sum of a metric's samples whose line contains `label`.
pub fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A JSON value's shape: objects keep their keys, arrays the shape of their first item,
/// scalars become their type's name.
pub fn shape(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), shape(v))).collect()),
        Value::Array(a) => Value::Array(a.first().map(shape).into_iter().collect()),
        Value::String(_) => "string".into(),
        Value::Number(n) if n.is_f64() => "float".into(),
        Value::Number(_) => "integer".into(),
        Value::Bool(_) => "bool".into(),
        Value::Null => "null".into(),
    }
}

/// Where two shapes differ (paths), empty when they are the same.
pub fn shape_diff(path: &str, real: &Value, mock: &Value, out: &mut Vec<String>) {
    match (real, mock) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                match b.get(k) {
                    Some(w) => shape_diff(&format!("{path}.{k}"), v, w, out),
                    None => out.push(format!("{path}.{k}: missing in the mock")),
                }
            }
            for k in b.keys().filter(|k| !a.contains_key(*k)) {
                out.push(format!("{path}.{k}: only in the mock"));
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            if let (Some(x), Some(y)) = (a.first(), b.first()) {
                shape_diff(&format!("{path}[0]"), x, y, out);
            }
        }
        (a, b) if a != b => out.push(format!("{path}: real {a}, mock {b}")),
        _ => {}
    }
}
