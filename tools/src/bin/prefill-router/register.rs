//! `prefill-router register`: a sidecar that keeps one engine registered in discovery while it
//! answers `/health` (`prefill_router_tools::engines`), withdrawn when it stops answering or on
//! SIGTERM.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use prefill_router::advert::{EngineProtocol, SelectionMode};
use prefill_router_tools::engines::{run_registrar, EngineUrl, RegistrarConfig, RegistrarEvent};
use tokio_util::sync::CancellationToken;

use crate::args::{CliError, Flags};
use crate::store::{terminated, StoreSpec, DEFAULT_ETCD_ROOT};

/// `register` usage.
pub const USAGE: &str = "\
usage: prefill-router register --engine vllm --role prefill|decode --url http://HOST:PORT
                               --discovery file://DIR|etcd://HOST:PORT[,...] --namespace NS
                               [--id N] [options]

A sidecar for one engine (a vLLM OpenAI server): while the engine answers GET /health it is
registered in discovery as endpoint NS/ROLE/generate with a card saying what it is (protocol,
model from /v1/models, block size from /metrics); after 3 failed probes it is withdrawn, and
registered again when it answers. Prints one JSON line per change on stdout
({\"event\":\"registered\",...}, {\"event\":\"withdrawn\",...}). SIGTERM (or Ctrl-C): the engine
is withdrawn first (frontends stop routing to it), then the sidecar waits --drain-ms for the
requests already routed there, prints {\"event\":\"stopped\"} and exits 0 (docs/engines.md).

options:
  --engine PROTOCOL    the engine's protocol: vllm
  --role ROLE          prefill or decode
  --url URL            the engine's HTTP address, http://HOST:PORT
  --discovery SPEC     file://DIR or etcd://HOST:PORT[,HOST:PORT...]
  --namespace NS       the deployment's namespace
  --id N               the instance id (default: the engine's port)
  --model NAME         the card's model name (default: the engine's /v1/models)
  --block-size N       the card's KV block size (default: the engine's /metrics)
  --router-mode MODE   the prefill set's routing: kv (default), round-robin or random
  --ttl-ms N           discovery lease TTL in milliseconds (default 10000)
  --drain-ms N         on SIGTERM, wait this long after withdrawing (default 2000)
  --etcd-root PREFIX   etcd key root (default prefill-router/v1/instances/)";

/// Parsed `register` options.
#[derive(Clone, Debug)]
pub struct RegisterOptions {
    engine: EngineUrl,
    discovery: StoreSpec,
    config: RegistrarConfig,
    ttl: Duration,
    drain: Duration,
    etcd_root: String,
}

/// `prefill` or `decode`.
pub fn component(role: &str) -> Result<&'static str, CliError> {
    match role {
        "prefill" => Ok("prefill"),
        "decode" => Ok("decode"),
        other => Err(CliError::Usage(format!(
            "--role: expected prefill or decode, got `{other}`"
        ))),
    }
}

/// The `--engine` value.
pub fn protocol(raw: &str) -> Result<EngineProtocol, CliError> {
    raw.parse()
        .map_err(|e| CliError::Usage(format!("--engine: {e}")))
}

impl RegisterOptions {
    /// Parse the arguments after `register`.
    pub fn parse(args: &[String]) -> Result<Self, CliError> {
        let mut flags = Flags::new(args);
        let (mut protocol_, mut role, mut url, mut discovery, mut namespace) =
            (None, None, None, None, None);
        let (mut id, mut model, mut block_size) = (None, None, None);
        let mut router_mode = SelectionMode::KV;
        let (mut ttl, mut drain) = (Duration::from_secs(10), Duration::from_secs(2));
        let mut etcd_root = DEFAULT_ETCD_ROOT.to_owned();
        while let Some(flag) = flags.next_flag() {
            match flag {
                "--engine" => protocol_ = Some(protocol(flags.value(flag)?)?),
                "--role" => role = Some(component(flags.value(flag)?)?),
                "--url" => {
                    let raw = flags.value(flag)?;
                    url = Some(
                        EngineUrl::parse(raw)
                            .map_err(|e| CliError::Usage(format!("--url: {e}")))?,
                    );
                }
                "--discovery" => discovery = Some(StoreSpec::parse(flag, flags.value(flag)?)?),
                "--namespace" => namespace = Some(flags.value(flag)?.to_owned()),
                "--id" => id = Some(flags.parsed::<u64>(flag)?),
                "--model" => model = Some(flags.value(flag)?.to_owned()),
                "--block-size" => block_size = Some(flags.parsed::<u32>(flag)?),
                "--router-mode" => {
                    router_mode = match flags.value(flag)? {
                        "kv" => SelectionMode::KV,
                        "round-robin" => SelectionMode::RoundRobin,
                        "random" => SelectionMode::Random,
                        other => {
                            return Err(CliError::Usage(format!(
                                "--router-mode: expected kv, round-robin or random, got `{other}`"
                            )))
                        }
                    }
                }
                "--ttl-ms" => ttl = Duration::from_millis(flags.parsed(flag)?),
                "--drain-ms" => drain = Duration::from_millis(flags.parsed(flag)?),
                "--etcd-root" => etcd_root = flags.value(flag)?.to_owned(),
                "--help" | "-h" => return Err(CliError::Help(USAGE.to_owned())),
                other => return Err(CliError::Usage(format!("unknown flag `{other}`"))),
            }
        }
        let need = |what: &str| CliError::Usage(format!("register needs {what}"));
        let protocol_ = protocol_.ok_or_else(|| need("--engine"))?;
        let role = role.ok_or_else(|| need("--role"))?;
        let engine = url.ok_or_else(|| need("--url"))?;
        let discovery = discovery.ok_or_else(|| need("--discovery"))?;
        let namespace = namespace.ok_or_else(|| need("--namespace"))?;
        if namespace.is_empty() || namespace.contains('/') {
            return Err(CliError::Usage(
                "--namespace must be non-empty, without `/`".into(),
            ));
        }
        if matches!(discovery, StoreSpec::Kubernetes { .. }) {
            return Err(CliError::Usage(
                "register --discovery k8s:// is not supported: on Kubernetes the engine's pod is found by its readiness (docs/kubernetes.md)".into(),
            ));
        }
        if ttl < Duration::from_millis(300) {
            return Err(CliError::Usage("--ttl-ms must be at least 300".into()));
        }
        let mut config = RegistrarConfig::new(
            role,
            &namespace,
            id.unwrap_or(u64::from(engine.addr.port())),
        );
        config.protocol = protocol_;
        config.model = model;
        config.block_size = block_size;
        config.router_mode = router_mode;
        Ok(RegisterOptions {
            engine,
            discovery,
            config,
            ttl,
            drain,
            etcd_root,
        })
    }
}

/// Run the sidecar until SIGTERM.
pub async fn run(options: RegisterOptions) -> ExitCode {
    match register(options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("register failed: {error}");
            ExitCode::FAILURE
        }
    }
}

