//! Parsing `worker`'s arguments into [`WorkerOptions`].

use std::net::SocketAddr;
use std::time::Duration;

use crate::args::{CliError, Flags};
use crate::store::{StoreSpec, DEFAULT_ETCD_ROOT};
use crate::tls::TlsFlags;

use super::{Role, WorkerOptions, DEFAULT_DRAIN_TIMEOUT, DEFAULT_UNREADY_DELAY, USAGE};

impl WorkerOptions {
    /// Parse the arguments after `worker`.
    pub fn parse(args: &[String]) -> Result<Self, CliError> {
        let mut role = None;
        let mut discovery = None;
        let mut namespace = None;
        let mut health_listen = None;
        let mut unready_delay = None;
        let mut options = WorkerOptions {
            role: Role::Prefill,
            discovery: StoreSpec::File(std::path::PathBuf::new()),
            namespace: String::new(),
            card: None,
            id: None,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            health_listen: None,
            unready_delay: DEFAULT_UNREADY_DELAY,
            block_size: 16,
            block_cost: Duration::from_micros(500),
            token_interval: Duration::from_micros(2000),
            ttl: Duration::from_secs(10),
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            etcd_root: DEFAULT_ETCD_ROOT.to_owned(),
            print_requests: false,
            kv_events: true,
            load_reports: true,
            session_affinity_ttl_secs: None,
            tls: TlsFlags::default(),
        };
        let mut flags = Flags::new(args);
        while let Some(flag) = flags.next_flag() {
            match flag {
                "--role" => {
                    role = Some(match flags.value(flag)? {
                        "prefill" => Role::Prefill,
                        "decode" => Role::Decode,
                        other => {
                            return Err(CliError::Usage(format!(
                                "--role: expected prefill or decode, got `{other}`"
                            )))
                        }
                    })
                }
                "--discovery" => discovery = Some(StoreSpec::parse(flag, flags.value(flag)?)?),
                "--namespace" => namespace = Some(flags.value(flag)?.to_owned()),
                "--card" => options.card = Some(flags.value(flag)?.into()),
                "--id" => options.id = Some(flags.parsed(flag)?),
                "--listen" => options.listen = flags.parsed(flag)?,
                "--health-listen" => health_listen = Some(flags.parsed::<SocketAddr>(flag)?),
                "--unready-delay-ms" => {
                    unready_delay = Some(Duration::from_millis(flags.parsed(flag)?))
                }
                "--block-size" => options.block_size = flags.parsed(flag)?,
                "--block-cost-us" => {
                    options.block_cost = Duration::from_micros(flags.parsed(flag)?)
                }
                "--token-interval-us" => {
                    options.token_interval = Duration::from_micros(flags.parsed(flag)?)
                }
                "--ttl-ms" => options.ttl = Duration::from_millis(flags.parsed(flag)?),
                "--drain-timeout-ms" => {
                    options.drain_timeout = Duration::from_millis(flags.parsed(flag)?)
                }
                "--etcd-root" => options.etcd_root = flags.value(flag)?.to_owned(),
                "--print-requests" => options.print_requests = true,
                "--no-kv-events" => options.kv_events = false,
                "--no-load-reports" => options.load_reports = false,
                "--session-affinity-ttl-secs" => {
                    options.session_affinity_ttl_secs = Some(flags.parsed(flag)?)
                }
                "--help" | "-h" => return Err(CliError::Help(USAGE.to_owned())),
                other if options.tls.take(other, &mut flags, false)? => {}
                other => return Err(CliError::Usage(format!("unknown worker option `{other}`"))),
            }
        }
        options.role = role.ok_or_else(|| CliError::Usage("worker needs --role".into()))?;
        options.tls.check_server()?;
        options.discovery =
            discovery.ok_or_else(|| CliError::Usage("worker needs --discovery".into()))?;
        options.namespace =
            namespace.ok_or_else(|| CliError::Usage("worker needs --namespace".into()))?;
        if options.namespace.is_empty() || options.namespace.contains('/') {
            return Err(CliError::Usage(
                "--namespace must be non-empty, without `/`".into(),
            ));
        }
        if options.ttl < Duration::from_millis(300) {
            return Err(CliError::Usage("--ttl-ms must be at least 300".into()));
        }
        if options.session_affinity_ttl_secs.is_some() && options.role != Role::Prefill {
            return Err(CliError::Usage(
                "--session-affinity-ttl-secs is for prefill workers (their card carries the routing)"
                    .into(),
            ));
        }
        // On Kubernetes the kubelet's readiness probe is the registration, so the probe's
        // endpoint is required there; elsewhere the worker holds a lease in the store and a
        // probe endpoint would only be a second, unused truth.
        if options.on_kubernetes() {
            let health = health_listen.ok_or_else(|| {
                CliError::Usage(
                    "a worker on k8s:// needs --health-listen ADDR: its readiness probe is how \
                     frontends find it (docs/kubernetes.md)"
                        .into(),
                )
            })?;
            if health.port() != 0 && health == options.listen {
                return Err(CliError::Usage(
                    "--health-listen and --listen must be different addresses".into(),
                ));
            }
            options.health_listen = Some(health);
            options.unready_delay = unready_delay.unwrap_or(DEFAULT_UNREADY_DELAY);
        } else if health_listen.is_some() || unready_delay.is_some() {
            return Err(CliError::Usage(
                "--health-listen and --unready-delay-ms are for --discovery k8s:// (elsewhere \
                 the worker deregisters from the store)"
                    .into(),
            ));
        }
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn a_worker_publishes_load_reports_unless_told_not_to() {
        let base = "--role prefill --discovery file:///tmp/x --namespace ns";
        let on = WorkerOptions::parse(&args(base));
        assert!(matches!(
            on,
            Ok(WorkerOptions {
                load_reports: true,
                ..
            })
        ));
        let off = WorkerOptions::parse(&args(&format!("{base} --no-load-reports")));
        assert!(matches!(
            off,
            Ok(WorkerOptions {
                load_reports: false,
                ..
            })
        ));
    }

    #[test]
    fn a_prefill_worker_publishes_kv_events_unless_told_not_to() {
        let base = "--role prefill --discovery file:///tmp/x --namespace ns";
        let on = WorkerOptions::parse(&args(base));
        assert!(matches!(
            on,
            Ok(WorkerOptions {
                kv_events: true,
                ..
            })
        ));
        let off = WorkerOptions::parse(&args(&format!("{base} --no-kv-events")));
        assert!(matches!(
            off,
            Ok(WorkerOptions {
                kv_events: false,
                ..
            })
        ));
    }

    #[test]
    fn worker_needs_role_discovery_and_namespace() {
        for line in [
            "--discovery file:///tmp/x --namespace ns",
            "--role prefill --namespace ns",
            "--role prefill --discovery file:///tmp/x",
            "--role both --discovery file:///tmp/x --namespace ns",
            "--role decode --discovery http://x --namespace ns",
            "--role decode --discovery file:///tmp/x --namespace ns --tls-cert c.pem",
            "--role decode --discovery file:///tmp/x --namespace ns --tls-client-ca ca.pem",
            "--role decode --discovery file:///tmp/x --namespace ns --tls-ca ca.pem",
        ] {
            assert!(
                matches!(WorkerOptions::parse(&args(line)), Err(CliError::Usage(_))),
                "{line}"
            );
        }
        let ok = WorkerOptions::parse(&args(
            "--role decode --discovery file:///tmp/x --namespace ns --id 7 --listen 127.0.0.1:0",
        ))
        .ok()
        .unwrap();
        assert_eq!((ok.role, ok.id), (Role::Decode, Some(7)));
    }

    #[test]
    fn a_k8s_worker_is_accepted_with_its_health_listen_address() {
        let parsed = WorkerOptions::parse(&args(
            "--role prefill --discovery k8s://llm-serving --namespace dyn \
             --listen 0.0.0.0:9000 --health-listen 0.0.0.0:8080 --unready-delay-ms 300",
        ))
        .ok()
        .unwrap();
        assert!(parsed.on_kubernetes());
        assert_eq!(parsed.health_listen, Some("0.0.0.0:8080".parse().unwrap()));
        assert_eq!(parsed.unready_delay, Duration::from_millis(300));
        let default = WorkerOptions::parse(&args(
            "--role decode --discovery k8s://llm-serving --namespace dyn --health-listen 127.0.0.1:0",
        ))
        .ok()
        .unwrap();
        assert_eq!(default.unready_delay, DEFAULT_UNREADY_DELAY);
        assert!(USAGE.contains("--health-listen") && USAGE.contains("prefill-router/card"));
    }

    #[test]
    fn health_listen_is_required_on_k8s_and_refused_elsewhere() {
        for line in [
            // k8s without a probe endpoint.
            "--role prefill --discovery k8s://llm-serving --namespace dyn",
            // The probe endpoint on the request plane's address.
            "--role prefill --discovery k8s://llm-serving --namespace dyn \
             --listen 0.0.0.0:9000 --health-listen 0.0.0.0:9000",
            // Not k8s: no probe endpoint, no unready delay.
            "--role prefill --discovery file:///tmp/x --namespace ns --health-listen 127.0.0.1:0",
            "--role prefill --discovery file:///tmp/x --namespace ns --unready-delay-ms 5",
            "--role prefill --discovery k8s://Bad --namespace ns --health-listen 127.0.0.1:0",
            "--role prefill --discovery k8s://x --namespace ns --health-listen nowhere",
        ] {
            assert!(
                matches!(WorkerOptions::parse(&args(line)), Err(CliError::Usage(_))),
                "{line}"
            );
        }
    }
}
