//! The killed worker: this test binary, re-invoked.

use super::*;

pub(crate) const CHILD_BACKEND: &str = "PREFILL_CHILD_BACKEND";
pub(crate) const CHILD_LOCATION: &str = "PREFILL_CHILD_LOCATION";
pub(crate) const CHILD_ROOT: &str = "PREFILL_CHILD_ROOT";
pub(crate) const CHILD_TTL_MS: &str = "PREFILL_CHILD_TTL_MS";
pub(crate) const CHILD_INSTANCE: &str = "PREFILL_CHILD_INSTANCE";

/// Kills the child on every path out of the parent (including a failed assertion).
pub(crate) struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) async fn kill_child_worker(
    backend: &str,
    location: &str,
    root: &str,
    ttl: Duration,
    instance: &Instance,
    observer: &dyn Discovery,
) {
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_worker_entry",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_BACKEND, backend)
        .env(CHILD_LOCATION, location)
        .env(CHILD_ROOT, root)
        .env(CHILD_TTL_MS, ttl.as_millis().to_string())
        .env(CHILD_INSTANCE, serde_json::to_string(instance).unwrap())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut child = ChildGuard(child);
    let started = Instant::now();
    while !observer
        .list_instances(&instance.endpoint)
        .await
        .unwrap()
        .contains(instance)
    {
        if let Ok(Some(status)) = child.0.try_wait() {
            panic!("child worker exited early: {status}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "child never registered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    outlives_ttl_while_alive(observer, instance, ttl).await;
    // SIGKILL: no destructor, no deregistration, no last keep-alive.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
}

/// A live worker's record survives well past its TTL: keep-alive works.
pub(crate) async fn outlives_ttl_while_alive(
    observer: &dyn Discovery,
    instance: &Instance,
    ttl: Duration,
) {
    tokio::time::sleep(ttl + ttl / 2).await;
    assert!(
        observer
            .list_instances(&instance.endpoint)
            .await
            .unwrap()
            .contains(instance),
        "a live worker's record expired: keep-alive is not working"
    );
}
