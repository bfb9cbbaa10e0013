//! `--discovery file://DIR | etcd://HOST:PORT[,HOST:PORT...] | k8s://NAMESPACE[?kubeconfig=PATH|?url=URL]`,
//! shared by `serve`, `worker` and `demo`.

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
    /// The members of one etcd cluster, each `host:port`, in the order given (calls go to the
    /// first until it fails, then move on: see `EtcdDiscovery`).
    Etcd(Vec<String>),
    /// The workers' EndpointSlices and pods in one Kubernetes namespace (feature `kubernetes`,
    /// docs/kubernetes.md): read with the pod's service account, a kubeconfig, or a plain URL.
    Kubernetes {
        /// The Kubernetes namespace.
        namespace: String,
        /// How to reach the API server.
        source: K8sSource,
    },
}

/// How `k8s://` reaches the API server. The library's `ClusterSource` says the same, but it
/// exists only with feature `kubernetes`, and the CLI parses `k8s://` without it too (to say
/// the binary lacks the feature rather than that the scheme is unknown).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum K8sSource {
    /// The pod's service account (`k8s://NAMESPACE`).
    InCluster,
    /// A kubeconfig file at its current context (`k8s://NAMESPACE?kubeconfig=PATH`).
    Kubeconfig(PathBuf),
    /// A plain URL without credentials, e.g. `kubectl proxy` (`k8s://NAMESPACE?url=URL`).
    Url(String),
}

/// Why a `--discovery` value was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreSpecError {
    /// Neither `file://`, `etcd://` nor `k8s://`.
    #[error(
        "expected `file://DIR`, `etcd://HOST:PORT[,HOST:PORT...]` or `k8s://NAMESPACE`, got `{0}`"
    )]
    UnknownScheme(String),
    /// `k8s://` without a valid namespace name (a DNS label: lowercase letters, digits and
    /// `-`, at most 63, starting and ending alphanumeric).
    #[error("`k8s://` needs a Kubernetes namespace name, got `{0}`")]
    BadK8sNamespace(String),
    /// `k8s://NS?...` with an option other than one `kubeconfig=PATH` or `url=URL`.
    #[error("`k8s://NAMESPACE` takes one option, `?kubeconfig=PATH` or `?url=URL`, got `{0}`")]
    BadK8sOption(String),
    /// `file://` without a directory.
    #[error("`file://` needs a directory")]
    EmptyDirectory,
    /// `etcd://` without a member.
    #[error("`etcd://` needs at least one member, HOST:PORT")]
    NoMembers,
    /// An empty entry in the member list (`a:1,,b:2`, or a trailing comma).
    #[error("etcd member {position} of the list is empty")]
    EmptyMember {
        /// Its position in the list, from 1.
        position: usize,
    },
    /// An entry that is not `HOST:PORT`.
    #[error("etcd member `{member}` is not HOST:PORT: {reason}")]
    BadMember {
        /// The entry as given.
        member: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The same member twice.
    #[error("etcd member `{0}` is listed twice")]
    DuplicateMember(String),
}

/// Parse the part after `k8s://`: `NAMESPACE`, `NAMESPACE?kubeconfig=PATH` or
/// `NAMESPACE?url=URL`.
fn parse_k8s(rest: &str) -> Result<StoreSpec, StoreSpecError> {
    let (namespace, option) = match rest.split_once('?') {
        Some((ns, option)) => (ns, Some(option)),
        None => (rest, None),
    };
    let label = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let valid = !namespace.is_empty()
        && namespace.len() <= 63
        && namespace.bytes().all(|c| label(c) || c == b'-')
        && namespace.bytes().next().is_some_and(label)
        && namespace.bytes().last().is_some_and(label);
    if !valid {
        return Err(StoreSpecError::BadK8sNamespace(namespace.to_owned()));
    }
    let source = match option {
        None => K8sSource::InCluster,
        Some(option) => match option.split_once('=') {
            Some(("kubeconfig", path)) if !path.is_empty() => {
                K8sSource::Kubeconfig(PathBuf::from(path))
            }
            Some(("url", url)) if url.starts_with("http://") || url.starts_with("https://") => {
                K8sSource::Url(url.to_owned())
            }
            _ => return Err(StoreSpecError::BadK8sOption(option.to_owned())),
        },
    };
    Ok(StoreSpec::Kubernetes {
        namespace: namespace.to_owned(),
        source,
    })
}

