//! API keys (issue #27, "Keys"): `serve --api-key-file` / `PREFILL_ROUTER_API_KEYS_FILE`, as a
//! process: 401 OpenAI bodies without a valid bearer key, every key of the file accepted,
//! probes open, `/metrics` behind the key on request, and no key ever on stderr.

use std::net::SocketAddr;

use super::frontend::*;
use super::{basic_cluster, chat};

/// Two keys sharing a prefix (so a prefix match would be caught), with a comment and blanks.
const KEY_ONE: &str = "sk-test-4f1c9a7e2b";
const KEY_TWO: &str = "sk-test-4f1c9a7e2b-second";
const KEY_FILE: &str =
    "# keys of the test deployment\n\n  sk-test-4f1c9a7e2b  \nsk-test-4f1c9a7e2b-second\n";

fn key_file(cluster: &Cluster, text: &str) -> String {
    let path = cluster.dir.path().join("api-keys");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn with_key(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    authorization: &str,
) -> Response {
    let body = body.map(|b| b.to_string());
    request_with(
        addr,
        method,
        path,
        body.as_deref().map(str::as_bytes),
        &[("Authorization", authorization)],
    )
}

/// A 401 as OpenAI sends it: `invalid_api_key`, `WWW-Authenticate: Bearer`, no key echoed.
fn assert_unauthorized(response: &Response, what: &str) {
    assert_eq!(response.status, 401, "{what}: {response:?}");
    assert_eq!(
        response.header("www-authenticate"),
        Some("Bearer"),
        "{what}: {response:?}"
    );
    let body = response.json();
    let error = &body["error"];
    assert_eq!(error["type"], "invalid_request_error", "{what}: {body}");
    assert_eq!(error["code"], "invalid_api_key", "{what}: {body}");
    assert!(error["param"].is_null(), "{what}: {body}");
    let message = error["message"].as_str().expect("a message");
    assert!(
        !message.is_empty() && !message.contains("sk-"),
        "{what}: {body}"
    );
    assert_eq!(body.as_object().map(|o| o.len()), Some(1), "{body}");
}

fn assert_no_key_in(lines: &[String]) {
    for line in lines {
        assert!(
            !line.contains("4f1c9a7e2b") && !line.contains("wrong-key"),
            "a key was logged: {line}"
        );
    }
}

/// Without a valid `Authorization: Bearer`, every `/v1/*` request (a known route, a wrong
/// method, an unknown path) is a counted 401; either key of the file serves streaming and
/// non-streaming completions; `/health`, `/ready` and (by default) `/metrics` stay open; serve's
/// stderr, at debug level, never shows a key.
#[test]
fn v1_needs_a_valid_bearer_key_and_probes_stay_open() {
    let (cluster, _workers) = basic_cluster();
    let file = key_file(&cluster, KEY_FILE);
    let (serve, addr) =
        cluster.serve_with(&["--api-key-file", &file], &[("RUST_LOG", "debug")], true);
    assert_eq!(serve.wait_event("listening")["api_keys"], 2);
    until("ready", || get(addr, "/ready").status == 200);
    assert_eq!(get(addr, "/health").status, 200);

    let body = chat("hello", 3, false);
    assert_unauthorized(&post(addr, "/v1/chat/completions", &body), "no header");
    for (what, authorization) in [
        ("a wrong key", "Bearer sk-wrong-key"),
        ("a prefix of a key", "Bearer sk-test-4f1c9a7e2"),
        (
            "a key with more after it",
            "Bearer sk-test-4f1c9a7e2b-second-x",
        ),
        ("an empty bearer", "Bearer "),
        ("another scheme", "Basic c2stdGVzdA=="),
        ("the key without a scheme", KEY_ONE),
    ] {
        let r = with_key(
            addr,
            "POST",
            "/v1/chat/completions",
            Some(&body),
            authorization,
        );
        assert_unauthorized(&r, what);
    }
    // Auth comes first: no 404 or 405 tells a client without a key which routes exist.
    assert_unauthorized(&get(addr, "/v1/models"), "GET /v1/models");
    assert_unauthorized(&get(addr, "/v1/chat/completions"), "GET on a POST route");
    assert_unauthorized(&get(addr, "/v1/nothing-here"), "an unknown /v1 path");
    let completion = json_completion();
    assert_unauthorized(&post(addr, "/v1/completions", &completion), "completions");

    for key in [KEY_ONE, KEY_TWO] {
        let bearer = format!("Bearer {key}");
        let r = with_key(addr, "POST", "/v1/chat/completions", Some(&body), &bearer);
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.json()["usage"]["completion_tokens"], 3);
        let stream = chat("hello", 3, true);
        let r = with_key(addr, "POST", "/v1/chat/completions", Some(&stream), &bearer);
        assert_eq!(r.status, 200, "{r:?}");
        let events = r.events();
        assert_eq!(events.len(), 4, "{events:?}");
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let r = with_key(addr, "POST", "/v1/completions", Some(&completion), &bearer);
        assert_eq!(r.status, 200, "{r:?}");
        let r = with_key(addr, "GET", "/v1/models", None, &bearer);
        assert_eq!(r.status, 200, "{r:?}");
        // With a key, the route's own answers come back.
        let r = with_key(addr, "GET", "/v1/nothing-here", None, &bearer);
        assert_eq!(r.status, 404, "{r:?}");
    }
    // The scheme is case-insensitive (RFC 9110).
    let r = with_key(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        &format!("bearer {KEY_TWO}"),
    );
    assert_eq!(r.status, 200, "{r:?}");

    let metrics = get(addr, "/metrics");
    assert_eq!(metrics.status, 200, "/metrics is open by default");
    let count = |route: &str| {
        metrics
            .body
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "prefill_router_http_requests_total{{route=\"{route}\",status=\"401\"}} "
                ))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    assert_eq!(count("chat_completions"), Some(8.0), "{}", metrics.body);
    assert_eq!(count("models"), Some(1.0), "{}", metrics.body);
    assert_eq!(count("other"), Some(1.0), "{}", metrics.body);
    assert_eq!(count("completions"), Some(1.0), "{}", metrics.body);

    let stderr_before_stop = serve.stderr();
    let (status, stdout) = serve.terminate_keeping_output();
    assert!(status.success(), "{status:?}");
    assert_no_key_in(&stdout);
    assert_no_key_in(&stderr_before_stop);
    assert!(
        stderr_before_stop
            .iter()
            .any(|l| l.contains("2 API key(s) loaded")),
        "the count is logged: {stderr_before_stop:?}"
    );
}

