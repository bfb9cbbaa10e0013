//! The mock against real vLLM (`.ci/vllm.sh` names the engines; skipped otherwise): the same
//! requests to both, the answers' shapes compared (JSON keys and value types, SSE framing, the
//! metric names and labels the mock claims, the errors), and the KV event payloads of the same
//! prompt, which are equal byte for byte after the timestamp (vLLM runs with `sha256_cbor`).

use std::net::SocketAddr;
use std::time::Duration;

use prefill_router::engine::kv_events::parse_sources;
use prefill_router::kv_events::{decode_engine_batch, EngineEvent};
use prefill_router_tools::vllm_mock::{KvRole, MockVllm};
use serde_json::{json, Value};
use zeromq::{Socket, SocketRecv};

use super::{engine, get, post, shape, shape_diff};

const PREFILL_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

fn assert_same_shape(what: &str, real: &Value, mock: &Value) {
    let mut diff = Vec::new();
    shape_diff(what, &shape(real), &shape(mock), &mut diff);
    assert!(
        diff.is_empty(),
        "{what}: {diff:#?}\nreal: {real}\nmock: {mock}"
    );
    println!("live mock: {what}: same shape");
}

/// Every SSE event of a body: `data: ` lines separated by blank lines, `[DONE]` last.
fn sse_chunks(body: &str) -> Vec<Value> {
    assert!(
        body.ends_with("data: [DONE]\n\n"),
        "SSE ends with [DONE]: {body:?}"
    );
    for block in body.trim_end().split("\n\n") {
        assert!(
            block.starts_with("data: ") && !block.contains('\n'),
            "one data line per event: {block:?}"
        );
    }
    body.trim_end()
        .split("\n\n")
        .map(|b| &b["data: ".len()..])
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// Metric name -> label names, per sample line of a Prometheus text.
fn samples(text: &str) -> Vec<(String, Vec<String>)> {
    text.lines()
        .filter(|l| l.starts_with("vllm:"))
        .map(|l| {
            let name_end = l.find(['{', ' ']).unwrap_or(l.len());
            let labels = l[name_end..]
                .strip_prefix('{')
                .and_then(|r| r.split_once('}'))
                .map(|(ls, _)| {
                    ls.split("\",")
                        .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.to_owned()))
                        .collect()
                })
                .unwrap_or_default();
            (l[..name_end].to_owned(), labels)
        })
        .collect()
}

/// Streams compared by the role of each chunk (vLLM may put several tokens in one chunk, so
/// their counts differ): the first, a middle one, the finishing one, the usage one.
fn same_stream_shapes(what: &str, real: &[Value], mock: &[Value]) {
    let finishing = |c: &[Value]| {
        c.iter()
            .position(|c| c["choices"][0]["finish_reason"].is_string())
            .expect("a finishing chunk")
    };
    let (rf, mf) = (finishing(real), finishing(mock));
    assert_same_shape(&format!("{what}: finishing chunk"), &real[rf], &mock[mf]);
    if rf > 0 && mf > 0 {
        assert_same_shape(&format!("{what}: first chunk"), &real[0], &mock[0]);
    }
    if rf > 1 && mf > 1 {
        assert_same_shape(&format!("{what}: middle chunk"), &real[1], &mock[1]);
    }
    assert_eq!(
        real.len() - rf,
        mock.len() - mf,
        "{what}: chunks after the finish (usage)"
    );
    if real.len() > rf + 1 {
        assert_same_shape(
            &format!("{what}: usage chunk"),
            &real[rf + 1],
            &mock[mf + 1],
        );
    }
}

async fn subscribe(http: SocketAddr) -> zeromq::SubSocket {
    let sources = get(http, "/kv_event_sources").await;
    let source = parse_sources(sources.body.as_bytes(), http.ip())
        .unwrap()
        .remove(0);
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&source.endpoint).await.unwrap();
    sub.subscribe(&source.topic).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    sub
}

