//! The demo's workers: mock engines served over TCP on loopback and registered in discovery.

use std::collections::BTreeMap;
use std::sync::Arc;

use prefill_router::advert::{ModelCard, SelectionMode};
use prefill_router::discovery::{Discovery, EndpointId, InstanceId, Registration};
use prefill_router::transport::{Engine, ServerConfig, ServerHandle};
use prefill_router_tools::mock::{
    spawn_registered, MockConfig, MockDecode, MockPrefill, SpawnError,
};

/// How long a politely stopped worker keeps serving after deregistering.
const DRAIN: std::time::Duration = std::time::Duration::from_millis(250);

/// The demo's namespace.
pub const NAMESPACE: &str = "demo";

/// The prefill endpoint (component `prefill`: a prefill worker set).
pub fn prefill_endpoint() -> EndpointId {
    EndpointId::new(NAMESPACE, "prefill", "generate")
}

/// The decode endpoint (component `decode`: a decode worker set).
pub fn decode_endpoint() -> EndpointId {
    EndpointId::new(NAMESPACE, "decode", "generate")
}

/// A prefill card advertising `mode` at `block_size`.
pub fn prefill_card(mode: SelectionMode, block_size: u32) -> ModelCard {
    ModelCard::routed("mock-llm", mode, block_size)
}

struct Worker {
    server: ServerHandle,
    registration: Option<Registration>,
}

/// The running workers.
pub struct Cluster {
    discovery: Arc<dyn Discovery>,
    workers: BTreeMap<InstanceId, Worker>,
}

impl Cluster {
    /// No workers yet.
    pub fn new(discovery: Arc<dyn Discovery>) -> Self {
        Cluster {
            discovery,
            workers: BTreeMap::new(),
        }
    }

    async fn start(
        &mut self,
        endpoint: EndpointId,
        id: InstanceId,
        engine: Arc<dyn Engine>,
        card: ModelCard,
    ) -> Result<(), SpawnError> {
        let (server, registration) = spawn_registered(
            &self.discovery,
            endpoint,
            id,
            engine,
            card,
            ServerConfig::default(),
        )
        .await?;
        self.workers.insert(
            id,
            Worker {
                server,
                registration: Some(registration),
            },
        );
        Ok(())
    }

    /// Start prefill workers `ids` advertising `card` (their mock block size is the card's).
    pub async fn start_prefills(
        &mut self,
        ids: impl IntoIterator<Item = InstanceId>,
        card: &ModelCard,
        mock: &MockConfig,
    ) -> Result<(), SpawnError> {
        let config = MockConfig {
            block_size: card.kv_cache_block_size,
            ..mock.clone()
        };
        for id in ids {
            let engine = MockPrefill::new(id, config.clone());
            self.start(prefill_endpoint(), id, engine, card.clone())
                .await?;
        }
        Ok(())
    }

    /// Start decode worker `id`.
    pub async fn start_decode(
        &mut self,
        id: InstanceId,
        mock: &MockConfig,
    ) -> Result<(), SpawnError> {
        let card = ModelCard {
            kv_cache_block_size: mock.block_size,
            ..ModelCard::named("mock-llm")
        };
        self.start(
            decode_endpoint(),
            id,
            MockDecode::new(id, mock.clone()),
            card,
        )
        .await
    }

    /// Stop worker `id` politely: deregister, drain, then stop serving.
    pub async fn stop(&mut self, id: InstanceId) {
        if let Some(mut worker) = self.workers.remove(&id) {
            if let Some(registration) = worker.registration.take() {
                if let Err(error) = registration.deregister().await {
                    tracing::warn!(id, %error, "deregistering a demo worker");
                }
            }
            // Drain: requests routed just before the deregistration reached the frontend
            // finish (a prefill takes tens of milliseconds) before the server stops.
            tokio::time::sleep(DRAIN).await;
            worker.server.stop().await;
        }
    }

    /// Kill worker `id`: it stops serving at once and its record stays in discovery until its
    /// lease expires, as a crashed process leaves it.
    pub fn kill(&mut self, id: InstanceId) {
        if let Some(mut worker) = self.workers.remove(&id) {
            worker.server.shutdown();
            if let Some(registration) = worker.registration.take() {
                registration.abandon();
            }
        }
    }

    /// Stop every worker.
    pub async fn stop_all(&mut self) {
        let ids: Vec<InstanceId> = self.workers.keys().copied().collect();
        for id in ids {
            self.stop(id).await;
        }
    }
}
