//! `prefill-router worker --discovery k8s://` as a process (feature `kubernetes`): it serves
//! its probes on `--health-listen`, takes its id from `$POD_UID` as frontends do, and on SIGTERM
//! answers 503 to `/ready` for `--unready-delay-ms` (while `/live` stays 200), then drains and
//! exits 0 with a `stopped` line. It never calls an API server, so none is needed here.
//! Loopback only; every wait is bounded.

#[path = "frontend/mod.rs"]
mod frontend;

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use frontend::{get, Proc, WAIT};
use prefill_router::discovery::instance_id_of;

/// How long the worker answers 503 before draining: long enough for a loaded machine to
/// observe it, short enough for a quick test.
const UNREADY_DELAY: Duration = Duration::from_millis(1000);

#[test]
fn a_k8s_worker_withdraws_readiness_on_sigterm_then_drains_and_exits() {
    let uid = "6b7c1f0e-2d4a-4e58-b0c3-9f1a2e3d4c5b";
    let delay = UNREADY_DELAY.as_millis().to_string();
    let worker = Proc::spawn_with(
        "k8s worker",
        &[
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
            &delay,
            "--drain-timeout-ms",
            "2000",
        ],
        &[("POD_UID", uid)],
        false,
    );
    let ready = worker.wait_event("ready");
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
    assert_eq!(get(health, "/ready").status, 200);
    assert_eq!(get(health, "/live").status, 200);
    assert_eq!(get(health, "/metrics").status, 404);
    // The request plane serves (a connection is accepted).
    drop(TcpStream::connect_timeout(&plane, WAIT).expect("the request plane listens"));

    let signalled = Instant::now();
    worker.signal(libc::SIGTERM);
    // /ready turns 503 within the unready delay, while /live stays 200.
    let deadline = signalled + WAIT;
    loop {
        match get(health, "/ready").status {
            503 => break,
            200 => {
                assert!(Instant::now() < deadline, "/ready never turned 503");
                std::thread::sleep(Duration::from_millis(10));
            }
            other => panic!("/ready answered {other}"),
        }
    }
    if signalled.elapsed() < UNREADY_DELAY {
        assert_eq!(get(health, "/live").status, 200, "alive while withdrawing");
    }

    let stopped = worker.wait_event("stopped");
    assert!(
        signalled.elapsed() >= UNREADY_DELAY,
        "the drain waits for the unready delay ({:?})",
        signalled.elapsed()
    );
    assert_eq!(stopped["deregistered"], true, "readiness withdrawn");
    assert_eq!(stopped["discovery"], "kubernetes");
    assert_eq!(stopped["drained"], true);
    assert_eq!(stopped["id"], instance_id_of(uid));
    let status = worker.wait_exit();
    assert!(status.success(), "exit 0 after the drain: {status:?}");
}
