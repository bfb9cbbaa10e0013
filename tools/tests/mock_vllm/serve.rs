//! `prefill-router serve --engine vllm --router-mode kv --check-events` (the binary) in front of
//! two mock prefill engines publishing KV events and one mock decode engine.

use std::net::SocketAddr;
use std::sync::Arc;

use prefill_router_tools::vllm_mock::KvRole;
use serde_json::json;

use super::frontend::Proc;
use super::{engine, get, metric, post};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_kv_routes_a_repeated_prompt_back_to_the_engine_that_cached_it() {
    let mut prefill = Vec::new();
    for _ in 0..2 {
        prefill.push(
            engine(|c| {
                c.kv_role = KvRole::Producer;
                c.kv_events_port = Some(0);
                c.kv_replay_port = Some(0);
            })
            .await,
        );
    }
    let decode = engine(|c| c.kv_role = KvRole::Consumer).await;
    let urls: Vec<String> = prefill
        .iter()
        .map(|e| format!("http://{}", e.addr))
        .collect();
    let d_url = format!("http://{}", decode.addr);
    let args = vec![
        "serve".to_owned(),
        "--engine".into(),
        "vllm".into(),
        "--prefill-url".into(),
        urls.join(","),
        "--decode-url".into(),
        d_url,
        "--router-mode".into(),
        "kv".into(),
        "--check-events".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--request-timeout-ms".into(),
        "10000".into(),
    ];
    let serve = Arc::new(
        tokio::task::spawn_blocking(move || {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            Proc::spawn("serve", &a)
        })
        .await
        .unwrap(),
    );
    let s = Arc::clone(&serve);
    let (checked, listening) = tokio::task::spawn_blocking(move || {
        let listening = s.wait_event("listening");
        (s.count_events("events_checked"), listening)
    })
    .await
    .unwrap();
    let addr: SocketAddr = listening["addr"].as_str().unwrap().parse().unwrap();
    assert_eq!(checked, 2, "--check-events passed for both prefill engines");
    tokio::task::spawn_blocking(move || {
        super::frontend::until("serve ready", || {
            super::frontend::get(addr, "/ready").status == 200
        })
    })
    .await
    .unwrap();

    let served = |addr| async move {
        metric(
            &get(addr, "/metrics").await.body,
            "vllm:prompt_tokens_total",
            "",
        )
    };
    for family in 0..4u32 {
        let prompt: Vec<u32> = (0..160)
            .map(|i| 4 + (family * 131 + i * 17) % 1000)
            .collect();
        let body =
            json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0});
        let before = [served(prefill[0].addr).await, served(prefill[1].addr).await];
        let first = post(addr, "/v1/completions", body.clone()).await;
        assert_eq!(first.status, 200, "{first:?}");
        let after = [served(prefill[0].addr).await, served(prefill[1].addr).await];
        let owner = usize::from(after[1] > before[1]);
        // Its events reach the router, then the same prompt goes back to it.
        let hits_before = metric(
            &get(prefill[owner].addr, "/metrics").await.body,
            "vllm:prefix_cache_hits_total",
            "",
        );
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let again = post(addr, "/v1/completions", body.clone()).await;
        assert_eq!(again.status, 200);
        let hits_after = metric(
            &get(prefill[owner].addr, "/metrics").await.body,
            "vllm:prefix_cache_hits_total",
            "",
        );
        assert_eq!(
            hits_after - hits_before,
            128.0,
            "family {family}: 4 of 5 blocks hit on engine {owner}"
        );
        // The answer is the decode engine's deterministic output for the prompt.
        let direct = post(decode.addr, "/v1/completions", body).await.json();
        assert_eq!(
            first.json()["choices"][0]["text"],
            direct["choices"][0]["text"]
        );
        assert_eq!(
            again.json()["choices"][0]["text"],
            direct["choices"][0]["text"]
        );
    }
    drop(serve);
}
