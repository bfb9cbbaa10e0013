//! Configuration of [`super::KubernetesDiscovery`].

use std::path::PathBuf;
use std::time::Duration;

/// Where the API server and its credentials come from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClusterSource {
    /// The pod's service account (`KUBERNETES_SERVICE_HOST`, the mounted token and CA).
    InCluster,
    /// A kubeconfig file, at its current context.
    Kubeconfig(PathBuf),
    /// A plain URL without credentials: `kubectl proxy`, or a test's API server.
    Url(String),
}

/// How to reach the cluster and how to read it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct KubernetesConfig {
    /// The Kubernetes namespace the workers' EndpointSlices and pods are in.
    pub namespace: String,
    /// The API server and credentials.
    pub source: ClusterSource,
    /// The bound on every API call (a watch's opening included; a watch's stream is bounded by
    /// its server-side timeout instead).
    pub request_timeout: Duration,
    /// The pause before listing again after a failed call or a broken watch.
    pub retry_interval: Duration,
    /// The name of the slice port that carries the request plane (a slice with one port uses
    /// that one whatever its name).
    pub port_name: String,
    /// Objects per page of a list (`limit`, then `continue` tokens).
    pub page_size: u32,
    /// The server-side timeout of one watch request (whole seconds, 1 to 290: kube's limit);
    /// the watch is reopened from its last resource version when it ends.
    pub watch_timeout: Duration,
}

impl KubernetesConfig {
    /// Defaults for `namespace` read through `source`: 5 s calls, 1 s retries, port
    /// `request-plane`, pages of 500, watches of 290 s.
    pub fn new(namespace: impl Into<String>, source: ClusterSource) -> Self {
        KubernetesConfig {
            namespace: namespace.into(),
            source,
            request_timeout: Duration::from_secs(5),
            retry_interval: Duration::from_secs(1),
            port_name: "request-plane".into(),
            page_size: 500,
            watch_timeout: Duration::from_secs(290),
        }
    }

    /// Set the bound on every API call.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Set the pause before listing again after a failure.
    pub fn with_retry_interval(mut self, interval: Duration) -> Self {
        self.retry_interval = interval;
        self
    }

    /// Set the objects per page of a list (at least 1).
    pub fn with_page_size(mut self, page_size: u32) -> Self {
        self.page_size = page_size.max(1);
        self
    }

    /// Set the server-side timeout of one watch request.
    pub fn with_watch_timeout(mut self, timeout: Duration) -> Self {
        self.watch_timeout = timeout;
        self
    }
}
