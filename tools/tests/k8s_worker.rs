//! `prefill-router worker --discovery k8s://` as a process (feature `kubernetes`): it serves
//! its probes on `--health-listen`, takes its id from `$POD_UID` as frontends do, and on SIGTERM
//! answers 503 to `/ready` for `--unready-delay-ms` (while `/live` stays 200), then drains and
//! exits 0 with a `stopped` line. It never calls an API server, so none is needed here.
//! Loopback only; every wait is bounded.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use prefill_router::discovery::instance_id_of;

/// Bound on anything the test waits for (a busy 2-core box).
const WAIT: Duration = Duration::from_secs(20);

/// How long the worker answers 503 before draining: long enough for a loaded machine to
/// observe it, short enough for a quick test.
const UNREADY_DELAY: Duration = Duration::from_millis(1000);

/// The status code of `GET path` on the worker's health endpoint.
fn get(addr: SocketAddr, path: &str) -> u16 {
    let mut stream = TcpStream::connect_timeout(&addr, WAIT).expect("connect");
    stream.set_read_timeout(Some(WAIT)).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: pod\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("a response");
    response
        .get(9..12)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"))
}

/// The next JSON line on `lines` with this `event`.
fn wait_event(lines: &mpsc::Receiver<String>, event: &str) -> serde_json::Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no `{event}` line within {WAIT:?}"));
        if let Ok(value) = serde_json::from_str::<serde_json::Value>(&line) {
            if value["event"] == event {
                return value;
            }
        }
    }
}

#[test]
fn a_k8s_worker_withdraws_readiness_on_sigterm_then_drains_and_exits() {
    let uid = "6b7c1f0e-2d4a-4e58-b0c3-9f1a2e3d4c5b";
    let mut child = Command::new(env!("CARGO_BIN_EXE_prefill-router"))
        .args([
            "worker",
            "--role",
            "prefill",
            "--discovery",
            "k8s://serving",
            "--namespace",
            "dyn",
            "--listen",
            "127.0.0.1:0",
            "--health-listen",
            "127.0.0.1:0",
            "--unready-delay-ms",
            &UNREADY_DELAY.as_millis().to_string(),
            "--drain-timeout-ms",
            "2000",
        ])
        .env("POD_UID", uid)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the worker");
    let stdout = child.stdout.take().unwrap();
    let (send, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if send.send(line).is_err() {
                break;
            }
        }
    });

    let ready = wait_event(&lines, "ready");
    assert_eq!(ready["discovery"], "kubernetes");
    assert_eq!(ready["endpoint"], "dyn/prefill/generate");
    assert_eq!(
        ready["id"],
        instance_id_of(uid),
        "named as frontends name the pod"
    );
    let health: SocketAddr = ready["health_addr"].as_str().unwrap().parse().unwrap();
    let plane: SocketAddr = ready["addr"].as_str().unwrap().parse().unwrap();
    assert_ne!(health, plane);
    assert_eq!(get(health, "/ready"), 200);
    assert_eq!(get(health, "/live"), 200);
    assert_eq!(get(health, "/metrics"), 404);
    // The request plane serves (a connection is accepted).
    drop(TcpStream::connect_timeout(&plane, WAIT).expect("the request plane listens"));

    let pid = i32::try_from(child.id()).unwrap();
    let signalled = Instant::now();
    // SAFETY: signalling our own child process by its pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    // /ready turns 503 within the unready delay, while /live stays 200.
    let deadline = signalled + WAIT;
    loop {
        match get(health, "/ready") {
            503 => break,
            200 => {
                assert!(Instant::now() < deadline, "/ready never turned 503");
                std::thread::sleep(Duration::from_millis(10));
            }
            other => panic!("/ready answered {other}"),
        }
    }
    if signalled.elapsed() < UNREADY_DELAY {
        assert_eq!(get(health, "/live"), 200, "alive while withdrawing");
    }

    let stopped = wait_event(&lines, "stopped");
    assert!(
        signalled.elapsed() >= UNREADY_DELAY,
        "the drain waits for the unready delay ({:?})",
        signalled.elapsed()
    );
    assert_eq!(stopped["deregistered"], true, "readiness withdrawn");
    assert_eq!(stopped["discovery"], "kubernetes");
    assert_eq!(stopped["drained"], true);
    assert_eq!(stopped["id"], instance_id_of(uid));
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the worker did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit 0 after the drain: {status:?}");
}
