//! The three-member etcd cluster `.ci/etcd-cluster.sh` started: find its leader, kill, stop,
//! continue and restart members, and heal it between cases.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prefill_router::discovery::{Discovery, EtcdConfig, EtcdDiscovery};

/// Bound on the cluster becoming healthy again (a restart replays its WAL).
const HEAL: Duration = Duration::from_secs(30);

/// The cluster described by `PREFILL_ETCD_CLUSTER` and `PREFILL_ETCD_CLUSTER_DIR`.
pub struct Cluster {
    /// Client URLs, member 0 first.
    pub urls: Vec<String>,
    dir: PathBuf,
}

impl Cluster {
    /// The cluster, or `None` (with a notice) outside CI when it is not running; in CI a
    /// missing cluster fails the test.
    pub fn from_env() -> Option<Cluster> {
        let urls = std::env::var("PREFILL_ETCD_CLUSTER").unwrap_or_default();
        let dir = std::env::var("PREFILL_ETCD_CLUSTER_DIR").unwrap_or_default();
        if urls.is_empty() || dir.is_empty() {
            assert!(
                std::env::var_os("CI").is_none(),
                "PREFILL_ETCD_CLUSTER is not set in CI: source .ci/etcd-cluster.sh in .ci/run"
            );
            eprintln!("NOTICE: PREFILL_ETCD_CLUSTER unset; skipping the etcd cluster fault suite");
            return None;
        }
        let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
        assert_eq!(urls.len(), 3, "a three-member cluster");
        Some(Cluster {
            urls,
            dir: PathBuf::from(dir),
        })
    }

    /// Member `i`'s current pid.
    pub fn pid(&self, i: usize) -> i32 {
        let text = std::fs::read_to_string(self.dir.join(format!("pid-{i}"))).unwrap();
        text.trim().parse().unwrap()
    }

    /// Send `signal` to member `i`.
    pub fn signal(&self, i: usize, signal: i32) {
        // SAFETY: kill(2) with a pid we started; no memory is shared.
        unsafe {
            libc::kill(self.pid(i), signal);
        }
    }

    /// Whether member `i`'s process is alive (a zombie is not).
    pub fn alive(&self, i: usize) -> bool {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid(i)));
        match stat {
            // The state follows the parenthesised command name.
            Ok(stat) => stat
                .rsplit_once(')')
                .map(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
                .unwrap_or(false),
            Err(_) => false,
        }
    }

    /// Start member `i` again (same name, data dir and ports).
    pub fn restart(&self, i: usize) {
        let status = std::process::Command::new("bash")
            .arg(self.dir.join(format!("start-{i}.sh")))
            .status()
            .unwrap();
        assert!(status.success(), "restarting etcd member {i}");
    }

    /// SIGKILL member `i` and wait until it is gone.
    pub fn kill(&self, i: usize) {
        self.signal(i, libc::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.alive(i) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Member `i`'s view: (its member id, the leader it follows), if it answers in time.
    async fn member_status(&self, i: usize) -> Option<(u64, u64)> {
        let options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_millis(500))
            .with_timeout(Duration::from_millis(500));
        let attempt = async {
            let mut client = etcd_client::Client::connect([self.urls[i].as_str()], Some(options))
                .await
                .ok()?;
            let status = client.status().await.ok()?;
            let member = status.header()?.member_id();
            Some((member, status.leader()))
        };
        tokio::time::timeout(Duration::from_secs(1), attempt)
            .await
            .ok()
            .flatten()
    }

    /// The member that is leader now, as the live members agree (`None` while electing).
    pub async fn leader(&self) -> Option<usize> {
        let mut statuses = Vec::new();
        for i in 0..3 {
            if self.alive(i) {
                statuses.push((i, self.member_status(i).await));
            }
        }
        let leader_id = statuses.iter().find_map(|(_, s)| s.map(|(_, l)| l))?;
        if leader_id == 0 {
            return None;
        }
        statuses
            .iter()
            .find(|(_, s)| s.is_some_and(|(m, _)| m == leader_id))
            .map(|(i, _)| *i)
    }

    /// Wait until a leader is elected; the time it took.
    pub async fn await_leader(&self, bound: Duration) -> Duration {
        let start = Instant::now();
        loop {
            if self.leader().await.is_some() {
                return start.elapsed();
            }
            assert!(start.elapsed() < bound, "no etcd leader within {bound:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Bring every member back (continue the stopped, restart the dead) and wait until all
    /// three answer and agree on a leader.
    pub async fn heal(&self) {
        for i in 0..3 {
            if self.alive(i) {
                self.signal(i, libc::SIGCONT);
            } else {
                self.restart(i);
            }
        }
        let start = Instant::now();
        loop {
            let mut leaders = Vec::new();
            for i in 0..3 {
                leaders.push(self.member_status(i).await.map(|(_, l)| l));
            }
            if leaders
                .iter()
                .all(|l| l.is_some_and(|l| l != 0) && *l == leaders[0])
            {
                return;
            }
            assert!(
                start.elapsed() < HEAL,
                "etcd cluster not healed within {HEAL:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A discovery client on all three members, under `root`, with lease `ttl`.
    pub async fn discovery(&self, root: &str, ttl: Duration) -> Arc<dyn Discovery> {
        let mut config = EtcdConfig::new(self.urls.clone())
            .with_root(root)
            .with_ttl(ttl);
        // A member that is gone should not hold a request for the default 5 s.
        config.request_timeout = Duration::from_secs(1);
        config.retry_interval = Duration::from_millis(100);
        Arc::new(EtcdDiscovery::connect(config).await.unwrap())
    }
}
