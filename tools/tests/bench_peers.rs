//! `bench-peers` end to end on a small mock pool with our two modes (the peers need Python
//! packages; the harness's figures with them are in docs/performance.md, "Against the peers"):
//! every request answered, the same text from both modes, and KV routing finding more of the
//! engines' caches than round robin; and a run stopped by a signal stops its engines and
//! router with it.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

fn binary(name: &str) -> PathBuf {
    let mut dir = std::env::current_exe().expect("test binary path");
    dir.pop();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(name)
}

#[test]
fn the_harness_runs_our_two_modes_on_one_pool_and_kv_finds_more_cache() {
    let out = tempfile::tempdir().expect("temp dir");
    let mut child = Command::new(binary("bench-peers"))
        .args(["--routers", "prefill-router/round-robin,prefill-router/kv"])
        .args(["--workloads", "shared-prefix", "--loops", "open"])
        .args(["--prefill", "3", "--requests", "60", "--rate", "20"])
        .args(["--out", &out.path().display().to_string()])
        .spawn()
        .expect("bench-peers starts (built with the tests)");
    // Bounded: two routers, 60 requests each at 20/s, engines and routers starting.
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("bench-peers did not finish within 240 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(status.success(), "bench-peers failed: {status}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.path().join("peers.jsonl"))
        .expect("peers.jsonl written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON row"))
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for row in &rows {
        assert_eq!(row["requests"], 60, "{row}");
        assert_eq!(row["failed"], 0, "{row}");
    }
    assert_eq!(
        rows[1]["same_output"], 60,
        "KV routing changed an answer: {}",
        rows[1]
    );
    let hit = |row: &serde_json::Value| {
        row["hit_rate"]
            .as_f64()
            .expect("engines reported a hit rate")
    };
    assert!(
        hit(&rows[1]) > hit(&rows[0]),
        "kv {} vs round robin {}",
        hit(&rows[1]),
        hit(&rows[0])
    );
    assert!(out.path().join("peers.svg").exists());
}

#[test]
fn a_signalled_run_stops_its_engines_and_router() {
    use prefill_router_tools::peers::procs::{alive, tree_pids};
    let out = tempfile::tempdir().expect("temp dir");
    let mut child = Command::new(binary("bench-peers"))
        .args([
            "--routers",
            "prefill-router/kv",
            "--workloads",
            "conversation",
        ])
        .args([
            "--loops",
            "open",
            "--prefill",
            "2",
            "--requests",
            "2000",
            "--rate",
            "2",
        ])
        .args(["--out", &out.path().display().to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("bench-peers starts (built with the tests)");
    let root = child.id();
    // Two prefill engines, the decode engine and the router under it (bounded wait).
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let tree = loop {
        let tree = tree_pids(root);
        if tree.len() > 4 {
            break tree;
        }
        assert!(
            child.try_wait().expect("wait").is_none(),
            "bench-peers ended before its router started"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "no router within 120 s: {tree:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let killed = Command::new("kill")
        .args(["-TERM", &root.to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "bench-peers ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status.code(), Some(130), "{status}");
    let left: Vec<u32> = tree
        .into_iter()
        .filter(|&pid| pid != root && alive(pid))
        .collect();
    assert!(left.is_empty(), "processes outlived the run: {left:?}");
}
