//! # prefill-router
//!
//! Routes the *prefill hop* of disaggregated LLM serving while the prefill pool appears, rolls
//! to a new generation, shrinks or disappears.
//!
//! - [`lifecycle`]: the pure retarget state machine (Pending / Active / Unavailable, binding
//!   reuse, stale-build rejection, retry with backoff). No I/O, no clock, no locks.
//! - [`route`]: the published view requests read: one immutable snapshot per change in one
//!   lock-free cell, answering [`route::Route`] (prefill on a binding, or bypass and why).
//! - [`control`]: the synchronous, thread-safe control core driving the machine and publishing
//!   snapshots; loom-checked (`docs/concurrency.md`).
//! - [`advert`]: pure resolution of the prefill workers' model cards into the hop's
//!   configuration (router mode, KV tuning, block size, session affinity).
//!
//! See `docs/design.md` for the machine and `docs/properties.md` for what is proven and how.

pub mod advert;
pub mod control;
pub mod discovery;
pub mod lifecycle;
pub mod route;
mod sync;

#[cfg(feature = "testkit")]
#[doc(hidden)]
pub mod testkit;
