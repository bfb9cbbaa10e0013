//! Engines as workers: a probe-and-register loop that keeps one engine (a vLLM OpenAI server)
//! registered in a discovery store while it answers `GET /health`, with the card that says
//! what it is (protocol, model, block size), and withdraws it when it stops answering. The
//! `register` sidecar runs one; `serve --engine` runs one per static URL into an in-process
//! store. Either way the proven retarget logic governs engine pools as it governs ours.
//!
//! Nothing an engine answers can panic the loop: junk in `/v1/models` or `/metrics` is a
//! typed error, logged, and the card falls back to what it was told (`--model`, `--block-size`).

mod probe;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use prefill_router::advert::{EngineCard, EngineProtocol, ModelCard, RouterConfig, SelectionMode};
use prefill_router::discovery::{Discovery, EndpointId, Instance, InstanceId, Registration};
use tokio_util::sync::CancellationToken;

pub use probe::{http_get, ProbeError};

/// A bad engine URL.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EngineUrlError {
    /// Not `http://HOST:PORT` (https, a path, no port).
    #[error("engine URL {0:?}: expected http://HOST:PORT")]
    Shape(String),
    /// The host did not resolve.
    #[error("engine URL {url:?}: {reason}")]
    Resolve {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
}

/// An engine's base URL and the address it resolved to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineUrl {
    /// As given, without a trailing slash.
    pub url: String,
    /// Where the HTTP server listens.
    pub addr: SocketAddr,
}

impl EngineUrl {
    /// Parse `http://HOST:PORT` (a trailing `/` allowed) and resolve it.
    pub fn parse(url: &str) -> Result<Self, EngineUrlError> {
        let trimmed = url.trim_end_matches('/');
        let rest = trimmed
            .strip_prefix("http://")
            .filter(|r| !r.is_empty() && !r.contains('/'))
            .ok_or_else(|| EngineUrlError::Shape(url.to_owned()))?;
        if rest
            .rsplit_once(':')
            .is_none_or(|(_, p)| p.parse::<u16>().is_err())
        {
            return Err(EngineUrlError::Shape(url.to_owned()));
        }
        let addr = rest
            .to_socket_addrs()
            .map_err(|e| EngineUrlError::Resolve {
                url: url.to_owned(),
                reason: e.to_string(),
            })?
            .next()
            .ok_or_else(|| EngineUrlError::Resolve {
                url: url.to_owned(),
                reason: "no address".into(),
            })?;
        Ok(EngineUrl {
            url: trimmed.to_owned(),
            addr,
        })
    }
}

/// What a registrar registers and how it probes.
#[derive(Clone, Debug)]
pub struct RegistrarConfig {
    /// The protocol the engine speaks.
    pub protocol: EngineProtocol,
    /// `prefill` or `decode` (the endpoint's component).
    pub component: &'static str,
    /// The deployment's namespace.
    pub namespace: String,
    /// The instance id in discovery.
    pub id: InstanceId,
    /// The card's model name; `None`: the engine's own (`GET /v1/models`, `data[0].id`).
    pub model: Option<String>,
    /// The card's block size; `None`: the engine's (`vllm:cache_config_info` in `/metrics`).
    pub block_size: Option<u32>,
    /// The prefill set's routing mode (the card's router config; decode cards carry none).
    pub router_mode: SelectionMode,
    /// Between probes.
    pub interval: Duration,
    /// Bound of one probe.
    pub timeout: Duration,
    /// Consecutive failed probes before the engine is withdrawn.
    pub failures_to_withdraw: u32,
}

impl RegistrarConfig {
    /// Defaults for one engine of `component` in `namespace`: probes every second within 2 s,
    /// withdrawn after 3 failures, a KV-routed prefill set.
    pub fn new(component: &'static str, namespace: &str, id: InstanceId) -> Self {
        RegistrarConfig {
            protocol: EngineProtocol::Vllm,
            component,
            namespace: namespace.to_owned(),
            id,
            model: None,
            block_size: None,
            router_mode: SelectionMode::KV,
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(2),
            failures_to_withdraw: 3,
        }
    }
}

