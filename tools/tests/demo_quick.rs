//! `prefill-router demo --quick` runs the whole story and exits 0 (no request lost, none routed
//! outside its binding's admission set).

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn demo_quick_exits_zero_with_every_request_accounted_for() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_prefill-router"))
        .args(["demo", "--quick", "--sessions", "6"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("demo starts");
    // Read stdout on a thread so a full pipe can never stall the demo.
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
        out
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("demo --quick did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = reader.join().unwrap();
    assert!(status.success(), "demo failed ({status}):\n{out}");
    assert!(out.contains("demo: OK"), "{out}");
    assert!(out.contains("lost requests: 0"), "{out}");
    assert!(out.contains("comparison: kv"), "{out}");
}

#[test]
fn demo_rejects_unknown_options_with_usage_exit_code() {
    let status = Command::new(env!("CARGO_BIN_EXE_prefill-router"))
        .args(["demo", "--bogus"])
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(2));
}