fn json_completion() -> serde_json::Value {
    serde_json::json!({"model": "m", "prompt": "hi", "max_tokens": 2})
}

/// The key file named by `PREFILL_ROUTER_API_KEYS_FILE`, with `--metrics-need-key`: `/metrics`
/// answers 401 without a key and 200 with one; the probes stay open.
#[test]
fn metrics_need_key_puts_metrics_behind_the_key_from_the_environment() {
    let (cluster, _workers) = basic_cluster();
    let file = key_file(&cluster, KEY_FILE);
    let (serve, addr) = cluster.serve_with(
        &["--metrics-need-key"],
        &[("PREFILL_ROUTER_API_KEYS_FILE", &file)],
        true,
    );
    until("ready", || get(addr, "/ready").status == 200);
    assert_eq!(get(addr, "/health").status, 200);
    assert_unauthorized(&get(addr, "/metrics"), "/metrics without a key");
    assert_unauthorized(
        &with_key(addr, "GET", "/metrics", None, "Bearer sk-wrong-key"),
        "/metrics with a wrong key",
    );
    assert_unauthorized(&get(addr, "/v1/models"), "the env file's keys apply to /v1");
    let metrics = with_key(addr, "GET", "/metrics", None, &format!("Bearer {KEY_TWO}"));
    assert_eq!(metrics.status, 200, "{metrics:?}");
    assert!(
        metrics
            .body
            .contains(r#"prefill_router_http_requests_total{route="metrics",status="401"} 2"#),
        "{}",
        metrics.body
    );
    let (status, _) = serve.terminate_keeping_output();
    assert!(status.success());
}

/// A key file serve cannot use stops it before it listens, with a non-zero exit and a message
/// naming the file and the line, never the key.
#[test]
fn a_bad_key_file_stops_serve_without_printing_a_key() {
    let cluster = Cluster::new();
    let two_on_a_line = key_file(
        &cluster,
        "# two keys pasted on one line\nsk-test-4f1c9a7e2b sk-wrong-key\n",
    );
    let only_comments = cluster.dir.path().join("no-keys");
    std::fs::write(&only_comments, "# nothing yet\n\n").unwrap();
    let only_comments = only_comments.display().to_string();
    let missing = cluster.dir.path().join("absent").display().to_string();
    for (file, says) in [
        (two_on_a_line.as_str(), "line 2"),
        (only_comments.as_str(), "no API key"),
        (missing.as_str(), "absent"),
    ] {
        let args = cluster.serve_args(&["--api-key-file", file]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let serve = Proc::spawn_with("serve", &args, &[], true);
        let stderr = {
            let proc = &serve;
            until("serve reports the key file", || {
                proc.stderr().iter().any(|l| l.contains("serve failed"))
            });
            proc.stderr()
        };
        let status = serve.wait_exit();
        assert!(!status.success(), "{file}: {status:?}");
        assert_no_key_in(&stderr);
        let failed = stderr
            .iter()
            .find(|l| l.contains("serve failed"))
            .unwrap()
            .clone();
        assert!(failed.contains(says), "{failed}");
        assert!(failed.contains(file), "names the file: {failed}");
    }
}
