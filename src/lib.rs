//! # prefill-router
//!
//! Routes the *prefill hop* of disaggregated LLM serving while the prefill pool appears, rolls
//! to a new generation, shrinks or disappears.
//!
//! - [`lifecycle`]: the pure retarget state machine (Pending / Active / Unavailable, binding
//!   reuse, stale-build rejection, retry with backoff). No I/O, no clock, no locks.
//! - [`advert`]: pure resolution of the prefill workers' model cards into the hop's
//!   configuration (router mode, KV tuning, block size, session affinity).
//!
//! See `docs/design.md` for the machine and `docs/properties.md` for what is proven and how.

pub mod advert;
pub mod discovery;
pub mod lifecycle;

#[cfg(feature = "testkit")]
#[doc(hidden)]
pub mod testkit;