/// Parse an etcd member list, `HOST:PORT[,HOST:PORT...]` (the part after `etcd://`): each
/// member a host name, an IPv4 address or a bracketed IPv6 address, and a port.
pub fn parse_etcd_members(list: &str) -> Result<Vec<String>, StoreSpecError> {
    if list.trim().is_empty() {
        return Err(StoreSpecError::NoMembers);
    }
    let mut members: Vec<String> = Vec::new();
    for (i, member) in list.split(',').enumerate() {
        let member = member.trim();
        if member.is_empty() {
            return Err(StoreSpecError::EmptyMember { position: i + 1 });
        }
        let bad = |reason| StoreSpecError::BadMember {
            member: member.to_owned(),
            reason,
        };
        if member.contains("://") {
            return Err(bad(
                "give the scheme once, before the list (`etcd://a:1,b:2`)",
            ));
        }
        let (host, port) = member.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("the port is not a number"));
        }
        match port.parse::<u16>() {
            Ok(0) | Err(_) => return Err(bad("the port is not in 1..=65535")),
            Ok(_) => {}
        }
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if bare.is_empty() {
            return Err(bad("no host"));
        }
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':');
        if !bare.chars().all(allowed) || (bare.contains(':') && bare == host) {
            return Err(bad(
                "the host is not a name or an address (IPv6 goes in brackets)",
            ));
        }
        if members.iter().any(|m| m == member) {
            return Err(StoreSpecError::DuplicateMember(member.to_owned()));
        }
        members.push(member.to_owned());
    }
    Ok(members)
}

impl StoreSpec {
    /// Parse `file://DIR`, `etcd://HOST:PORT[,HOST:PORT...]` or `k8s://NAMESPACE[?...]`.
    pub fn parse_spec(spec: &str) -> Result<Self, StoreSpecError> {
        if let Some(dir) = spec.strip_prefix("file://") {
            if dir.is_empty() {
                return Err(StoreSpecError::EmptyDirectory);
            }
            return Ok(StoreSpec::File(PathBuf::from(dir)));
        }
        if let Some(list) = spec.strip_prefix("etcd://") {
            return parse_etcd_members(list).map(StoreSpec::Etcd);
        }
        if let Some(rest) = spec.strip_prefix("k8s://") {
            return parse_k8s(rest);
        }
        Err(StoreSpecError::UnknownScheme(spec.to_owned()))
    }

