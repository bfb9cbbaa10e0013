//! A worker started the way every demo, test and benchmark starts one: its engine served on
//! the request plane on loopback, the instance registered in discovery.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use prefill_router::advert::ModelCard;
use prefill_router::discovery::{
    Discovery, DiscoveryError, EndpointId, Instance, InstanceId, Registration,
};
use prefill_router::transport::{serve, Engine, ServerConfig, ServerHandle};
use tokio::net::TcpListener;

/// Why [`spawn_registered`] could not start a worker.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// Binding the loopback listener (or starting the server on it) failed.
    #[error("listening on loopback: {0}")]
    Listen(#[from] std::io::Error),
    /// Registering in discovery failed.
    #[error("registering: {0}")]
    Register(#[from] DiscoveryError),
}

/// Serve `engine` on a fresh loopback port with `config` and register it in `discovery` as
/// instance `id` of `endpoint`, advertising `card`. The worker serves until the returned
/// server is stopped or dropped, and stays in discovery until the registration is
/// deregistered or dropped.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::sync::Arc;
///
/// use prefill_router::advert::{ModelCard, SelectionMode};
/// use prefill_router::discovery::{Discovery, EndpointId, MemoryConfig, MemoryDiscovery};
/// use prefill_router::transport::ServerConfig;
/// use prefill_router_tools::mock::{spawn_registered, MockConfig, MockPrefill};
///
/// let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
/// let (server, _registration) = spawn_registered(
///     &discovery,
///     EndpointId::new("ns", "prefill", "generate"),
///     1,
///     MockPrefill::new(1, MockConfig::default()),
///     ModelCard::routed("m", SelectionMode::RoundRobin, 16),
///     ServerConfig::default(),
/// )
/// .await
/// .unwrap();
/// assert!(server.local_addr().ip().is_loopback());
/// # }
/// ```
pub async fn spawn_registered(
    discovery: &Arc<dyn Discovery>,
    endpoint: EndpointId,
    id: InstanceId,
    engine: Arc<dyn Engine>,
    card: ModelCard,
    config: ServerConfig,
) -> Result<(ServerHandle, Registration), SpawnError> {
    let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).await?;
    let server = serve(listener, engine, config)?;
    let instance = Instance {
        endpoint,
        instance_id: id,
        address: server.local_addr(),
    };
    let registration = discovery.register(instance, card).await?;
    Ok((server, registration))
}