fn event_line(event: &RegistrarEvent, url: &str, id: u64) {
    let line = match event {
        RegistrarEvent::Registered(card) => serde_json::json!({
            "event": "registered", "url": url, "id": id, "model": card.name,
            "block_size": card.kv_cache_block_size, "pid": std::process::id(),
        }),
        RegistrarEvent::Withdrawn { reason } => serde_json::json!({
            "event": "withdrawn", "url": url, "id": id, "reason": reason,
        }),
    };
    println!("{line}");
}

async fn register(options: RegisterOptions) -> Result<(), String> {
    let discovery = options
        .discovery
        .open(options.ttl, &options.etcd_root)
        .await?;
    let cancel = CancellationToken::new();
    let url = options.engine.url.clone();
    let id = options.config.id;
    let registrar = tokio::spawn(run_registrar(
        Arc::clone(&discovery),
        options.engine,
        options.config,
        cancel.clone(),
        move |event| event_line(event, &url, id),
    ));
    terminated().await;
    cancel.cancel();
    // The loop stops between probes; what it holds is withdrawn first.
    let held = registrar
        .await
        .map_err(|e| format!("the registrar stopped: {e}"))?;
    let withdrawn = match held {
        Some(registration) => registration
            .deregister()
            .await
            .map_err(|e| format!("withdrawing: {e}")),
        None => Ok(()),
    };
    tracing::info!(drain = ?options.drain, "withdrawn; waiting for requests routed before");
    tokio::select! {
        () = tokio::time::sleep(options.drain) => {}
        () = terminated() => {}
    }
    println!(
        "{}",
        serde_json::json!({"event": "stopped", "id": id, "withdrawn": withdrawn.is_ok()})
    );
    withdrawn
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn register_parses_and_rejects_with_usage() {
        let ok = RegisterOptions::parse(&args(
            "--engine vllm --role prefill --url http://127.0.0.1:8100 --discovery file:///tmp/x --namespace ns",
        ))
        .unwrap_or_else(|_| panic!("valid"));
        assert_eq!((ok.config.id, ok.config.component), (8100, "prefill"));
        for bad in [
            "--role prefill --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns",
            "--engine sglang --role prefill --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns",
            "--engine vllm --role both --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns",
            "--engine vllm --role decode --url https://127.0.0.1:1 --discovery file:///tmp/x --namespace ns",
            "--engine vllm --role decode --url http://127.0.0.1:1 --namespace ns",
            "--engine vllm --role decode --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace a/b",
            "--engine vllm --role decode --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns --router-mode best",
        ] {
            assert!(
                matches!(RegisterOptions::parse(&args(bad)), Err(CliError::Usage(_))),
                "{bad}"
            );
        }
    }
}
