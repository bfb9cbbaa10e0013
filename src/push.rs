//! Push routers: pick a routable worker instance for each request and send it over the request
//! plane ([`crate::transport`]).
//!
//! - [`RoutableView`]: instances from a discovery event stream, intersected with an optional
//!   admission set, minus instances whose connection failed (until discovery re-adds them).
//! - [`PushRouter`]: modes [`PushMode::RoundRobin`], [`PushMode::Random`],
//!   [`PushMode::Direct`] and [`PushMode::Kv`] (approximate prefix-aware selection, see
//!   [`KvSelector`]).

mod error;
mod kv;
mod router;
mod view;

pub use error::PushError;
#[cfg(feature = "sim")]
pub(crate) use kv::mix;
pub use kv::{block_hashes, KvSelector};
pub use router::{PushConfig, PushMode, PushRouter, RoutedStream, Selection};
pub use view::{InstanceStatus, RoutableView};
