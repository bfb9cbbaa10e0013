//! Bindings: what the router prefills through, and the default factory building them.
//!
//! # The seam
//!
//! A binding implements [`Binding`] (prefill a request into a [`PrefillOutcome`], pick and hold
//! a worker as a [`PrefillPick`] reporting a [`PrefillEstimate`], report its [`BindingHealth`])
//! and fails with [`PrefillError`]. A [`BindingFactory`] builds one per [`WorkerSetTarget`]
//! (one generation of a prefill worker set, what the controller points the hop at) or fails
//! with [`BuildError`]. The router speaks only these words to a binding.
//!
//! # The default factory
//!
//! What a prefill target becomes over real discovery and dispatchers. A build (see
//! [`DefaultBindingFactory`]):
//! 1. resolves the hop's configuration from exactly `[target.card]` (the committed, first-wins
//!    card; the raw per-worker cards are ignored, as upstream's committed targets do);
//! 2. opens the endpoint's discovery watch and builds a [`RoutableView`] over it with the
//!    target's admission set, its feed task bound to a token the binding cancels on drop;
//! 3. waits until at least one admitted instance is routable (so activation means requests can
//!    be served; an empty admission set makes the build wait until the router's build timeout);
//! 4. builds the [`Dispatcher`] in the resolved mode and block size;
//! 5. logs the resolved configuration in the `prefill_binding` span (as upstream logs it).
//!
//! [`RoutableView`]: crate::push::RoutableView
//! [`Dispatcher`]: crate::push::Dispatcher

mod contract;
mod factory;
mod load;
mod target;

pub use contract::{
    Binding, BindingFactory, BindingHealth, BuildError, PrefillError, PrefillEstimate,
    PrefillOutcome, PrefillPick,
};
pub use load::TokenLoad;
pub use target::{WorkerSetTarget, WorkerSetTargetId};

pub use factory::{
    BindingStats, DefaultBindingFactory, FactoryConfig, PrefillBinding, DISCOVERY_CATCH_UP,
};
