//! The HTTP side in-process: answer shapes, errors, SSE framing, the cache as usage and
//! metrics report it, the P/D legs.

use serde_json::json;

use prefill_router_tools::vllm_mock::engine::output_tokens;
use prefill_router_tools::vllm_mock::KvRole;

use super::{engine, get, metric, post, post_with};

fn prompt(base: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| 4 + (base + i * 7) % 1000).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_answer_in_vllms_shapes_and_stream_with_done() {
    let e = engine(|_| {}).await;
    let p = prompt(1, 40);
    let r = post(
        e.addr,
        "/v1/completions",
        json!({"model": "tiny-llama", "prompt": p, "max_tokens": 5, "return_token_ids": true, "temperature": 0.7, "unknown": {"x": 1}}),
    )
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["choices"][0]["token_ids"],
        json!(output_tokens(&p, 5, 1024))
    );
    assert_eq!(v["choices"][0]["prompt_token_ids"], json!(p));
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["prompt_tokens"], 40);
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    assert!(v["kv_transfer_params"].is_null());

    let s = post(
        e.addr,
        "/v1/completions",
        json!({"prompt": p, "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(s.status, 200);
    assert!(s
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    assert!(s.body.ends_with("data: [DONE]\n\n"), "{:?}", s.body);
    let events = s.events();
    assert_eq!(events.len(), 6, "4 tokens, usage, [DONE]: {events:?}");
    let chunks: Vec<serde_json::Value> = events[..5]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    assert!(chunks[2]["choices"][0]["finish_reason"].is_null());
    assert_eq!(chunks[4]["choices"], json!([]));
    assert_eq!(chunks[4]["usage"]["completion_tokens"], 4);
    // Text is the same streamed or not.
    let whole = post(
        e.addr,
        "/v1/completions",
        json!({"prompt": p, "max_tokens": 4}),
    )
    .await;
    let streamed: String = chunks[..4]
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(whole.json()["choices"][0]["text"], streamed);

    let chat = post(
        e.addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, "stream": true}),
    )
    .await;
    let events = chat.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let head: serde_json::Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(head["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chat.chat_stream(), (4, true), "the role chunk and 3 tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_vllm_shaped_errors_and_the_engine_serves_on() {
    let e = engine(|c| c.max_model_len = 100).await;
    for (body, status, param) in [
        (
            json!({"model": "other", "prompt": [5]}),
            404,
            json!("model"),
        ),
        (json!({"max_tokens": 2}), 400, json!("prompt")),
        (json!({"prompt": [5, 99_999]}), 400, json!(null)),
        (
            json!({"prompt": [5], "max_tokens": 0}),
            400,
            json!("max_tokens"),
        ),
        (
            json!({"prompt": [5], "max_tokens": 101}),
            400,
            json!("max_tokens"),
        ),
        (json!({"prompt": vec![5; 100]}), 400, json!("input_tokens")),
        (
            json!({"prompt": [5], "stream_options": {"include_usage": true}}),
            400,
            json!("stream_options"),
        ),
    ] {
        let r = post(e.addr, "/v1/completions", body.clone()).await;
        assert_eq!(r.status, status, "{body}: {r:?}");
        let v = r.json();
        assert_eq!(v["error"]["code"], status, "{body}");
        assert_eq!(v["error"]["param"], param, "{body}");
        assert!(v["error"]["message"].is_string() && v["error"]["type"].is_string());
    }
    let junk = tokio::task::spawn_blocking({
        let addr = e.addr;
        move || super::frontend::request(addr, "POST", "/v1/completions", Some(b"{not json"))
    })
    .await
    .unwrap();
    assert_eq!(junk.status, 400);
    let big = vec![b'1'; 5 << 20];
    let over = tokio::task::spawn_blocking({
        let addr = e.addr;
        move || super::frontend::request(addr, "POST", "/v1/completions", Some(&big))
    })
    .await
    .unwrap();
    assert_eq!(over.status, 413, "bodies are bounded");
    assert_eq!(get(e.addr, "/nope").await.status, 404);
    assert_eq!(get(e.addr, "/health").await.status, 200);
    let ok = post(
        e.addr,
        "/v1/completions",
        json!({"prompt": [5, 6], "max_tokens": 1}),
    )
    .await;
    assert_eq!(ok.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_is_cached_in_usage_and_metrics() {
    let e = engine(|_| {}).await;
    let p = prompt(3, 100); // 3 full blocks of 32 and 4 tokens
    let cached = |r: &super::frontend::Response| {
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].clone()
    };
    let first = post(
        e.addr,
        "/v1/completions",
        json!({"prompt": p, "max_tokens": 1}),
    )
    .await;
    assert_eq!(cached(&first), 0);
    let second = post(
        e.addr,
        "/v1/completions",
        json!({"prompt": p, "max_tokens": 1}),
    )
    .await;
    assert_eq!(cached(&second), 96);
    let text = get(e.addr, "/metrics").await.body;
    assert_eq!(metric(&text, "vllm:prefix_cache_queries_total", ""), 200.0);
    assert_eq!(metric(&text, "vllm:prefix_cache_hits_total", ""), 96.0);
    assert_eq!(metric(&text, "vllm:prompt_tokens_total", ""), 200.0);
    assert_eq!(metric(&text, "vllm:generation_tokens_total", ""), 2.0);
    assert_eq!(metric(&text, "vllm:request_success_total", "length"), 2.0);
    assert_eq!(
        metric(&text, "vllm:time_to_first_token_seconds_count", ""),
        2.0
    );
    assert!(text.contains("vllm:cache_config_info{block_size=\"32\""));
    let load = prefill_router::engine::parse_load(&text).unwrap();
    assert_eq!((load.running, load.waiting), (0.0, 0.0));
    // The reset empties it.
    let reset = post(e.addr, "/reset_prefix_cache", json!({})).await;
    assert_eq!(
        (reset.status, reset.json()),
        (200, json!({"success": true}))
    );
    let third = post(
        e.addr,
        "/v1/completions",
        json!({"prompt": p, "max_tokens": 1}),
    )
    .await;
    assert_eq!(cached(&third), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pd_legs_hand_off_like_nixl_and_decode_equals_aggregated_output() {
    let p_engine = engine(|c| c.kv_role = KvRole::Producer).await;
    let d_engine = engine(|c| c.kv_role = KvRole::Consumer).await;
    let p = prompt(9, 200);
    let ask = json!({"prompt": p, "max_tokens": 1, "stream": false, "kv_transfer_params":
        {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
         "remote_block_ids": null, "remote_host": null, "remote_port": null}});
    post(p_engine.addr, "/v1/completions", ask.clone()).await; // cached now
    let r = post_with(
        p_engine.addr,
        "/v1/completions",
        ask,
        vec![("X-Request-Id".into(), "pd-1".into())],
    )
    .await;
    let v = r.json();
    assert_eq!(v["id"], "cmpl-pd-1");
    let params = v["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(
        params["remote_block_ids"][0].as_array().unwrap().len(),
        7,
        "200 tokens in blocks of 32"
    );
    assert_eq!(params["remote_num_tokens"], 200);
    assert_eq!(params["remote_prefill_cached_tokens"], 192);
    assert!(params["remote_request_id"]
        .as_str()
        .unwrap()
        .starts_with("cmpl-pd-1-0-"));
    assert_eq!(params["transfer_mode"], "pull");

    let decode = json!({"prompt": p, "max_tokens": 6, "return_token_ids": true, "kv_transfer_params": params});
    let d = post(d_engine.addr, "/v1/completions", decode.clone())
        .await
        .json();
    assert_eq!(
        d["choices"][0]["token_ids"],
        json!(output_tokens(&p, 6, 1024))
    );
    assert_eq!(
        d["usage"]["prompt_tokens_details"]["cached_tokens"], 192,
        "P's cached tokens, as vLLM reports them"
    );
    assert!(d["kv_transfer_params"].is_null());
    let metrics = get(d_engine.addr, "/metrics").await.body;
    assert_eq!(
        metric(&metrics, "vllm:external_prefix_cache_hits_total", ""),
        200.0
    );
    // Without a handle the decode engine prefills itself, to the same answer.
    let alone = post(
        d_engine.addr,
        "/v1/completions",
        json!({"prompt": prompt(11, 50), "max_tokens": 3}),
    )
    .await;
    assert_eq!(alone.status, 200);
    // A handle naming a prefill engine that is gone: HTTP 500, as vLLM's `fail` policy.
    let side = params["remote_port"].as_u64().unwrap();
    p_engine.shutdown().await;
    let mut bogus = decode;
    bogus["kv_transfer_params"]["remote_port"] = json!(side);
    let failed = post(d_engine.addr, "/v1/completions", bogus).await;
    assert_eq!(failed.status, 500, "{failed:?}");
    assert_eq!(failed.json()["error"]["type"], "InternalServerError");
    assert_eq!(get(d_engine.addr, "/health").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_models_and_sources_answer_in_vllms_shapes() {
    let e = engine(|c| c.kv_events_port = Some(0)).await;
    let t = post(
        e.addr,
        "/tokenize",
        json!({"model": "tiny-llama", "prompt": "hello world"}),
    )
    .await
    .json();
    assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
    assert_eq!(t["max_model_len"], 4096);
    let d = post(e.addr, "/detokenize", json!({"tokens": t["tokens"]}))
        .await
        .json();
    assert!(d["prompt"].is_string());
    let m = get(e.addr, "/v1/models").await.json();
    assert_eq!(m["data"][0]["id"], "tiny-llama");
    let sources = get(e.addr, "/kv_event_sources").await;
    let parsed =
        prefill_router::engine::kv_events::parse_sources(sources.body.as_bytes(), e.addr.ip())
            .expect("our subscriber reads it");
    assert_eq!(
        parsed[0].endpoint,
        format!("tcp://127.0.0.1:{}", e.events().unwrap().events)
    );
    assert!(parsed[0].replay.is_none());
    let quiet = engine(|_| {}).await;
    assert_eq!(get(quiet.addr, "/kv_event_sources").await.body, "{}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn render_gives_the_token_ids_a_kv_aware_router_asks_for() {
    let e = engine(|_| {}).await;
    let p = prompt(3, 20);
    let r = post(
        e.addr,
        "/v1/completions/render",
        json!({"model": "tiny-llama", "prompt": p, "max_tokens": 3}),
    )
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    let v = r.json();
    assert_eq!(v[0]["token_ids"], json!(p));
    assert!(v[0]["request_id"].is_string());
    let text = post(
        e.addr,
        "/v1/completions/render",
        json!({"prompt": "hop hop", "max_tokens": 1}),
    )
    .await
    .json();
    let tokens = post(e.addr, "/tokenize", json!({"prompt": "hop hop"}))
        .await
        .json();
    assert_eq!(
        text[0]["token_ids"], tokens["tokens"],
        "render and tokenize agree"
    );
    assert_eq!(
        post(e.addr, "/v1/completions/render", json!({"prompt": 5}))
            .await
            .status,
        400
    );
}
