//! `prefill-router register` and `serve --engine` as processes against the stub engine, on a
//! file store.

use std::time::{Duration, Instant};

use prefill_router::advert::{EngineProtocol, ModelCard, SelectionMode};
use prefill_router::discovery::{Discovery, EndpointId, FileConfig, FileDiscovery, InstanceId};

use crate::frontend::{Proc, WAIT};
use crate::stub::{Reply, StubEngine};

/// The cards registered in the file store at `dir` for `endpoint`.
fn cards_in(dir: &std::path::Path, endpoint: &EndpointId) -> Vec<(InstanceId, ModelCard)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let store = FileDiscovery::new(FileConfig::new(dir));
        store.list_cards(endpoint).await.unwrap()
    })
}

/// Wait (bounded) until `check` holds.
fn until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !check() {
        assert!(Instant::now() < deadline, "{what} within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_sidecar_registers_withdraws_and_leaves_first_on_sigterm() {
    let stub = StubEngine::start("stub-llm", 32);
    let dir = tempfile::tempdir().unwrap();
    let store = format!("file://{}", dir.path().display());
    let url = stub.url();
    let mut sidecar = Proc::spawn(
        "register",
        &[
            "register",
            "--engine",
            "vllm",
            "--role",
            "prefill",
            "--url",
            &url,
            "--discovery",
            &store,
            "--namespace",
            "ns",
            "--id",
            "7",
            "--probe-interval-ms",
            "100",
            "--failures",
            "2",
            "--drain-ms",
            "1500",
        ],
    );
    let endpoint = EndpointId::new("ns", "prefill", "generate");
    let registered = sidecar.wait_event("registered");
    assert_eq!(registered["model"], "stub-llm");
    assert_eq!(registered["block_size"], 32);
    assert_eq!(registered["protocol"], "vllm");
    assert_eq!(registered["router_mode"], "round-robin");
    assert_eq!(registered["id"], 7);
    let cards = cards_in(dir.path(), &endpoint);
    assert_eq!(cards.len(), 1, "{cards:?}");
    let (id, card) = &cards[0];
    assert_eq!(*id, 7);
    assert_eq!(card.name, "stub-llm");
    assert_eq!(card.kv_cache_block_size, 32);
    assert_eq!(
        card.engine.as_ref().map(|e| e.protocol),
        Some(EngineProtocol::Vllm)
    );
    assert_eq!(
        card.router_config.as_ref().map(|r| r.router_mode),
        Some(SelectionMode::RoundRobin)
    );

    // Unhealthy: withdrawn, and gone from the store.
    stub.set("/health", Reply::Status(503));
    let withdrawn = sidecar.wait_event("withdrawn");
    assert_eq!(withdrawn["reason"], "unhealthy");
    assert_eq!(withdrawn["failures"], 2);
    assert!(cards_in(dir.path(), &endpoint).is_empty());

    // Back: registered again.
    stub.set("/health", Reply::Status(200));
    until("registered again", || {
        sidecar.count_events("registered") == 2
    });
    assert_eq!(cards_in(dir.path(), &endpoint).len(), 1);

    // SIGTERM: out of the store first, while the sidecar still waits for the drain.
    let signalled = Instant::now();
    sidecar.signal(libc::SIGTERM);
    until("deregistered on SIGTERM", || {
        cards_in(dir.path(), &endpoint).is_empty()
    });
    assert!(
        !sidecar.has_exited(),
        "the record is gone before the process exits (it drains for 1.5 s)"
    );
    assert_eq!(sidecar.count_events("stopped"), 0);
    sidecar.wait_event_where("withdrawn", |e| e["reason"] == "stopping");
    let stopped = sidecar.wait_event("stopped");
    assert_eq!(stopped["withdrawn"], true);
    let status = sidecar.wait_exit();
    assert!(status.success(), "{status:?}");
    assert!(
        signalled.elapsed() >= Duration::from_millis(1500),
        "the drain was waited for"
    );
}

#[test]
fn an_engine_that_never_answers_is_never_registered_and_the_sidecar_still_stops() {
    let stub = StubEngine::start("stub-llm", 32);
    stub.set("/health", Reply::Silent);
    let dir = tempfile::tempdir().unwrap();
    let store = format!("file://{}", dir.path().display());
    let url = stub.url();
    let mut sidecar = Proc::spawn(
        "register",
        &[
            "register",
            "--engine",
            "vllm",
            "--role",
            "decode",
            "--url",
            &url,
            "--discovery",
            &store,
            "--namespace",
            "ns",
            "--drain-ms",
            "100",
        ],
    );
    until("probed", || stub.hits("/health") >= 1);
    let signalled = Instant::now();
    sidecar.signal(libc::SIGTERM);
    let stopped = sidecar.wait_event("stopped");
    assert_eq!(
        stopped["id"],
        stub.addr().port(),
        "the id defaults to the port"
    );
    assert_eq!(sidecar.count_events("registered"), 0);
    until("exited", || sidecar.has_exited());
    assert!(
        signalled.elapsed() < Duration::from_secs(2),
        "a probe in flight does not hold up the stop"
    );
    assert!(sidecar.wait_exit().success());
    assert!(cards_in(dir.path(), &EndpointId::new("ns", "decode", "generate")).is_empty());
}

/// Run the binary with `args` to its exit (bounded): the status and stderr.
fn run_to_exit(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut proc = Proc::spawn_with("cli", args, &[], true);
    until("the CLI exits", || proc.has_exited());
    // The reader thread catches up with the last lines.
    std::thread::sleep(Duration::from_millis(100));
    let stderr = proc.stderr().join("\n");
    (proc.wait_exit(), stderr)
}

#[test]
fn bad_register_and_serve_engine_flags_are_usage_errors() {
    let register = |extra: &[&str]| {
        let mut args = vec!["register"];
        args.extend_from_slice(extra);
        run_to_exit(&args)
    };
    let base = [
        "--role",
        "prefill",
        "--url",
        "http://127.0.0.1:1",
        "--discovery",
        "file:///tmp/unused-by-usage-errors",
        "--namespace",
        "ns",
    ];
    let with = |engine: &str, more: &[&'static str]| {
        let mut args: Vec<String> = vec!["--engine".into(), engine.into()];
        args.extend(base.iter().map(|s| s.to_string()));
        args.extend(more.iter().map(|s| s.to_string()));
        args
    };
    for (args, says) in [
        (with("sglang", &[]), "unknown engine protocol"),
        (base.iter().map(|s| s.to_string()).collect(), "--engine"),
        (with("vllm", &["--discovery", "k8s://prod"]), "k8s:// yet"),
        (with("vllm", &["--url", "https://127.0.0.1:1"]), "https"),
        (with("vllm", &["--url", "http://127.0.0.1:1/v1"]), "path"),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (status, stderr) = register(&args);
        assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    for (args, says) in [
        (
            &[
                "serve",
                "--prefill-url",
                "http://127.0.0.1:1",
                "--decode-url",
                "http://127.0.0.1:2",
            ][..],
            "need --engine",
        ),
        (
            &[
                "serve",
                "--engine",
                "vllm",
                "--prefill-url",
                "http://127.0.0.1:1",
            ][..],
            "--engine needs --decode-url",
        ),
        (
            &[
                "serve",
                "--engine",
                "tgi",
                "--decode-url",
                "http://127.0.0.1:2",
            ][..],
            "unknown engine protocol",
        ),
    ] {
        let (status, stderr) = run_to_exit(args);
        assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

#[test]
fn serve_with_static_engines_follows_their_health() {
    let prefill = StubEngine::start("stub-llm", 32);
    let decode = StubEngine::start("stub-llm", 32);
    let (p, d) = (prefill.url(), decode.url());
    let serve = Proc::spawn_with(
        "serve",
        &[
            "serve",
            "--engine",
            "vllm",
            "--prefill-url",
            &p,
            "--decode-url",
            &d,
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
        true,
    );
    serve.wait_event("listening");
    let said = |text: &str| serve.stderr().iter().any(|line| line.contains(text));
    let registered = |url: &str, role: &str| format!("engine {url} ({role}) registered");
    until("both engines registered", || {
        said(&registered(&p, "prefill")) && said(&registered(&d, "decode"))
    });
    assert!(said("model stub-llm, block size 32"));
    // The prefill engine stops answering: it leaves the set (three probes, a second apart),
    // then comes back.
    prefill.set("/health", Reply::Status(503));
    until("the prefill engine withdrawn", || {
        said(&format!("engine {p} (prefill) withdrawn"))
    });
    prefill.set("/health", Reply::Status(200));
    until("the prefill engine back", || {
        serve
            .stderr()
            .iter()
            .filter(|line| line.contains(&registered(&p, "prefill")))
            .count()
            == 2
    });
    let (status, _) = serve.terminate_keeping_output();
    assert!(status.success(), "{status:?}");
}
