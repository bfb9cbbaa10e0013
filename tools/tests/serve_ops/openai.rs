//! The OpenAI surface in operation: a disconnect before the first token, a wrong method (405
//! with `Allow`), `stream_options.include_usage`, token prompts and the `max_tokens` range.

use super::*;

/// A client that gives up before the first token (a slow prefill) is counted as a disconnect
/// and as a request with status 499, and the worker sees the cancel.
#[test]
fn a_disconnect_before_the_first_token_is_counted() {
    let cluster = Cluster::new();
    // One second per uncached block: the prefill of a long prompt takes seconds.
    let prefill = cluster.worker(
        "prefill",
        1,
        &["--block-cost-us", "1000000", "--print-requests"],
    );
    let _d = cluster.worker("decode", DECODE, &[]);
    let (_serve, addr) = cluster.serve(&[]);
    until("active", || {
        get(addr, "/ready").json()["lifecycle"] == "active"
    });
    let body = chat(&"a long prompt of many words ".repeat(20), 4, true).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let stream = stalled(addr, head.as_bytes());
    prefill.wait_event("request");
    drop(stream);
    prefill.wait_event("cancelled");
    until("the disconnect counted", || {
        metric(addr, "prefill_router_http_client_disconnects_total") == Some(1.0)
    });
    assert_eq!(
        metric(
            addr,
            r#"prefill_router_http_requests_total{route="chat_completions",status="499"}"#
        ),
        Some(1.0)
    );
    until("in flight back to 0", || in_flight(addr) == Some(0.0));
}

/// A wrong method on a known route: 405 with an OpenAI body and `Allow`, counted; OPTIONS is
/// answered 204 with `Allow`.
#[test]
fn a_wrong_method_is_an_openai_405_with_allow() {
    let (cluster, _workers) = basic_cluster();
    let (_serve, addr) = cluster.serve(&[]);
    for (method, path, allow) in [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("POST", "/health", "GET"),
        ("DELETE", "/v1/models", "GET"),
    ] {
        let response = request(addr, method, path, None);
        assert_eq!(response.status, 405, "{method} {path}: {response:?}");
        assert!(
            response.header("allow").is_some_and(|a| a.contains(allow)),
            "{method} {path}: {response:?}"
        );
        let error = response.json();
        assert_eq!(error["error"]["code"], "method_not_allowed", "{error}");
        assert_eq!(error["error"]["type"], "invalid_request_error");
        assert!(error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(method)));
    }
    let options = request(addr, "OPTIONS", "/v1/chat/completions", None);
    assert_eq!(options.status, 204, "{options:?}");
    assert!(options.header("allow").is_some_and(|a| a.contains("POST")));
    assert_eq!(
        metric(
            addr,
            r#"prefill_router_http_requests_total{route="chat_completions",status="405"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            addr,
            r#"prefill_router_http_requests_total{route="health",status="405"}"#
        ),
        Some(1.0)
    );
}

/// `stream_options.include_usage` adds a final chunk with `usage` and empty `choices`; token
/// prompts (a list, or a list holding one list) are accepted; several prompts are a clear 400;
/// `max_tokens` out of range is `invalid_max_tokens` with a human message.
#[test]
fn openai_details_usage_chunk_token_prompts_and_max_tokens_range() {
    let (cluster, _workers) = basic_cluster();
    let (_serve, addr) = cluster.serve(&[]);
    until("ready", || get(addr, "/ready").status == 200);

    for path in ["/v1/chat/completions", "/v1/completions"] {
        let mut body = if path.contains("chat") {
            chat("count with me", 3, true)
        } else {
            json!({"model": "m", "prompt": "count with me", "max_tokens": 3, "stream": true})
        };
        body["stream_options"] = json!({"include_usage": true});
        let response = post(addr, path, &body);
        assert_eq!(response.status, 200, "{response:?}");
        let events = response.events();
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
        let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        assert_eq!(
            chunks.len(),
            4,
            "3 token chunks and a usage chunk: {chunks:?}"
        );
        let usage = &chunks[3];
        assert_eq!(usage["choices"], json!([]), "{usage}");
        assert_eq!(usage["usage"]["completion_tokens"], 3, "{usage}");
        let prompt = usage["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(prompt > 0);
        assert_eq!(usage["usage"]["total_tokens"], prompt + 3);
        for chunk in &chunks[..3] {
            assert!(chunk["usage"].is_null(), "{chunk}");
        }
        // Without the option there is no usage chunk.
        body["stream_options"] = json!({"include_usage": false});
        let plain = post(addr, path, &body).events();
        assert_eq!(plain.len(), 4, "{plain:?}");
    }

    for prompt in [json!([[1, 2, 3]]), json!([1, 2, 3])] {
        let r = post(
            addr,
            "/v1/completions",
            &json!({"model": "m", "prompt": prompt, "max_tokens": 2}),
        );
        assert_eq!(r.status, 200, "{prompt}: {r:?}");
        assert_eq!(r.json()["usage"]["prompt_tokens"], 3);
    }
    let several = post(
        addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": [[1, 2], [3, 4]], "max_tokens": 2}),
    );
    assert_eq!(several.status, 400);
    assert_eq!(several.json()["error"]["code"], "unsupported_prompt");
    let bad_token = post(
        addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": [1, -2], "max_tokens": 2}),
    );
    assert_eq!(bad_token.status, 400);
    assert_eq!(bad_token.json()["error"]["code"], "invalid_prompt");

    for (path, field, value) in [
        ("/v1/completions", "max_tokens", json!(5_000_000_000u64)),
        ("/v1/completions", "max_tokens", json!(-1)),
        ("/v1/completions", "max_tokens", json!(2.5)),
        (
            "/v1/chat/completions",
            "max_completion_tokens",
            json!(1u64 << 40),
        ),
        ("/v1/chat/completions", "max_tokens", json!("ten")),
    ] {
        let mut body = if path.contains("chat") {
            chat("hi", 1, false)
        } else {
            json!({"model": "m", "prompt": "hi"})
        };
        body.as_object_mut().unwrap().remove("max_tokens");
        body[field] = value.clone();
        let r = post(addr, path, &body);
        assert_eq!(r.status, 400, "{field}={value}: {r:?}");
        let error = r.json();
        assert_eq!(error["error"]["code"], "invalid_max_tokens", "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{message}");
        assert!(!message.contains("u32"), "no Rust type names: {message}");
    }
}
