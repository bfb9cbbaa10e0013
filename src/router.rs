//! The tokio adapter: [`PrefillRouter`] drives the [`Control`](crate::control::Control) core
//! with real builds, timers and a request path (feature `runtime`).
//!
//! - [`WorkerSetTarget`]: what the controller points the hop at (id = group and generation).
//! - [`BindingFactory`]: builds a binding ([`Prefill`]) for a target; async, cancellable,
//!   fallible, under a build timeout.
//! - [`PrefillRouter`]: `set_target` (synchronous), `route`, `generate` (prefill with
//!   `max_tokens` 1, then [`Decode`]), `status`, `subscribe`, `wait_active`, `shutdown`.
//! - [`FallbackPolicy`]: what requests do while the hop is not Active.
//! - [`ConditionalPolicy`]: per request, skip the remote prefill when it gains nothing
//!   (off by default; [`conditional`]).
//! - [`metrics`]: Prometheus metrics read from the status at scrape time.
//!
//! The driver loop and its contract are described in `docs/router.md`.

pub mod conditional;
mod config;
mod driver;
mod error;
mod fallback;
mod handle;
mod legs;
pub mod metrics;
mod mutant;
mod shared;
mod status;
mod target;

pub use conditional::{ConditionalPolicy, ConditionalSkip, PrefillEstimate};
pub use config::PrefillRouterConfig;
pub use error::{GenerateError, WaitError};
pub use fallback::{AfterWait, FallbackPolicy};
pub use handle::{PrefillRouter, MAX_REROUTES};
pub use legs::{
    BindingFactory, BindingHealth, BuildError, Decode, DecodeError, DecodeStream, Prefill,
    PrefillError, PrefillOutcome, PrefillPick,
};
pub use status::{RouterCounters, RouterStatus};
pub use target::{WorkerSetTarget, WorkerSetTargetId};

#[cfg(test)]
pub(crate) use mutant::{ProbeHook, RouterMutant};

#[cfg(test)]
mod tests;
