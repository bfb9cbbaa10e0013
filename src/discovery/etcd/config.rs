//! How to reach etcd, where the records live, and lease timing.

use std::time::Duration;

/// How to reach etcd, where the records live, and lease timing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Key prefix of every record (isolates deployments sharing one etcd).
    pub root: String,
    /// Lease TTL (whole seconds, at least 1; etcd may raise short TTLs).
    pub ttl: Duration,
    /// How often a registration renews its lease.
    pub keepalive_interval: Duration,
    /// Bound on connecting and on each unary request.
    pub request_timeout: Duration,
    /// Pause before retrying after etcd failed or went away.
    pub retry_interval: Duration,
}

impl EtcdConfig {
    /// Defaults: root `prefill-router/v1/instances/`, 10 s TTL (Dynamo's), keep-alive every
    /// third of it, 5 s request timeout, 250 ms retry pause.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        let ttl = Duration::from_secs(10);
        EtcdConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            root: "prefill-router/v1/instances/".to_owned(),
            ttl,
            keepalive_interval: ttl / 3,
            request_timeout: Duration::from_secs(5),
            retry_interval: Duration::from_millis(250),
        }
    }

    /// The same with another TTL; keep-alive every third of it.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self.keepalive_interval = ttl / 3;
        self
    }

    /// The same under another key root.
    pub fn with_root(mut self, root: impl Into<String>) -> Self {
        self.root = root.into();
        self
    }

    pub(super) fn ttl_secs(&self) -> i64 {
        i64::try_from(self.ttl.as_secs_f64().ceil() as u64)
            .unwrap_or(i64::MAX)
            .max(1)
    }
}
