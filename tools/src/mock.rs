//! Mock engines for demos, tests and benchmarks, after Dynamo's mocker: no model, only the
//! timing shape of one.
//!
//! - [`MockPrefill`]: a prefill costs time in proportion to the prompt blocks *not* already in
//!   the worker's bounded KV block cache, and answers one token with [`PrefillInfo`] naming the
//!   worker and its cached-block hits (so callers can compute the prefix cache hit rate).
//! - [`MockDecode`]: emits tokens at a steady rate; without a prefill handoff it prefills the
//!   prompt locally first (the aggregated fallback), at the same per-block cost.
//! - [`spawn_registered`]: start an engine as a worker: served on loopback, registered in
//!   discovery.
//!
//! Block hashes are [`prefill_router::push::block_hashes`], the ones the KV dispatcher predicts with,
//! so a request routed to the worker that prefilled its prefix really finds it cached.
//!
//! [`PrefillInfo`]: prefill_router::request::PrefillInfo

mod cache;
mod engines;
mod worker;

pub use cache::{BlockCache, SnapshotCopy};
pub use engines::{output_token, MockConfig, MockDecode, MockPrefill, MockStats};
pub use worker::{spawn_registered, SpawnError};
