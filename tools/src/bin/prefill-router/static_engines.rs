//! `serve --engine vllm --prefill-url URL[,URL...] --decode-url URL[,URL...]`: engines given by
//! URL (the on-ramp vLLM's router and SMG users know), each kept in an in-process store by a
//! probe-and-register loop (`prefill_router_tools::engines`), so an engine that stops
//! answering leaves the routable set and comes back when it answers, through the same retarget
//! logic as a discovered pool.

use std::sync::Arc;

use prefill_router::advert::{EngineProtocol, SelectionMode};
use prefill_router::discovery::Discovery;
use prefill_router_tools::engines::{
    run_registrar, served_model, EngineUrl, RegistrarConfig, RegistrarEvent,
};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::args::{CliError, Flags};
use crate::register::{protocol, router_mode_of};

/// First instance id of the prefill engines (then 2, 3, ...); decode engines start at 100.
const FIRST_PREFILL_ID: u64 = 1;
const FIRST_DECODE_ID: u64 = 100;

/// The static engines of `serve`, as parsed.
#[derive(Clone, Debug, Default)]
pub struct StaticEngines {
    protocol: Option<EngineProtocol>,
    prefill: Vec<EngineUrl>,
    decode: Vec<EngineUrl>,
    /// `--router-mode`: how routers pick among the prefill engines (`None`: the default).
    router_mode: Option<SelectionMode>,
}

fn urls(flag: &str, raw: &str) -> Result<Vec<EngineUrl>, CliError> {
    raw.split(',')
        .filter(|u| !u.is_empty())
        .map(|u| EngineUrl::parse(u).map_err(|e| CliError::Usage(format!("{flag}: {e}"))))
        .collect()
}

impl StaticEngines {
    /// Take `flag` if it is one of ours.
    pub fn take(&mut self, flag: &str, flags: &mut Flags<'_>) -> Result<bool, CliError> {
        match flag {
            "--engine" => self.protocol = Some(protocol(flags.value(flag)?)?),
            "--prefill-url" => self.prefill.extend(urls(flag, flags.value(flag)?)?),
            "--decode-url" => self.decode.extend(urls(flag, flags.value(flag)?)?),
            "--router-mode" => self.router_mode = Some(router_mode_of(flags.value(flag)?)?),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Whether the prefill engines are picked in KV mode (`--router-mode kv`).
    pub fn kv_mode(&self) -> bool {
        self.router_mode == Some(SelectionMode::KV)
    }

    /// The prefill engines with the instance ids [`start`](Self::start) registers them under.
    pub fn prefill_ids(&self) -> Vec<(prefill_router::discovery::InstanceId, EngineUrl)> {
        (FIRST_PREFILL_ID..)
            .zip(self.prefill.iter().cloned())
            .collect()
    }

    /// Whether engines were given (then `--discovery` is optional).
    pub fn given(&self) -> bool {
        self.protocol.is_some()
    }

    /// The flags make sense together.
    pub fn check(&self) -> Result<(), CliError> {
        let usage = |m: &str| Err(CliError::Usage(m.into()));
        match self.protocol {
            None if !self.prefill.is_empty() || !self.decode.is_empty() => {
                usage("--prefill-url and --decode-url need --engine")
            }
            Some(_) if self.decode.is_empty() => usage("--engine needs --decode-url"),
            _ => Ok(()),
        }
    }

    /// The model the first answering engine serves (for `/v1/models` when `--model` is not
    /// given).
    pub async fn model(&self) -> Option<String> {
        let timeout = RegistrarConfig::new("decode", "engines", 0).timeout;
        for engine in self.prefill.iter().chain(&self.decode) {
            match served_model(engine, timeout).await {
                Ok(name) => return Some(name),
                Err(error) => tracing::debug!(url = %engine.url, %error, "no model name yet"),
            }
        }
        None
    }

    /// One registrar per engine into `discovery` under `namespace`, until the guard drops.
    pub fn start(&self, discovery: &Arc<dyn Discovery>, namespace: &str) -> Option<DropGuard> {
        let protocol = self.protocol?;
        let cancel = CancellationToken::new();
        let sets = [
            ("prefill", FIRST_PREFILL_ID, &self.prefill),
            ("decode", FIRST_DECODE_ID, &self.decode),
        ];
        for (component, first, engines) in sets {
            for (engine, id) in engines.iter().zip(first..) {
                let mut config = RegistrarConfig::new(component, namespace, id);
                config.protocol = protocol;
                if let (Some(mode), "prefill") = (self.router_mode, component) {
                    config.router_mode = mode;
                }
                let url = engine.url.clone();
                tokio::spawn(run_registrar(
                    Arc::clone(discovery),
                    engine.clone(),
                    config,
                    cancel.clone(),
                    move |event| {
                        match event {
                        RegistrarEvent::Registered(card) => eprintln!(
                            "serve: engine {url} ({component}) registered: model {}, block size {}",
                            card.name, card.kv_cache_block_size
                        ),
                        RegistrarEvent::Withdrawn { failures, error } => eprintln!(
                            "serve: engine {url} ({component}) withdrawn after {failures} failed probes: {error}"
                        ),
                    }
                    },
                ));
            }
        }
        Some(cancel.drop_guard())
    }
}
