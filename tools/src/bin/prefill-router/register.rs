//! `prefill-router register`: a sidecar that keeps one engine registered in discovery while it
//! answers `/health` (`prefill_router_tools::engines`), withdrawn when it stops answering or on
//! SIGTERM.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use prefill_router::advert::{EngineProtocol, SelectionMode};
use prefill_router_tools::engines::{
    run_registrar, EngineUrl, RegistrarConfig, RegistrarEvent, DEFAULT_ENGINE_ROUTER_MODE,
};
use tokio_util::sync::CancellationToken;

use crate::args::{CliError, Flags};
use crate::store::{terminated, StoreSpec, DEFAULT_ETCD_ROOT};

/// `register` usage.
pub const USAGE: &str = "\
usage: prefill-router register --engine vllm --role prefill|decode --url http://HOST:PORT
                               --discovery file://DIR|etcd://HOST:PORT[,...] --namespace NS
                               [--id N] [--model NAME] [--block-size N] [options]

A sidecar for one engine (a vLLM OpenAI server): while the engine answers GET /health it is
registered in discovery as endpoint NS/ROLE/generate, at the engine's address, with a card
saying what it is (protocol, model from /v1/models, KV block size from /metrics); after
--failures failed probes in a row it is withdrawn, and registered again (its card read again)
when it answers. An engine whose model or block size cannot be read is not registered (it is
still probed; give --model or --block-size). Prints one JSON line per change on stdout:
{\"event\":\"registered\",...}, {\"event\":\"withdrawn\",\"reason\":\"unhealthy\",...}.
SIGTERM (or Ctrl-C): the engine is withdrawn first ({\"event\":\"withdrawn\",\"reason\":
\"stopping\"}: frontends stop routing to it), then the sidecar waits --drain-ms for the
requests already routed there, prints {\"event\":\"stopped\",...} and exits 0; a second
signal ends the wait. On Kubernetes (k8s://) frontends find pods by their readiness and
annotations; register does not support it yet (docs/engines.md).

options:
  --engine PROTOCOL      the engine's protocol: vllm
  --role ROLE            prefill or decode
  --url URL              the engine's base URL, http://HOST:PORT (no https, no path)
  --discovery SPEC       file://DIR or etcd://HOST:PORT[,HOST:PORT...]
  --namespace NS         the deployment's namespace
  --id N                 the instance id (default: the engine's port)
  --model NAME           the card's model name (default: the engine's /v1/models data[0].id)
  --block-size N         the card's KV block size (default: the block_size label of the
                         engine's vllm:cache_config_info metric)
  --router-mode MODE     prefill only: how routers pick among the prefill engines:
                         round-robin (default), random or kv
  --probe-interval-ms N  between probes of /health (default 1000; each bounded by 2000)
  --failures N           failed probes in a row before the engine is withdrawn (default 3)
  --ttl-ms N             discovery lease TTL in milliseconds (default 10000)
  --drain-ms N           on SIGTERM, wait this long after withdrawing (default 2000)
  --etcd-root PREFIX     etcd key root (default prefill-router/v1/instances/)";

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

/// The `--router-mode` value (`serve --engine` takes it too).
pub fn router_mode_of(raw: &str) -> Result<SelectionMode, CliError> {
    match raw {
        "kv" => Ok(SelectionMode::KV),
        "round-robin" => Ok(SelectionMode::RoundRobin),
        "random" => Ok(SelectionMode::Random),
        other => Err(CliError::Usage(format!(
            "--router-mode: expected round-robin, random or kv, got `{other}`"
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
        let mut router_mode = None;
        let (mut interval, mut failures) = (None, None);
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
                "--router-mode" => router_mode = Some(router_mode_of(flags.value(flag)?)?),
                "--probe-interval-ms" => {
                    interval = Some(positive_millis(flag, flags.parsed(flag)?)?);
                }
                "--failures" => match flags.parsed::<u32>(flag)? {
                    0 => return Err(CliError::Usage("--failures must be positive".into())),
                    n => failures = Some(n),
                },
                "--ttl-ms" => ttl = Duration::from_millis(flags.parsed(flag)?),
                "--drain-ms" => drain = Duration::from_millis(flags.parsed(flag)?),
                "--etcd-root" => etcd_root = flags.value(flag)?.to_owned(),
                "--help" | "-h" => return Err(CliError::Help(USAGE.to_owned())),
                other => {
                    return Err(CliError::Usage(format!(
                        "unknown register option `{other}`"
                    )))
                }
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
                "register does not support --discovery k8s:// yet: on Kubernetes frontends find \
                 workers as ready pods with the card in an annotation, not as registrations \
                 (docs/kubernetes.md); use file:// or etcd://"
                    .into(),
            ));
        }
        if role == "decode" && router_mode.is_some() {
            return Err(CliError::Usage(
                "--router-mode is for prefill engines (decode cards carry no routing)".into(),
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
        config.router_mode = router_mode.unwrap_or(DEFAULT_ENGINE_ROUTER_MODE);
        config.interval = interval.unwrap_or(config.interval);
        config.failures_to_withdraw = failures.unwrap_or(config.failures_to_withdraw);
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

/// A positive duration in milliseconds.
fn positive_millis(flag: &str, ms: u64) -> Result<Duration, CliError> {
    match ms {
        0 => Err(CliError::Usage(format!("{flag} must be positive"))),
        ms => Ok(Duration::from_millis(ms)),
    }
}

/// Print `line` as one line on stdout, the sidecar's event stream.
fn emit(line: &serde_json::Value) {
    println!("{line}");
}

/// The event line of a registrar event.
fn event_line(event: &RegistrarEvent, url: &str, id: u64) -> serde_json::Value {
    match event {
        RegistrarEvent::Registered(card) => serde_json::json!({
            "event": "registered", "url": url, "id": id, "model": card.name,
            "block_size": card.kv_cache_block_size,
            "protocol": card.engine.as_ref().map(|e| e.protocol.to_string()),
            "router_mode": card.router_config.as_ref().map(|r| r.router_mode.to_string()),
            "pid": std::process::id(),
        }),
        RegistrarEvent::Withdrawn { failures, error } => serde_json::json!({
            "event": "withdrawn", "reason": "unhealthy", "url": url, "id": id,
            "failures": failures, "error": error.to_string(),
        }),
    }
}

async fn register(options: RegisterOptions) -> Result<(), String> {
    let discovery = options
        .discovery
        .open(options.ttl, &options.etcd_root)
        .await?;
    let cancel = CancellationToken::new();
    let url = options.engine.url.clone();
    let id = options.config.id;
    let events_url = url.clone();
    let registrar = tokio::spawn(run_registrar(
        Arc::clone(&discovery),
        options.engine,
        options.config,
        cancel.clone(),
        move |event| emit(&event_line(event, &events_url, id)),
    ));
    terminated().await;
    // Withdraw first: frontends stop routing here before the drain starts. Cancelling
    // interrupts a probe in flight, so this does not wait for a probe's timeout.
    cancel.cancel();
    let held = registrar
        .await
        .map_err(|e| format!("the registrar stopped: {e}"))?;
    let was_registered = held.is_some();
    let withdrawn = match held {
        Some(registration) => registration
            .deregister()
            .await
            .map_err(|e| format!("withdrawing: {e}")),
        None => Ok(()),
    };
    if was_registered {
        emit(&serde_json::json!({
            "event": "withdrawn", "reason": "stopping", "url": url, "id": id,
            "deregistered": withdrawn.is_ok(),
        }));
    }
    tracing::info!(drain = ?options.drain, "withdrawn; waiting for requests routed before");
    tokio::select! {
        () = tokio::time::sleep(options.drain) => {}
        () = terminated() => tracing::warn!("second signal: not waiting for the drain"),
    }
    emit(
        &serde_json::json!({"event": "stopped", "url": url, "id": id, "withdrawn": withdrawn.is_ok()}),
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
        assert_eq!(ok.config.router_mode, SelectionMode::RoundRobin);
        assert_eq!(ok.config.failures_to_withdraw, 3);
        assert_eq!(ok.drain, Duration::from_secs(2));
        let tuned = RegisterOptions::parse(&args(
            "--engine vllm --role prefill --url http://127.0.0.1:8100 --discovery file:///tmp/x --namespace ns --id 7 --model m --block-size 16 --router-mode kv --failures 5 --probe-interval-ms 100 --drain-ms 10",
        ))
        .unwrap_or_else(|_| panic!("valid"));
        assert_eq!(tuned.config.id, 7);
        assert_eq!(tuned.config.model.as_deref(), Some("m"));
        assert_eq!(tuned.config.block_size, Some(16));
        assert_eq!(tuned.config.router_mode, SelectionMode::KV);
        assert_eq!(tuned.config.failures_to_withdraw, 5);
        assert_eq!(tuned.config.interval, Duration::from_millis(100));
        assert_eq!(tuned.drain, Duration::from_millis(10));
        for bad in [
            "--role prefill --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns",
            "--engine sglang --role prefill --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns",
            "--engine vllm --role both --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns",
            "--engine vllm --role decode --url https://127.0.0.1:1 --discovery file:///tmp/x --namespace ns",
            "--engine vllm --role decode --url http://127.0.0.1:1 --namespace ns",
            "--engine vllm --role decode --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace a/b",
            "--engine vllm --role prefill --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns --router-mode best",
            "--engine vllm --role decode --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns --router-mode kv",
            "--engine vllm --role decode --url http://127.0.0.1:1/v1 --discovery file:///tmp/x --namespace ns",
            "--engine vllm --role decode --url http://127.0.0.1:1 --discovery k8s://prod --namespace ns",
            "--engine vllm --role decode --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns --failures 0",
            "--engine vllm --role decode --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns --probe-interval-ms 0",
            "--engine vllm --role decode --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns --ttl-ms 10",
            "--engine vllm --role decode --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns --bogus",
            "--engine vllm --url http://127.0.0.1:1 --discovery file:///tmp/x --namespace ns",
        ] {
            assert!(
                matches!(RegisterOptions::parse(&args(bad)), Err(CliError::Usage(_))),
                "{bad}"
            );
        }
    }
}
