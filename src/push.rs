//! Dispatchers: pick a routable worker instance for each request and send it over the request
//! plane ([`crate::transport`]).
//!
//! - [`RoutableView`]: instances from a discovery event stream, intersected with an optional
//!   admission set, minus instances whose health breaker is open (a connection failed; a probe
//!   on a capped backoff closes it again, see [`failure_class`] and docs/health.md).
//! - [`Dispatcher`]: modes [`PushMode::RoundRobin`], [`PushMode::Random`],
//!   [`PushMode::Direct`] and [`PushMode::Kv`] (approximate prefix-aware selection, see
//!   [`KvSelector`], costed by [`select`]), each with optional session affinity ([`Dispatcher::with_session_affinity`]:
//!   a session's requests go to the first routable worker of its rendezvous order, the same
//!   on every frontend that sees the same routable set; [`rendezvous_order`]).
//! - [`WorkerLink`]: the dispatcher's send step, the one seam between choosing a worker and
//!   reaching it: [`TcpLink`] (the request plane) in production, an in-memory link in the
//!   simulator, which thereby runs the dispatcher's own select, book, send, retry and release.

mod affinity;
mod dispatcher;
mod error;
mod health;
pub mod heat;
mod kv;
mod kv_feed;
mod load_board;
mod mutant;
pub mod own_work;
pub mod select;
#[cfg(test)]
mod tests;
mod view;

pub use affinity::{
    rendezvous_first, rendezvous_order, rendezvous_weight, session_key, AffinityCounts,
    AffinityOutcome, AffinityStats, AffinityTable, DEFAULT_AFFINITY_CAPACITY,
};
pub use dispatcher::{
    Dispatch, Dispatcher, HeldPick, Link, LinkStream, OverloadCounts, OverloadStats, PushConfig,
    PushMode, RoutedStream, TcpLink, WorkerLink,
};
pub use error::{Attempt, PushError, RetryCounts};
pub use health::{failure_class, Prober, PROBE_TIMEOUT};
pub use kv::{block_hashes, KvSelector, DEEP_HOLDERS_LIMIT};
#[cfg(feature = "engine")]
pub(crate) use kv_feed::KvFeed;
pub use kv_feed::{KvDecisionCounts, KvEventCounts};
pub use load_board::{LoadBoard, Walk, RECENT_WORK_HALF_LIFE};
#[cfg(test)]
pub(crate) use mutant::DispatchMutant;

pub use view::{InstanceStatus, RoutableView};
