//! A benchmark's worker: an engine served on loopback and registered in discovery (shared by
//! `benches/frontend.rs` and `benches/serve.rs`).

use std::net::SocketAddr;
use std::sync::Arc;

use prefill_router::advert::ModelCard;
use prefill_router::discovery::{Discovery, EndpointId, Instance, InstanceId, Registration};
use prefill_router::transport::{serve, Engine, ServerConfig, ServerHandle};
use tokio::net::TcpListener;

// benches/serve.rs uses `worker_with` alone.
#[allow(dead_code)]
pub async fn worker(
    discovery: &Arc<dyn Discovery>,
    endpoint: EndpointId,
    id: InstanceId,
    engine: Arc<dyn Engine>,
    card: ModelCard,
) -> (ServerHandle, Registration) {
    worker_with(
        discovery,
        endpoint,
        id,
        engine,
        card,
        ServerConfig::default(),
    )
    .await
}

/// [`worker`] with its own server config (TLS, limits).
pub async fn worker_with(
    discovery: &Arc<dyn Discovery>,
    endpoint: EndpointId,
    id: InstanceId,
    engine: Arc<dyn Engine>,
    card: ModelCard,
    config: ServerConfig,
) -> (ServerHandle, Registration) {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let server = serve(listener, engine, config).unwrap();
    let instance = Instance {
        endpoint,
        instance_id: id,
        address: server.local_addr(),
    };
    let registration = discovery.register(instance, card).await.unwrap();
    (server, registration)
}
