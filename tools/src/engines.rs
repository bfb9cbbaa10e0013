//! Engines as workers: a probe-and-register loop that keeps one engine (a vLLM OpenAI server)
//! registered in a discovery store while it answers `GET /health`, with the card that says
//! what it is (protocol, model, block size), and withdraws it when it stops answering. The
//! `register` sidecar runs one; `serve --engine` runs one per static URL into an in-process
//! store. Either way the proven retarget logic governs engine pools as it governs ours.
//!
//! Nothing an engine answers can panic the loop: junk in `/v1/models` or `/metrics` is a
//! typed error ([`CardError`]), logged, and the engine stays unregistered (still probed) until
//! its card can be read or is given (`--model`, `--block-size`). docs/engines.md, "Engines as
//! workers: static and register".

mod probe;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use prefill_router::advert::{EngineCard, EngineProtocol, ModelCard, RouterConfig, SelectionMode};
use prefill_router::discovery::{Discovery, EndpointId, Instance, InstanceId, Registration};
use tokio_util::sync::CancellationToken;

pub use probe::{http_get, http_post_json, ProbeError};

/// A bad engine URL.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EngineUrlError {
    /// `https://`: the engine link speaks plain HTTP today (engines sit beside the router on
    /// a private network).
    #[error("engine URL {0:?}: https is not supported yet; give http://HOST:PORT")]
    Https(String),
    /// A path after the address: the protocol's paths (`/v1/completions`, `/health`) are the
    /// link's to add.
    #[error("engine URL {0:?}: give the server's base URL, http://HOST:PORT, without a path")]
    Path(String),
    /// Not `http://HOST:PORT` otherwise (no scheme, no host, no or a bad port).
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
        if trimmed.starts_with("https://") {
            return Err(EngineUrlError::Https(url.to_owned()));
        }
        let rest = trimmed
            .strip_prefix("http://")
            .filter(|r| !r.is_empty())
            .ok_or_else(|| EngineUrlError::Shape(url.to_owned()))?;
        if rest.contains(['/', '?', '#']) {
            return Err(EngineUrlError::Path(url.to_owned()));
        }
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
    /// Bound of one probe (connect and the whole answer).
    pub timeout: Duration,
    /// Consecutive failed probes before the engine is withdrawn.
    pub failures_to_withdraw: u32,
    /// Consecutive probes that got no answer in time before the engine is withdrawn, when
    /// every failure in the run was a timeout (at least `failures_to_withdraw`). An engine busy
    /// with a long queue answers `/health` late (vLLM on CPU under load took over 2 s); one
    /// that is gone refuses or errors, and that is withdrawn after `failures_to_withdraw`.
    pub timeouts_to_withdraw: u32,
}

/// The prefill set's routing mode when none is asked for: round robin. An engine publishes no
/// KV cache events to our routers, so KV mode would score it by the routers' own bookings and
/// guesses alone; round robin is the honest default until it does (`--router-mode kv` opts in).
pub const DEFAULT_ENGINE_ROUTER_MODE: SelectionMode = SelectionMode::RoundRobin;

impl RegistrarConfig {
    /// Defaults for one engine of `component` in `namespace`: probes every second within 2 s,
    /// withdrawn after 3 consecutive failures, or 10 consecutive timeouts (about 30 s of no
    /// answer), a round-robin prefill set.
    pub fn new(component: &'static str, namespace: &str, id: InstanceId) -> Self {
        RegistrarConfig {
            protocol: EngineProtocol::Vllm,
            component,
            namespace: namespace.to_owned(),
            id,
            model: None,
            block_size: None,
            router_mode: DEFAULT_ENGINE_ROUTER_MODE,
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(2),
            failures_to_withdraw: 3,
            timeouts_to_withdraw: 10,
        }
    }
}

/// What the loop did, for the sidecar's event lines and for tests.
#[derive(Clone, Debug, PartialEq)]
pub enum RegistrarEvent {
    /// The engine answered and is registered with this card.
    Registered(ModelCard),
    /// The engine stopped answering (`failures` probes in a row) and was withdrawn.
    Withdrawn {
        /// Consecutive failed probes at the withdrawal.
        failures: u32,
        /// The last probe's failure.
        error: ProbeError,
    },
}

/// Why an engine that answers `/health` could not be given a card (it is not registered until
/// it can: a card with a made-up model name or block size would mislead every router).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CardError {
    /// No model name from `GET /v1/models` and none configured (`--model`).
    #[error("no model name from /v1/models ({0}); give one with --model")]
    Model(ProbeError),
    /// No block size from `GET /metrics` and none configured (`--block-size`).
    #[error("no KV block size from /metrics ({0}); give one with --block-size")]
    BlockSize(ProbeError),
}

/// The model `engine` serves: `data[0].id` of its `GET /v1/models`, within `timeout`.
pub async fn served_model(engine: &EngineUrl, timeout: Duration) -> Result<String, ProbeError> {
    probe::model_name(engine.addr, timeout).await
}

