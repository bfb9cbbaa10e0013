//! The engine cards and registrations the engine tests share (`tests/engine_link.rs`,
//! `tests/engine_events_live.rs`): a vLLM engine at block 32, registered under namespace
//! `engines`.

use std::net::SocketAddr;

use prefill_router::advert::{EngineCard, EngineProtocol, ModelCard};
use prefill_router::discovery::{Discovery, EndpointId, Instance, MemoryDiscovery, Registration};

/// A vLLM engine's card: model `tiny`, 32-token blocks.
pub fn card() -> ModelCard {
    ModelCard {
        kv_cache_block_size: 32,
        engine: Some(EngineCard {
            protocol: EngineProtocol::Vllm,
        }),
        ..ModelCard::named("tiny")
    }
}

pub async fn register(
    discovery: &MemoryDiscovery,
    component: &str,
    id: u64,
    addr: SocketAddr,
) -> Registration {
    let instance = Instance {
        endpoint: EndpointId::new("engines", component, "generate"),
        instance_id: id,
        address: addr,
    };
    discovery.register(instance, card()).await.unwrap()
}
