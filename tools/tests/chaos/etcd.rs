//! A three-member etcd cluster of the chaos run's own: free loopback ports, throwaway data
//! dirs, etcd's default heartbeat and election timeout (100 ms / 1 s, what a deployment runs),
//! members as child processes so a panic anywhere still kills them (`Drop`).
//!
//! Not the cluster `.ci/etcd-cluster.sh` exports: the fault suite and the member-list test
//! share that one, and this run loses a member of its cluster for good.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Bound on the cluster agreeing on a leader again after a member returns (a restart replays
/// its WAL; an election takes about a second with the default timeout).
const HEAL: Duration = Duration::from_secs(30);

/// One member: its ports and, while it runs, its process.
struct Member {
    client: u16,
    peer: u16,
    child: Option<Child>,
    /// SIGSTOPped and not continued yet.
    stopped: bool,
}

/// The cluster; every member is killed when it is dropped.
pub struct Members {
    dir: tempfile::TempDir,
    members: Vec<Member>,
}

/// A port nothing listens on now (the kernel's pick; released at once, so a small race with
/// other processes, harmless on a test box).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Members {
    /// Start three members and wait until they agree on a leader.
    pub fn start() -> Members {
        let mut ports: Vec<u16> = Vec::new();
        while ports.len() < 6 {
            let p = free_port();
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
        let members = (0..3)
            .map(|i| Member {
                client: ports[2 * i],
                peer: ports[2 * i + 1],
                child: None,
                stopped: false,
            })
            .collect();
        let mut cluster = Members {
            dir: tempfile::tempdir().unwrap(),
            members,
        };
        for i in 0..3 {
            cluster.spawn(i);
        }
        cluster.await_healthy();
        cluster
    }

    /// Client URLs (`http://127.0.0.1:PORT`), member 0 first.
    pub fn urls(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client))
            .collect()
    }

    fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("m{i}"))
    }

    /// Start member `i` (again): same name, ports and data dir; `existing` once the dir exists
    /// so a restarted member rejoins with its WAL.
    fn spawn(&mut self, i: usize) {
        let initial: Vec<String> = self
            .members
            .iter()
            .enumerate()
            .map(|(j, m)| format!("m{j}=http://127.0.0.1:{}", m.peer))
            .collect();
        let data = self.data_dir(i);
        let state = if data.exists() { "existing" } else { "new" };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("m{i}.log")))
            .unwrap();
        let m = &self.members[i];
        let client = format!("http://127.0.0.1:{}", m.client);
        let peer = format!("http://127.0.0.1:{}", m.peer);
        let child = Command::new("etcd")
            .args(["--name", &format!("m{i}")])
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial.join(",")])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", "prefill-chaos"])
            .args(["--log-level", "warn", "--logger", "zap"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("etcd member {i} starts (is etcd on PATH?): {e}"));
        self.members[i].child = Some(child);
        self.members[i].stopped = false;
    }

    fn signal(&self, i: usize, signal: i32) {
        let child = self.members[i].child.as_ref().expect("a running member");
        let pid = i32::try_from(child.id()).unwrap();
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(pid, signal);
        }
    }

    /// SIGKILL member `i` and reap it (its data dir stays, for [`restart`](Self::restart)).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.members[i].stopped = false;
    }

    /// Start a killed member again with its data dir, and wait until the cluster is whole.
    pub fn restart(&mut self, i: usize) {
        assert!(self.members[i].child.is_none(), "member {i} is running");
        self.spawn(i);
        self.await_healthy();
    }

    pub fn stop(&mut self, i: usize) {
        self.signal(i, libc::SIGSTOP);
        self.members[i].stopped = true;
    }

    /// SIGCONT member `i` and wait until the running members agree on a leader again.
    pub fn resume(&mut self, i: usize) {
        self.signal(i, libc::SIGCONT);
        self.members[i].stopped = false;
        self.await_healthy();
    }

    /// Members running (killed ones are not).
    pub fn running(&self) -> Vec<usize> {
        (0..self.members.len())
            .filter(|&i| self.members[i].child.is_some())
            .collect()
    }

    /// Member `i`'s view, asked with etcdctl: (its member id, the leader it follows; 0 while
    /// electing), if it answers within a second.
    fn status(&self, i: usize) -> Option<(u64, u64)> {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args([
                &format!("--endpoints=http://127.0.0.1:{}", self.members[i].client),
                "--command-timeout=1s",
                "--dial-timeout=1s",
                "endpoint",
                "status",
                "-w",
                "json",
            ])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        let status = &v[0]["Status"];
        Some((
            status["header"]["member_id"].as_u64()?,
            status["leader"].as_u64()?,
        ))
    }

    /// The member that leads now, as the running members agree (`None` while electing or
    /// when they disagree).
    pub fn leader(&self) -> Option<usize> {
        let statuses: Vec<(usize, (u64, u64))> = self
            .running()
            .into_iter()
            .filter(|&i| !self.members[i].stopped)
            .map(|i| Some((i, self.status(i)?)))
            .collect::<Option<_>>()?;
        let leader = statuses.first()?.1 .1;
        if leader == 0 || statuses.iter().any(|(_, (_, l))| *l != leader) {
            return None;
        }
        statuses
            .iter()
            .find(|(_, (id, _))| *id == leader)
            .map(|(i, _)| *i)
    }

    /// Wait (bounded by HEAL) until every running member answers and they agree on a leader.
    pub fn await_healthy(&self) -> Duration {
        let start = Instant::now();
        while self.leader().is_none() {
            assert!(
                start.elapsed() < HEAL,
                "etcd cluster not healthy within {HEAL:?}; logs in {}",
                self.dir.path().display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        start.elapsed()
    }
}

impl Drop for Members {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            // SIGKILL works on a stopped process too.
            self.kill(i);
        }
    }
}