/// What the loop did, for the sidecar's event lines and for tests.
#[derive(Clone, Debug, PartialEq)]
pub enum RegistrarEvent {
    /// The engine answered and is registered with this card.
    Registered(ModelCard),
    /// The engine stopped answering and was withdrawn.
    Withdrawn {
        /// The last probe's failure.
        reason: String,
    },
}

/// The card of an engine that answers at `engine`: its model and block size as it reports
/// them, unless the configuration names them.
pub async fn engine_card(engine: &EngineUrl, config: &RegistrarConfig) -> ModelCard {
    let name = match &config.model {
        Some(name) => name.clone(),
        None => match probe::model_name(engine.addr, config.timeout).await {
            Ok(name) => name,
            Err(error) => {
                tracing::warn!(url = %engine.url, %error, "no model name from /v1/models");
                "unknown".to_owned()
            }
        },
    };
    let block_size = match config.block_size {
        Some(n) => n,
        None => match probe::block_size(engine.addr, config.timeout).await {
            Ok(n) => n,
            Err(error) => {
                tracing::warn!(url = %engine.url, %error, "no block size from /metrics");
                0
            }
        },
    };
    ModelCard {
        kv_cache_block_size: block_size,
        router_config: (config.component == "prefill").then(|| RouterConfig {
            router_mode: config.router_mode,
            ..RouterConfig::default()
        }),
        engine: Some(EngineCard {
            protocol: config.protocol,
        }),
        ..ModelCard::named(name)
    }
}

/// Keep `engine` registered in `discovery` while it answers `/health`, until `cancel`; the
/// registration held then (the caller deregisters it, first thing on SIGTERM).
pub async fn run_registrar(
    discovery: Arc<dyn Discovery>,
    engine: EngineUrl,
    config: RegistrarConfig,
    cancel: CancellationToken,
    on_event: impl Fn(&RegistrarEvent) + Send,
) -> Option<Registration> {
    let endpoint = EndpointId::new(&config.namespace, config.component, "generate");
    let mut held: Option<Registration> = None;
    let mut failures = 0u32;
    loop {
        let healthy = probe::health(engine.addr, config.timeout).await;
        match healthy {
            Ok(()) => {
                failures = 0;
                if held.is_none() {
                    let card = engine_card(&engine, &config).await;
                    let instance = Instance {
                        endpoint: endpoint.clone(),
                        instance_id: config.id,
                        address: engine.addr,
                    };
                    match discovery.register(instance, card.clone()).await {
                        Ok(registration) => {
                            held = Some(registration);
                            on_event(&RegistrarEvent::Registered(card));
                        }
                        Err(error) => {
                            tracing::warn!(url = %engine.url, %error, "registering the engine failed")
                        }
                    }
                }
            }
            Err(error) => {
                failures += 1;
                tracing::debug!(url = %engine.url, %error, failures, "engine probe failed");
                if failures >= config.failures_to_withdraw {
                    if let Some(registration) = held.take() {
                        if let Err(e) = registration.deregister().await {
                            tracing::warn!(url = %engine.url, error = %e, "withdrawing failed");
                        }
                        on_event(&RegistrarEvent::Withdrawn {
                            reason: error.to_string(),
                        });
                    }
                }
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return held,
            () = tokio::time::sleep(config.interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_urls_are_http_host_port() {
        let ok = EngineUrl::parse("http://127.0.0.1:8100/").unwrap();
        assert_eq!(ok.url, "http://127.0.0.1:8100");
        assert_eq!(ok.addr, "127.0.0.1:8100".parse().unwrap());
        for bad in [
            "https://127.0.0.1:8100",
            "http://127.0.0.1",
            "http://127.0.0.1:8100/v1",
            "127.0.0.1:8100",
            "http://",
            "http://127.0.0.1:99999",
        ] {
            assert!(EngineUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
