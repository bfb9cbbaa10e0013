//! The tokio adapter: [`PrefillRouter`] drives the [`Control`](crate::control::Control) core
//! with real builds, timers and a request path (feature `runtime`).
//!
//! - [`PrefillRouter`]: `set_target` (synchronous), `route`, `generate` (prefill with
//!   `max_tokens` 1, then [`decode::Decode`](crate::decode::Decode)), `status`, `subscribe`,
//!   `wait_active`, `shutdown`. It points the hop at a
//!   [`binding::WorkerSetTarget`](crate::binding::WorkerSetTarget) and has its
//!   [`binding::BindingFactory`](crate::binding::BindingFactory) build a
//!   [`binding::Binding`](crate::binding::Binding) for it (async, cancellable, fallible, under
//!   a build timeout).
//! - [`FallbackPolicy`]: what requests do while the hop is not Active.
//! - [`ConditionalPolicy`]: per request, skip the remote prefill when it gains nothing
//!   (off by default; [`conditional`]).
//! - [`metrics`]: Prometheus metrics read from the status at scrape time.
//!
//! The router speaks to the real parts only through their seams: [`crate::request`] (what a
//! request is), [`crate::binding`]'s traits (what a binding does and how it fails) and
//! [`crate::decode`]'s (what the decode hop does). The driver loop and its contract are
//! described in `docs/router.md`.

pub mod conditional;
mod config;
mod continuation;
mod driver;
mod error;
mod fallback;
mod handle;
mod handoffs;
pub mod metrics;
mod mutant;
mod shared;
mod status;

pub use conditional::{ConditionalPolicy, ConditionalSkip};
pub use config::PrefillRouterConfig;
pub use error::{GenerateError, WaitError};
pub use fallback::{AfterWait, FallbackPolicy};
pub use handle::{PrefillRouter, MAX_REROUTES};
pub use handoffs::HandoffCounts;
pub use status::{RouterCounters, RouterStatus};

#[cfg(test)]
pub(crate) use mutant::{PauseBeforeDispatch, RouterMutant};

#[cfg(test)]
mod tests;
