//! Trace replay: a request trace (the Mooncake conversation trace format)
//! played in virtual time through the real [`PrefillRouter`](prefill_router::router::PrefillRouter)
//! and the real dispatchers, over in-process prefill workers with a bounded KV block cache
//! and the cost model of [`CostModel`]. See `docs/replay.md`.
//!
//! Time is tokio's paused clock (as in [`crate::sim`]): the runtime jumps to the next timer
//! whenever every task waits, so an hour of trace replays in seconds and every run of one
//! configuration gives the same numbers.
//!
//! ```
//! use prefill_router_tools::replay::{parse_trace, run, Policy, ReplayConfig};
//!
//! let trace = parse_trace(
//!     "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 2, \"hash_ids\": [0, 1]}\n\
//!      {\"timestamp\": 5, \"input_length\": 700, \"output_length\": 2, \"hash_ids\": [0, 1]}\n"
//!         .as_bytes(),
//! )
//! .unwrap();
//! let report = run(&ReplayConfig::new(Policy::Kv), &trace).unwrap();
//! assert_eq!((report.requests, report.lost), (2, 0));
//! assert!(report.prefix_hit_rate <= report.ceiling);
//! ```

mod config;
mod cost;
mod engine;
mod external;
mod link;
mod policy;
mod report;
mod run;
mod sessions;
mod summary;
mod svg;
mod trace;
mod workload;

pub use config::{
    Join, JoinError, PoolEvent, ReplayConfig, ReplayError, Spread, EVENT_WINDOW, FLAP_DOWN,
    WAIT_FOR_HOP,
};
pub use cost::CostModel;
pub use external::{
    External, ExternalBlock, ExternalError, ExternalKvEvent, ExternalPolicy, ExternalRequest,
    ExternalRouter, ExternalSetup,
};
pub use policy::Policy;
pub use report::{
    AffinityReport, EventReport, JoinReport, JoinWindow, Percentiles, ReplayReport, Window,
    MATCH_POINTS,
};
pub use run::run;
pub use sessions::ClosedLoop;
pub use svg::{join_svg, svg};
pub use trace::{ceiling, parse_trace, read_trace, TraceError, TraceRecord, BLOCK_TOKENS};
pub use workload::{Workload, WorkloadError, CHAT_UNIT};
