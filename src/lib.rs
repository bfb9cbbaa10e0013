//! # prefill-router
//!
//! Routes the *prefill hop* of disaggregated LLM serving while the prefill pool appears, rolls
//! to a new generation, shrinks or disappears.
//!
//! - [`lifecycle`]: the pure retarget state machine (Pending / Active / Unavailable, binding
//!   reuse, stale-build rejection, retry with backoff). No I/O, no clock, no locks.
//! - [`health`]: the pure worker-health machine: a circuit breaker per instance in discovery,
//!   probed with capped, jittered backoff; only connection-level failures count. No I/O, no clock.
//! - [`snapshot`]: the published state requests read: one immutable snapshot per change in one
//!   lock-free cell, answering [`snapshot::Route`] (prefill on a binding, or bypass and why).
//! - [`batch`]: the one inline output batch both the machine and the control core return.
//! - [`control`]: the synchronous, thread-safe control core driving the machine and publishing
//!   snapshots; loom-checked (`docs/concurrency.md`).
//! - [`advert`]: pure resolution of the prefill workers' model cards into the hop's
//!   configuration (router mode, KV tuning, block size, session affinity).
//! - [`request`]: the request vocabulary every seam speaks (`GenerateRequest`,
//!   `GenerateResponse`, `FinishReason`, the prefill handoff `PrefillInfo`); plain data.
//! - [`transport`] (feature `runtime`): the TCP request plane; a worker serves an `Engine`, a
//!   frontend multiplexes streamed requests over one connection per instance.
//! - [`push`] (feature `runtime`): the routable-instance view and the dispatchers (round
//!   robin, random, direct, KV prefix-aware).
//! - [`load_report`]: the workers' load reports and the frontends' reconciliation rule (own
//!   bookings plus the others' reported work; pure, model-checked in `model/`).
//! - [`kv_events`]: the workers' KV cache events (wire format, publisher) and the index of
//!   real caches the KV dispatcher scores from (`docs/kv_events.md`).
//! - [`router`] (feature `runtime`): the tokio adapter, `PrefillRouter`, driving the control
//!   core with real builds and timers, plus the request path and its fallback policy. It
//!   speaks to the real parts only through the seams [`request`], [`binding`] and [`decode`].
//! - [`binding`] (feature `runtime`): the binding seam (the `Binding` and `BindingFactory`
//!   traits, their outcomes and errors, the `WorkerSetTarget` a binding is built for) and the
//!   default factory (card resolution, routable view with admission, dispatcher).
//! - [`decode`] (feature `runtime`): the decode hop: the `Decode` trait and its error, a
//!   decode pool over one dispatcher, and the decode hop following the topology's decode set.
//! - [`topology`]: the pure topology machine turning a namespace's discovery events into the
//!   prefill router's target (one prefill set, one decode set, first-wins admission,
//!   generations), and (feature `runtime`) the watcher driving it.
//! - [`hop`] (feature `runtime`): [`PrefillHop`], the one handle a frontend embeds: the
//!   topology watcher, the prefill router and the decode hop following the decode set.
//! - [`http`] (feature `http`): the OpenAI-compatible HTTP frontend over a [`PrefillHop`].
//! - [`discovery`]: where workers register instances and model cards, and where frontends
//!   list and watch them; backends in memory, in a shared directory (the embedded default) and
//!   on etcd (feature `etcd`), all behind one trait and one conformance suite
//!   (`docs/discovery.md`).
//!
//! The simulator, trace replay, the mock engines and the `prefill-router` binary are the
//! workspace package `prefill-router-tools` (`tools/`), not part of this library.
//!
//! See `docs/design.md` for the machine, `docs/properties.md` for what is proven and how, and
//! `docs/transport.md` for the request plane.

pub mod advert;
pub mod batch;
#[cfg(feature = "runtime")]
pub mod binding;
pub mod control;
#[cfg(feature = "runtime")]
pub mod decode;
pub mod discovery;
#[cfg(feature = "engine")]
pub mod engine;
pub mod handoff;
pub mod health;
mod hooks;
#[cfg(feature = "runtime")]
pub mod hop;
#[cfg(feature = "http")]
pub mod http;
pub mod kv_events;
pub mod lifecycle;
pub mod load_report;
pub mod migration;
#[cfg(feature = "runtime")]
pub mod prelude;
#[cfg(feature = "runtime")]
pub mod push;
pub mod request;
pub mod rng;
#[cfg(feature = "runtime")]
pub mod router;
pub mod snapshot;
mod sync;
#[cfg(all(test, feature = "runtime"))]
mod test_engine;
pub mod topology;
#[cfg(feature = "runtime")]
pub mod transport;

#[cfg(feature = "runtime")]
pub use hop::{HopStartError, HopStatus, NotReady, PrefillHop, PrefillHopConfig, Readiness};

// The README's Rust blocks (the embedder example) compile as doctests of the library.
#[cfg(all(doctest, feature = "runtime"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