    /// [`parse_spec`](Self::parse_spec) for the option `flag`, as a usage error.
    pub fn parse(flag: &str, spec: &str) -> Result<Self, CliError> {
        Self::parse_spec(spec).map_err(|e| CliError::Usage(format!("{flag}: {e}")))
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
            StoreSpec::Etcd(members) => {
                use prefill_router::discovery::{EtcdConfig, EtcdDiscovery};
                let config = EtcdConfig::new(members.iter().map(|m| format!("http://{m}")))
                    .with_ttl(ttl)
                    .with_root(root);
                let discovery = EtcdDiscovery::connect(config)
                    .await
                    .map_err(|e| format!("connecting to etcd at {}: {e}", members.join(",")))?;
                Ok(Arc::new(discovery))
            }
            #[cfg(not(feature = "etcd"))]
            StoreSpec::Etcd(_) => Err(
                "this binary was built without the `etcd` feature (cargo build -p prefill-router-tools --features etcd)"
                    .into(),
            ),
            #[cfg(feature = "kubernetes")]
            StoreSpec::Kubernetes { namespace, source } => {
                use prefill_router::discovery::{
                    ClusterSource, KubernetesConfig, KubernetesDiscovery,
                };
                let source = match source {
                    K8sSource::InCluster => ClusterSource::InCluster,
                    K8sSource::Kubeconfig(path) => ClusterSource::Kubeconfig(path.clone()),
                    K8sSource::Url(url) => ClusterSource::Url(url.clone()),
                };
                let discovery = KubernetesDiscovery::connect(KubernetesConfig::new(namespace, source))
                    .await
                    .map_err(|e| format!("connecting to Kubernetes (namespace {namespace}): {e}"))?;
                Ok(Arc::new(discovery))
            }
            #[cfg(not(feature = "kubernetes"))]
            StoreSpec::Kubernetes { .. } => Err(
                "this binary was built without the `kubernetes` feature (cargo build -p prefill-router-tools --features kubernetes)"
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_etcd_spec_is_a_member_list() {
        assert_eq!(
            StoreSpec::parse_spec("etcd://a:1,b:2,c:3"),
            Ok(StoreSpec::Etcd(vec![
                "a:1".into(),
                "b:2".into(),
                "c:3".into()
            ]))
        );
        assert_eq!(
            StoreSpec::parse_spec("etcd://127.0.0.1:2379"),
            Ok(StoreSpec::Etcd(vec!["127.0.0.1:2379".into()]))
        );
        assert_eq!(
            StoreSpec::parse_spec("etcd://[::1]:2379, etcd-1.internal:2379"),
            Ok(StoreSpec::Etcd(vec![
                "[::1]:2379".into(),
                "etcd-1.internal:2379".into()
            ]))
        );
        assert_eq!(
            StoreSpec::parse_spec("file:///tmp/x"),
            Ok(StoreSpec::File("/tmp/x".into()))
        );
    }

    #[test]
    fn a_k8s_spec_is_a_namespace_and_a_source() {
        let k8s = |namespace: &str, source| StoreSpec::Kubernetes {
            namespace: namespace.into(),
            source,
        };
        assert_eq!(
            StoreSpec::parse_spec("k8s://prod"),
            Ok(k8s("prod", K8sSource::InCluster))
        );
        assert_eq!(
            StoreSpec::parse_spec("k8s://llm-serving?kubeconfig=/home/me/.kube/config"),
            Ok(k8s(
                "llm-serving",
                K8sSource::Kubeconfig("/home/me/.kube/config".into())
            ))
        );
        assert_eq!(
            StoreSpec::parse_spec("k8s://p1?url=http://127.0.0.1:8001"),
            Ok(k8s("p1", K8sSource::Url("http://127.0.0.1:8001".into())))
        );
        let longest = "a".repeat(63);
        assert!(StoreSpec::parse_spec(&format!("k8s://{longest}")).is_ok());
        assert!(StoreSpec::parse_spec(&format!("k8s://{longest}a")).is_err());
    }

    #[test]
    fn bad_specs_get_typed_errors() {
        use StoreSpecError::*;
        type Expect = fn(&StoreSpecError) -> bool;
        let cases: [(&str, Expect); 21] = [
            ("etcd://", |e| *e == NoMembers),
            ("etcd://a:1,,b:2", |e| *e == EmptyMember { position: 2 }),
            ("etcd://a:1,", |e| *e == EmptyMember { position: 2 }),
            ("etcd://a", |e| matches!(e, BadMember { .. })),
            ("etcd://a:", |e| matches!(e, BadMember { .. })),
            ("etcd://a:x", |e| matches!(e, BadMember { .. })),
            ("etcd://a:70000", |e| matches!(e, BadMember { .. })),
            ("etcd://:2379", |e| matches!(e, BadMember { .. })),
            ("etcd://a:1,etcd://b:2", |e| matches!(e, BadMember { .. })),
            ("etcd://::1:2379", |e| matches!(e, BadMember { .. })),
            ("etcd://a:1,a:1", |e| *e == DuplicateMember("a:1".into())),
            ("http://a:1", |e| matches!(e, UnknownScheme(_))),
            ("k8s://", |e| matches!(e, BadK8sNamespace(_))),
            ("k8s://Prod", |e| matches!(e, BadK8sNamespace(_))),
            ("k8s://-prod", |e| matches!(e, BadK8sNamespace(_))),
            ("k8s://prod-", |e| matches!(e, BadK8sNamespace(_))),
            ("k8s://a_b", |e| matches!(e, BadK8sNamespace(_))),
            ("k8s://prod?kubeconfig=", |e| matches!(e, BadK8sOption(_))),
            ("k8s://prod?url=ftp://x", |e| matches!(e, BadK8sOption(_))),
            ("k8s://prod?token=x", |e| matches!(e, BadK8sOption(_))),
            ("k8s://prod?", |e| matches!(e, BadK8sOption(_))),
        ];
        for (spec, expected) in cases {
            let error = StoreSpec::parse_spec(spec).expect_err(spec);
            assert!(expected(&error), "{spec}: {error:?}");
            assert!(!error.to_string().is_empty());
        }
        assert_eq!(StoreSpec::parse_spec("file://"), Err(EmptyDirectory));
    }
}
