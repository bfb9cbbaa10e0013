//! Dynamo's own KV router, the `dynamo-kv-router` crate (1.6.1), as a policy of
//! prefill-router's trace replay: the replay's [`ExternalPolicy`] seam implemented with the
//! crate's radix-tree indexer, its `DefaultWorkerSelector` at its default `KvRouterConfig`, and
//! its `LocalScheduler` over its own active-sequence tracking (`ActiveSequencesMultiWorker`),
//! which books each request at the pick and frees it when its prefill ends.
//!
//! ```no_run
//! use prefill_router_tools::replay::{run, Policy, ReplayConfig, Workload};
//!
//! let trace = Workload::parse("shared-prefix:rate=5,requests=200").unwrap().generate();
//! let config = ReplayConfig {
//!     external: Some(dynamo_replay::DynamoCrate::default().into_external()),
//!     ..ReplayConfig::new(Policy::External)
//! };
//! let report = run(&config, &trace).unwrap();
//! assert_eq!(report.policy, "dynamo-crate");
//! ```
//!
//! [`ExternalPolicy`]: prefill_router_tools::replay::ExternalPolicy

mod indexer;
mod router;

pub use indexer::{Indexer, IndexerError};
pub use router::{DynamoCrate, DynamoRouter, POLICY_NAME};