/// The payload of the first batch storing `prompt`'s first block.
async fn stored_batch(sub: &mut zeromq::SubSocket, prompt: &[u32]) -> Vec<u8> {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(30), sub.recv())
            .await
            .unwrap()
            .unwrap();
        let payload = m.into_vec().pop().unwrap().to_vec();
        let batch = decode_engine_batch(&payload).unwrap();
        if batch
            .events
            .iter()
            .any(|e| matches!(e, EngineEvent::Stored(s) if s.token_ids.starts_with(&prompt[..32])))
        {
            return payload;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_vllm_mock_answers_in_real_vllms_shapes() {
    let env = |k| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse::<SocketAddr>().ok())
    };
    let (Some(real_p), Some(real_d), Some(real_events)) = (
        env("PREFILL_VLLM_PREFILL"),
        env("PREFILL_VLLM_DECODE"),
        env("PREFILL_VLLM_EVENTS"),
    ) else {
        println!("skipped: set PREFILL_VLLM_PREFILL, PREFILL_VLLM_DECODE and PREFILL_VLLM_EVENTS (.ci/vllm.sh)");
        return;
    };
    let models = get(real_p, "/v1/models").await.json();
    let model = models["data"][0]["id"].as_str().unwrap().to_owned();
    let max_len = models["data"][0]["max_model_len"].as_u64().unwrap() as usize;
    let dir = std::env::var_os("PREFILL_VLLM_MODEL_DIR");
    let tune = |role| {
        let (model, dir) = (model.clone(), dir.clone());
        move |c: &mut prefill_router_tools::vllm_mock::MockVllmConfig| {
            c.model = model;
            c.max_model_len = max_len;
            c.tokenizer = dir.map(Into::into);
            c.kv_role = role;
            c.kv_events_port = Some(0);
        }
    };
    let mock_p: MockVllm = engine(tune(KvRole::Producer)).await;
    let mock_d: MockVllm = engine(tune(KvRole::Consumer)).await;
    let (mp, md) = (mock_p.addr, mock_d.addr);
    assert_same_shape("/v1/models", &models, &get(mp, "/v1/models").await.json());

    // A prompt no earlier run sent (5 full blocks and a partial one).
    let salt = std::process::id()
        ^ (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos());
    let prompt: Vec<u32> = (0..170u32)
        .map(|i| 4 + (salt.wrapping_add(i.wrapping_mul(2_654_435_761)) >> 9) % 1000)
        .collect();
    let mut real_sub = subscribe(real_events).await;
    let mut mock_sub = subscribe(mp).await;

    // The prefill leg.
    let params: Value = serde_json::from_str(PREFILL_PARAMS).unwrap();
    let leg = json!({"model": model, "prompt": prompt, "max_tokens": 1, "stream": false, "kv_transfer_params": params});
    let real = post(real_p, "/v1/completions", leg.clone()).await;
    let mock = post(mp, "/v1/completions", leg).await;
    assert_eq!((real.status, mock.status), (200, 200), "{real:?}");
    let (real, mock) = (real.json(), mock.json());
    assert_same_shape("prefill leg", &real, &mock);

    // The events of that prefill: the same kinds and fields, the same hashes: the same bytes
    // after the timestamp (`[0x93, 0xcb, ts (8 bytes), ...]`).
    let real_batch = stored_batch(&mut real_sub, &prompt).await;
    let mock_batch = stored_batch(&mut mock_sub, &prompt).await;
    let (r, m) = (
        decode_engine_batch(&real_batch).unwrap(),
        decode_engine_batch(&mock_batch).unwrap(),
    );
    assert_eq!(
        r.skipped, m.skipped,
        "the same fields our decoder does not use"
    );
    assert_eq!(r.events, m.events, "the same events");
    assert_eq!(
        real_batch[10..],
        mock_batch[10..],
        "the same payload after the timestamp"
    );
    println!(
        "live mock: KV event payload: equal after the timestamp ({} bytes)",
        real_batch.len()
    );

    // The decode leg, streamed, each with its own prefill's handle.
    let decode = |params: &Value| {
        json!({"model": model, "prompt": prompt, "max_tokens": 4, "stream": true,
        "stream_options": {"include_usage": true}, "return_token_ids": true, "kv_transfer_params": params})
    };
    let real_stream = post(
        real_d,
        "/v1/completions",
        decode(&real["kv_transfer_params"]),
    )
    .await;
    let mock_stream = post(md, "/v1/completions", decode(&mock["kv_transfer_params"])).await;
    assert_eq!(
        (real_stream.status, mock_stream.status),
        (200, 200),
        "{real_stream:?}"
    );
    let (rc, mc) = (sse_chunks(&real_stream.body), sse_chunks(&mock_stream.body));
    same_stream_shapes("decode leg", &rc, &mc);
    let cached =
        |c: &[Value]| c.last().unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    assert_eq!(
        cached(&rc),
        cached(&mc),
        "the decode reports P's cached tokens"
    );

    // A plain completion, and a stream without usage.
    for body in [
        json!({"model": model, "prompt": prompt, "max_tokens": 3, "return_token_ids": true}),
        json!({"model": model, "prompt": prompt, "max_tokens": 3}),
    ] {
        let (r, m) = (
            post(real_p, "/v1/completions", body.clone()).await,
            post(mp, "/v1/completions", body).await,
        );
        assert_same_shape("completion", &r.json(), &m.json());
    }
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2, "stream": true});
    let (r, m) = (
        post(real_p, "/v1/completions", body.clone()).await,
        post(mp, "/v1/completions", body).await,
    );
    same_stream_shapes(
        "stream without usage",
        &sse_chunks(&r.body),
        &sse_chunks(&m.body),
    );
    let chat = json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "stream": true, "stream_options": {"include_usage": true}});
    let (r, m) = (
        post(real_p, "/v1/chat/completions", chat.clone()).await,
        post(mp, "/v1/chat/completions", chat).await,
    );
    same_stream_shapes("chat stream", &sse_chunks(&r.body), &sse_chunks(&m.body));
    let chat =
        json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    let (r, m) = (
        post(real_p, "/v1/chat/completions", chat.clone()).await,
        post(mp, "/v1/chat/completions", chat).await,
    );
    assert_same_shape("chat", &r.json(), &m.json());

    // /tokenize (equal tokens with the model's tokenizer).
    let body = json!({"model": model, "prompt": "def main(): return 42"});
    let (r, m) = (
        post(real_p, "/tokenize", body.clone()).await.json(),
        post(mp, "/tokenize", body).await.json(),
    );
    assert_same_shape("/tokenize", &r, &m);
    if dir.is_some() {
        assert_eq!(r["tokens"], m["tokens"], "the same tokens");
    }

    // Errors.
    for body in [
        json!({"model": "no-such-model", "prompt": [5, 6], "max_tokens": 2}),
        json!({"model": model, "prompt": [5, 6], "max_tokens": 0}),
        json!({"model": model, "max_tokens": 2}),
    ] {
        let (r, m) = (
            post(real_p, "/v1/completions", body.clone()).await,
            post(mp, "/v1/completions", body.clone()).await,
        );
        assert_eq!(r.status, m.status, "{body}");
        assert_same_shape(&format!("error {}", r.status), &r.json(), &m.json());
        assert_eq!(
            r.json()["error"]["param"],
            m.json()["error"]["param"],
            "{body}"
        );
    }

    // /metrics: every sample the mock writes, real vLLM writes too, with the same labels.
    let real_metrics = samples(&get(real_p, "/metrics").await.body);
    let mock_metrics = samples(&get(mp, "/metrics").await.body);
    for (name, labels) in &mock_metrics {
        let found = real_metrics.iter().find(|(n, _)| n == name);
        let Some((_, real_labels)) = found else {
            panic!("{name}: the mock writes it, real vLLM does not");
        };
        let missing: Vec<&String> = labels.iter().filter(|l| !real_labels.contains(l)).collect();
        assert!(
            missing.is_empty(),
            "{name}: labels {missing:?} only in the mock"
        );
    }
    println!(
        "live mock: /metrics: {} mock samples all in real vLLM's",
        mock_metrics.len()
    );
}
