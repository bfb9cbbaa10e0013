//! The engine cards and registrations the engine tests share (`tests/engine_link.rs`,
//! `tests/engine_events_live.rs`): a vLLM engine at block 32, registered under namespace
//! `engines`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prefill_router::advert::{EngineCard, EngineProtocol, ModelCard};
use prefill_router::discovery::{Discovery, EndpointId, Instance, MemoryDiscovery, Registration};
use prefill_router::{PrefillHop, PrefillHopConfig};

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

/// A hop over the engines registered in `discovery` (namespace `engines`) with the live tests'
/// 120 s request deadline (a CPU engine is slow), once it is Active (within 10 s).
pub async fn live_hop(discovery: MemoryDiscovery) -> PrefillHop {
    let mut config = PrefillHopConfig::default();
    config.push.request_timeout = Some(Duration::from_secs(120));
    let discovery: Arc<dyn Discovery> = Arc::new(discovery);
    let hop = PrefillHop::start(discovery, "engines", config)
        .await
        .unwrap();
    if let Err(e) = hop.router().wait_active(Duration::from_secs(10)).await {
        panic!("not active: {e:?} {:?}", hop.router().status());
    }
    hop
}