/// The card of an engine that answers at `engine`: its model and block size as it reports
/// them, unless the configuration names them.
pub async fn engine_card(
    engine: &EngineUrl,
    config: &RegistrarConfig,
) -> Result<ModelCard, CardError> {
    let name = match &config.model {
        Some(name) => name.clone(),
        None => served_model(engine, config.timeout)
            .await
            .map_err(CardError::Model)?,
    };
    let block_size = match config.block_size {
        Some(n) => n,
        None => probe::block_size(engine.addr, config.timeout)
            .await
            .map_err(CardError::BlockSize)?,
    };
    Ok(ModelCard {
        kv_cache_block_size: block_size,
        router_config: (config.component == "prefill").then(|| RouterConfig {
            router_mode: config.router_mode,
            ..RouterConfig::default()
        }),
        engine: Some(EngineCard {
            protocol: config.protocol,
        }),
        ..ModelCard::named(name)
    })
}

/// One probe's finding.
enum Probe {
    /// `/health` answered 200; the card to register with, when one was asked for and could be
    /// read.
    Healthy(Option<ModelCard>),
    /// `/health` did not answer 200 in time.
    Failed(ProbeError),
}

/// Probe `engine` once; read its card too when `want_card` (it is not registered).
async fn probe_once(
    engine: &EngineUrl,
    config: &RegistrarConfig,
    want_card: bool,
    last_card_error: &mut Option<CardError>,
) -> Probe {
    if let Err(error) = probe::health(engine.addr, config.timeout).await {
        return Probe::Failed(error);
    }
    if !want_card {
        return Probe::Healthy(None);
    }
    match engine_card(engine, config).await {
        Ok(card) => {
            *last_card_error = None;
            Probe::Healthy(Some(card))
        }
        Err(error) => {
            // Once per distinct error, not once a second: the engine is retried every probe.
            if last_card_error.as_ref() != Some(&error) {
                tracing::warn!(url = %engine.url, %error, "engine is healthy but has no card yet; not registered");
            }
            *last_card_error = Some(error);
            Probe::Healthy(None)
        }
    }
}

/// Keep `engine` registered in `discovery` while it answers `/health`, until `cancel`; the
/// registration held then (the caller deregisters it, first thing on SIGTERM).
///
/// Registered at the first healthy probe whose card can be read; withdrawn (deregistered)
/// after [`RegistrarConfig::failures_to_withdraw`] failed probes in a row (or
/// [`RegistrarConfig::timeouts_to_withdraw`] when every one of them timed out); registered again,
/// with a freshly read card, when it answers again. `cancel` interrupts a probe in flight, so
/// a stopping sidecar withdraws at once rather than after a probe's timeout.
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
    // Whether every failure of the current run was a timeout (a busy engine, not a gone one).
    let mut only_timeouts = true;
    let mut last_card_error = None;
    loop {
        // Only the probing is interrupted: a register or deregister under way completes, so
        // the store is never left with a record nobody holds.
        let found = tokio::select! {
            biased;
            () = cancel.cancelled() => return held,
            found = probe_once(&engine, &config, held.is_none(), &mut last_card_error) => found,
        };
        match found {
            Probe::Healthy(card) => {
                failures = 0;
                only_timeouts = true;
                if let Some(card) = card {
                    let instance = Instance {
                        endpoint: endpoint.clone(),
                        instance_id: config.id,
                        address: engine.addr,
                    };
                    match discovery.register(instance, card.clone()).await {
                        Ok(registration) => {
                            tracing::info!(url = %engine.url, id = config.id, "engine registered");
                            held = Some(registration);
                            on_event(&RegistrarEvent::Registered(card));
                        }
                        // Tried again at the next probe.
                        Err(error) => {
                            tracing::warn!(url = %engine.url, %error, "registering the engine failed")
                        }
                    }
                }
            }
            Probe::Failed(error) => {
                failures = failures.saturating_add(1);
                only_timeouts &= matches!(error, ProbeError::Timeout(_));
                tracing::debug!(url = %engine.url, %error, failures, "engine probe failed");
                let threshold = if only_timeouts {
                    config.timeouts_to_withdraw.max(config.failures_to_withdraw)
                } else {
                    config.failures_to_withdraw
                };
                if failures >= threshold {
                    if let Some(registration) = held.take() {
                        if let Err(e) = registration.deregister().await {
                            tracing::warn!(url = %engine.url, error = %e, "withdrawing failed");
                        }
                        tracing::warn!(url = %engine.url, %error, failures, "engine withdrawn");
                        on_event(&RegistrarEvent::Withdrawn { failures, error });
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
        assert!(matches!(
            EngineUrl::parse("https://127.0.0.1:8100"),
            Err(EngineUrlError::Https(_))
        ));
        for with_path in ["http://127.0.0.1:8100/v1", "http://127.0.0.1:8100?x=1"] {
            assert!(
                matches!(EngineUrl::parse(with_path), Err(EngineUrlError::Path(_))),
                "{with_path}"
            );
        }
        for bad in [
            "http://127.0.0.1",
            "127.0.0.1:8100",
            "http://",
            "http://127.0.0.1:99999",
            "http://127.0.0.1:",
        ] {
            assert!(
                matches!(EngineUrl::parse(bad), Err(EngineUrlError::Shape(_))),
                "{bad}"
            );
        }
    }
}
