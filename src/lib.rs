//! # prefill-router
//!
//! Routes the *prefill hop* of disaggregated LLM serving while the prefill pool appears, rolls
//! to a new generation, shrinks or disappears.
//!
//! - [`lifecycle`]: the pure retarget state machine (Pending / Active / Unavailable, binding
//!   reuse, stale-build rejection, retry with backoff). No I/O, no clock, no locks.
//! - [`advert`]: pure resolution of the prefill workers' model cards into the hop's
//!   configuration (router mode, KV tuning, block size, session affinity).
//! - [`transport`] (feature `runtime`): the TCP request plane; a worker serves an `Engine`, a
//!   frontend multiplexes streamed requests over one connection per instance.
//! - [`push`] (feature `runtime`): the routable-instance view and the push routers (round
//!   robin, random, direct, KV prefix-aware).
//!
//! See `docs/design.md` for the machine, `docs/properties.md` for what is proven and how, and
//! `docs/transport.md` for the request plane.

pub mod advert;
pub mod discovery;
pub mod lifecycle;
#[cfg(feature = "runtime")]
pub mod push;
#[cfg(feature = "runtime")]
pub mod transport;
