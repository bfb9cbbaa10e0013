//! The store restarting: etcd killed and restarted under live workers and watchers.

use super::*;
use prefill_router::discovery::{EtcdConfig, EtcdDiscovery};
use std::process::{Child, Command, Stdio};

/// An etcd server of our own, on spare loopback ports, killed on drop.
struct OwnEtcd {
    child: Option<Child>,
    data: tempfile::TempDir,
    port: u16,
    peer_port: u16,
}

fn spare_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl OwnEtcd {
    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn launch(&mut self) {
        let client = format!("http://127.0.0.1:{}", self.port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.data.path().join("etcd.log")).unwrap();
        let child = Command::new("etcd")
            .args(["--name", "restart-test", "--data-dir"])
            .arg(self.data.path().join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .arg("--initial-cluster")
            .arg(format!("restart-test={peer}"))
            .args(["--initial-cluster-state", "new"])
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
            .args(["--log-level", "warn", "--logger", "zap"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("cannot start etcd");
        self.child = Some(child);
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill(); // SIGKILL: no graceful shutdown
            let _ = child.wait();
        }
    }

    async fn wait_healthy(&self) {
        let started = Instant::now();
        loop {
            let config = EtcdConfig::new([self.endpoint()]).with_root("health/");
            if let Ok(store) = EtcdDiscovery::connect(config).await {
                if store.list_namespace("probe").await.is_ok() {
                    return;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "own etcd not healthy: {}",
                std::fs::read_to_string(self.data.path().join("etcd.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for OwnEtcd {
    fn drop(&mut self) {
        self.kill();
    }
}

fn etcd_binary_available() -> bool {
    let found = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "the etcd binary is missing in CI: source .ci/etcd.sh in .ci/run"
        );
        eprintln!("NOTICE: no etcd binary; skipping the etcd restart test");
    }
    found
}

async fn register_retrying(
    store: &EtcdDiscovery,
    instance: &Instance,
) -> prefill_router::discovery::Registration {
    let started = Instant::now();
    loop {
        match store
            .register(instance.clone(), card("m", SelectionMode::KV))
            .await
        {
            Ok(registration) => return registration,
            Err(error) => {
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "register: {error}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_killed_and_restarted_resumes_watch_without_loss_or_duplicates() {
    if !etcd_binary_available() {
        return;
    }
    let mut etcd = OwnEtcd {
        child: None,
        data: tempfile::tempdir().unwrap(),
        port: spare_port(),
        peer_port: spare_port(),
    };
    etcd.launch();
    etcd.wait_healthy().await;
    let ttl = Duration::from_secs(4);
    let config = EtcdConfig::new([etcd.endpoint()])
        .with_root("restart/")
        .with_ttl(ttl);
    let worker = EtcdDiscovery::connect(config.clone()).await.unwrap();
    let frontend = EtcdDiscovery::connect(config).await.unwrap();
    let ep = endpoint("ns", "prefill");
    let (a, b, c) = (instance(&ep, 1), instance(&ep, 2), instance(&ep, 3));
    let _ra = register_retrying(&worker, &a).await;
    let _rb = register_retrying(&worker, &b).await;
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut ns_watch = frontend.watch_namespace("ns").await.unwrap();
    let mut view = View::default();
    view.until(&mut watch, &[&a, &b]).await;

    etcd.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    etcd.launch();
    etcd.wait_healthy().await;

    // A worker registering after the restart is seen by the resumed watch ...
    let _rc = register_retrying(&worker, &c).await;
    view.until(&mut watch, &[&a, &b, &c]).await;
    // ... and the workers that lived through the outage were never lost (no removal)
    // nor duplicated (the view rejects a repeated Added).
    assert_eq!(view.removals, 0);
    let k = card("m", SelectionMode::KV);
    let mut ns_view = NsView::default();
    ns_view
        .until(&mut ns_watch, &[(&a, &k), (&b, &k), (&c, &k)])
        .await;
    // Their leases are kept alive across the restart: still there after a full TTL.
    tokio::time::sleep(ttl + ttl / 2).await;
    assert_eq!(
        frontend.list_instances(&ep).await.unwrap(),
        vec![a.clone(), b.clone(), c.clone()]
    );
    assert_quiet(&mut watch).await;
}
