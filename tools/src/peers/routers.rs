//! The routers put in front of the pool, each in its KV-aware and round-robin modes with its
//! documented P/D flags: ours (`prefill-router serve`), the SGLang gateway (`smg`, PyPI 1.13.0)
//! and vLLM's router (`vllm-router`, PyPI 0.1.17).

use std::path::{Path, PathBuf};

/// Which router.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Peer {
    /// `prefill-router serve --engine vllm`.
    Ours,
    /// `smg launch --backend vllm --pd-disaggregation`.
    Smg,
    /// `vllm-router --vllm-pd-disaggregation --kv-connector nixl`.
    VllmRouter,
}

impl Peer {
    /// The router's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Peer::Ours => "prefill-router",
            Peer::Smg => "smg",
            Peer::VllmRouter => "vllm-router",
        }
    }
}

/// One router in one mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RouterSpec {
    /// Which router.
    pub peer: Peer,
    /// Its prefill policy, as the router names it.
    pub policy: &'static str,
}

impl RouterSpec {
    /// Every router and mode the harness knows, in report order.
    pub const ALL: [RouterSpec; 7] = [
        RouterSpec {
            peer: Peer::Ours,
            policy: "kv",
        },
        RouterSpec {
            peer: Peer::Ours,
            policy: "round-robin",
        },
        RouterSpec {
            peer: Peer::Smg,
            policy: "cache_aware",
        },
        RouterSpec {
            peer: Peer::Smg,
            policy: "round_robin",
        },
        RouterSpec {
            peer: Peer::VllmRouter,
            policy: "kv_aware",
        },
        RouterSpec {
            peer: Peer::VllmRouter,
            policy: "cache_aware",
        },
        RouterSpec {
            peer: Peer::VllmRouter,
            policy: "round_robin",
        },
    ];

    /// `router/policy`, the name on the command line and in reports.
    pub fn label(self) -> String {
        format!("{}/{}", self.peer.name(), self.policy)
    }

    /// The router named `label` (see [`label`](Self::label)).
    pub fn parse(label: &str) -> Option<Self> {
        RouterSpec::ALL.into_iter().find(|r| r.label() == label)
    }

    /// Whether this mode routes by the prompt's prefix (the rest balance load blind).
    pub fn kv_aware(self) -> bool {
        !self.policy.contains("round")
    }
}

/// Where the pool is, as a router needs it.
#[derive(Clone, Debug)]
pub struct PoolAddrs {
    /// Prefill engines, `http://HOST:PORT`.
    pub prefill: Vec<String>,
    /// Their KV event publishers, `tcp://HOST:PORT`, one per prefill engine (same order).
    pub events: Vec<String>,
    /// Decode engines, `http://HOST:PORT`.
    pub decode: Vec<String>,
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// The model folder (tokenizer) the engines use, if any.
    pub tokenizer: Option<PathBuf>,
}

/// Where the router binaries are.
#[derive(Clone, Debug)]
pub struct Binaries {
    /// Our `prefill-router`.
    pub ours: PathBuf,
    /// The virtualenv `bin/` holding `smg` and `vllm-router`.
    pub peers_bin: PathBuf,
}

impl Binaries {
    /// The program and arguments that start `spec` on `port` (loopback) in front of `pool`.
    /// `metrics_port` is a free port for the peers' Prometheus listeners (both default to one
    /// fixed port, so two could not run side by side).
    pub fn command(
        &self,
        spec: RouterSpec,
        pool: &PoolAddrs,
        port: u16,
        metrics_port: u16,
    ) -> (PathBuf, Vec<String>) {
        let mut args: Vec<String> = Vec::new();
        let mut push = |items: &[&str]| args.extend(items.iter().map(|s| (*s).to_owned()));
        let program = match spec.peer {
            Peer::Ours => {
                push(&["serve", "--engine", "vllm", "--listen"]);
                push(&[&format!("127.0.0.1:{port}")]);
                push(&["--prefill-url", &pool.prefill.join(",")]);
                push(&["--decode-url", &pool.decode.join(",")]);
                push(&["--router-mode", spec.policy]);
                push(&[
                    "--request-timeout-ms",
                    "120000",
                    "--max-tokens-limit",
                    "4096",
                ]);
                if spec.kv_aware() {
                    push(&["--check-events=60"]);
                }
                if let Some(dir) = &pool.tokenizer {
                    push(&["--tokenizer", &dir.display().to_string()]);
                }
                self.ours.clone()
            }
            Peer::Smg => {
                push(&["launch"]);
                push_gateway_args(
                    &mut push,
                    pool,
                    spec,
                    (port, metrics_port),
                    "warn",
                    &["--backend", "vllm", "--pd-disaggregation"],
                );
                self.peers_bin.join("smg")
            }
            Peer::VllmRouter => {
                push_gateway_args(
                    &mut push,
                    pool,
                    spec,
                    (port, metrics_port),
                    "warning",
                    &["--vllm-pd-disaggregation", "--kv-connector", "nixl"],
                );
                if spec.policy == "kv_aware" {
                    // Its P/D event sources assume 16-token blocks ("Block size is 16").
                    for (url, events) in pool.prefill.iter().zip(&pool.events) {
                        push(&["--pd-kv-events", &format!("{url}={events}")]);
                    }
                }
                self.peers_bin.join("vllm-router")
            }
        };
        (program, args)
    }

