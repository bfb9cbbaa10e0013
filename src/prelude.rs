//! The embedder's one import: `use prefill_router::prelude::*;` (feature `runtime`).
//!
//! It brings the one-call path into scope: start a [`PrefillHop`] on a discovery store, send it
//! [`GenerateRequest`]s and read each [`DecodeStream`] (the [`StreamExt`](futures_util::StreamExt) trait is imported
//! anonymously, for `.next()`), with the configuration and error types that path names. The
//! lower layers stay in their modules for frontends that need another arrangement.
//!
//! ```no_run
//! use prefill_router::prelude::*;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let discovery: Arc<dyn Discovery> = Arc::new(FileDiscovery::new(FileConfig::new("/tmp/pr")));
//! let hop = PrefillHop::start(discovery, "demo", PrefillHopConfig::default()).await?;
//! let mut tokens = hop.generate(GenerateRequest::new(vec![1, 2, 3], 4)).await?;
//! while let Some(response) = tokens.next().await {
//!     println!("{:?}", response?.token_ids);
//! }
//! hop.shutdown().await;
//! # Ok(()) }
//! ```

pub use std::sync::Arc;

pub use futures_util::StreamExt as _;

pub use crate::advert::DecodeDefaults;
pub use crate::decode::{DecodeError, DecodeStream};
pub use crate::discovery::{
    Discovery, DiscoveryError, FileConfig, FileDiscovery, MemoryConfig, MemoryDiscovery,
};
#[cfg(feature = "etcd")]
pub use crate::discovery::{EtcdConfig, EtcdDiscovery};
pub use crate::hop::{HopStartError, HopStatus, NotReady, PrefillHop, PrefillHopConfig, Readiness};
pub use crate::push::PushConfig;
pub use crate::request::{GenerateRequest, GenerateResponse};
pub use crate::router::{FallbackPolicy, GenerateError, PrefillRouterConfig};
