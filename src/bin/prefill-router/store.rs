//! `--discovery file://DIR | etcd://HOST:PORT`, shared by `serve` and `worker`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prefill_router::discovery::{Discovery, FileConfig, FileDiscovery};

use crate::args::CliError;

/// Where the processes of one deployment meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreSpec {
    /// A directory shared by the processes of one host.
    File(PathBuf),
    /// An etcd server at `host:port`.
    Etcd(String),
}

impl StoreSpec {
    /// Parse `file://DIR` or `etcd://HOST:PORT`.
    pub fn parse(flag: &str, spec: &str) -> Result<Self, CliError> {
        if let Some(dir) = spec.strip_prefix("file://") {
            if !dir.is_empty() {
                return Ok(StoreSpec::File(PathBuf::from(dir)));
            }
        } else if let Some(addr) = spec.strip_prefix("etcd://") {
            if !addr.is_empty() {
                return Ok(StoreSpec::Etcd(addr.to_owned()));
            }
        }
        Err(CliError::Usage(format!(
            "{flag}: expected `file://DIR` or `etcd://HOST:PORT`, got `{spec}`"
        )))
    }

    /// Open the store with lease TTL `ttl` (etcd: under the key root `root`).
    pub async fn open(
        &self,
        ttl: Duration,
        #[cfg_attr(not(feature = "etcd"), allow(unused_variables))] root: &str,
    ) -> Result<Arc<dyn Discovery>, String> {
        match self {
            StoreSpec::File(dir) => {
                std::fs::create_dir_all(dir)
                    .map_err(|e| format!("creating {}: {e}", dir.display()))?;
                Ok(Arc::new(FileDiscovery::new(FileConfig::with_ttl(dir, ttl))))
            }
            #[cfg(feature = "etcd")]
            StoreSpec::Etcd(addr) => {
                use prefill_router::discovery::{EtcdConfig, EtcdDiscovery};
                let config = EtcdConfig::new([format!("http://{addr}")])
                    .with_ttl(ttl)
                    .with_root(root);
                let discovery = EtcdDiscovery::connect(config)
                    .await
                    .map_err(|e| format!("connecting to etcd at {addr}: {e}"))?;
                Ok(Arc::new(discovery))
            }
            #[cfg(not(feature = "etcd"))]
            StoreSpec::Etcd(_) => Err(
                "this binary was built without the `etcd` feature (cargo build --features cli,etcd)"
                    .into(),
            ),
        }
    }
}

/// The default etcd key root of `serve` and `worker`.
pub const DEFAULT_ETCD_ROOT: &str = "prefill-router/v1/instances/";

/// Wait for SIGTERM or Ctrl-C (SIGINT).
pub async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; waiting for Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
