//! # prefill-router
//!
//! Routes the *prefill hop* of disaggregated LLM serving while the prefill pool appears, rolls
//! to a new generation, shrinks or disappears.
//!
//! - [`lifecycle`]: the pure retarget state machine (Pending / Active / Unavailable, binding
//!   reuse, stale-build rejection, retry with backoff). No I/O, no clock, no locks.
//! - [`advert`]: pure resolution of the prefill workers' model cards into the hop's
//!   configuration (router mode, KV tuning, block size, session affinity).
//! - [`discovery`]: where workers register instances and model cards, and where frontends
//!   list and watch them; backends in memory, in a shared directory (the embedded default) and
//!   on etcd (feature `etcd`), all behind one trait and one conformance suite
//!   (`docs/discovery.md`).
//!
//! See `docs/design.md` for the machine and `docs/properties.md` for what is proven and how.

pub mod advert;
pub mod discovery;
pub mod lifecycle;