    /// The version a router reports, for the report's header.
    pub fn version(&self, peer: Peer) -> String {
        let (program, args): (PathBuf, Vec<&str>) = match peer {
            Peer::Ours => {
                // The binary has no --version: the package's and the commit it was built from.
                let commit = run_for_line(Path::new("git"), &["rev-parse", "--short", "HEAD"])
                    .unwrap_or_else(|| "unknown commit".into());
                return format!("prefill-router {} ({commit})", env!("CARGO_PKG_VERSION"));
            }
            Peer::Smg => (self.peers_bin.join("smg"), vec!["--version"]),
            Peer::VllmRouter => (
                self.peers_bin.join("python"),
                vec![
                    "-c",
                    "import importlib.metadata as m; print('vllm-router', m.version('vllm-router'))",
                ],
            ),
        };
        run_for_line(&program, &args)
            .unwrap_or_else(|| format!("{} (version unknown)", peer.name()))
    }
}

/// What both peers' launchers (the SGLang gateway's command line, which vLLM's router
/// forked) take in P/D mode: loopback address and ports, `pd_flags`, every prefill and decode
/// engine, the prefill policy (decode round robin), the request bound and `log_level`.
fn push_gateway_args(
    push: &mut impl FnMut(&[&str]),
    pool: &PoolAddrs,
    spec: RouterSpec,
    (port, metrics_port): (u16, u16),
    log_level: &str,
    pd_flags: &[&str],
) {
    push(&["--host", "127.0.0.1", "--port", &port.to_string()]);
    push(&["--prometheus-port", &metrics_port.to_string()]);
    push(pd_flags);
    for url in &pool.prefill {
        push(&["--prefill", url]);
    }
    for url in &pool.decode {
        push(&["--decode", url]);
    }
    push(&[
        "--prefill-policy",
        spec.policy,
        "--decode-policy",
        "round_robin",
    ]);
    push(&["--request-timeout-secs", "120", "--log-level", log_level]);
}

/// The first line `program args` prints, if it runs.
fn run_for_line(program: &Path, args: &[&str]) -> Option<String> {
    let output = std::process::Command::new(program)
        .args(args)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> PoolAddrs {
        PoolAddrs {
            prefill: vec!["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()],
            events: vec!["tcp://127.0.0.1:11".into(), "tcp://127.0.0.1:12".into()],
            decode: vec!["http://127.0.0.1:3".into()],
            block_tokens: 16,
            tokenizer: None,
        }
    }

    fn binaries() -> Binaries {
        Binaries {
            ours: "/bin/prefill-router".into(),
            peers_bin: "/venv/bin".into(),
        }
    }

    #[test]
    fn every_label_parses_back_to_its_router() {
        for spec in RouterSpec::ALL {
            assert_eq!(RouterSpec::parse(&spec.label()), Some(spec));
        }
        assert_eq!(RouterSpec::parse("smg/kv"), None);
    }

    #[test]
    fn vllm_routers_kv_mode_is_given_every_prefill_engines_events() {
        let spec = RouterSpec::parse("vllm-router/kv_aware").unwrap();
        let (program, args) = binaries().command(spec, &pool(), 9000, 9001);
        assert_eq!(program, PathBuf::from("/venv/bin/vllm-router"));
        let joined = args.join(" ");
        assert!(joined.contains("--pd-kv-events http://127.0.0.1:1=tcp://127.0.0.1:11"));
        assert!(joined.contains("--pd-kv-events http://127.0.0.1:2=tcp://127.0.0.1:12"));
        let rr = RouterSpec::parse("vllm-router/round_robin").unwrap();
        assert!(!binaries()
            .command(rr, &pool(), 9000, 9001)
            .1
            .join(" ")
            .contains("kv-events"));
    }

    #[test]
    fn our_kv_mode_checks_the_events_before_listening() {
        let spec = RouterSpec::parse("prefill-router/kv").unwrap();
        let (_, args) = binaries().command(spec, &pool(), 9000, 9001);
        let joined = args.join(" ");
        assert!(joined.contains("--prefill-url http://127.0.0.1:1,http://127.0.0.1:2"));
        assert!(joined.contains("--router-mode kv --request-timeout-ms"));
        assert!(joined.contains("--check-events=60"));
    }
}
