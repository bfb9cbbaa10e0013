//! The default binding factory: what a prefill target becomes over real discovery and push
//! routers, and the decode hop over a decode dispatcher.
//!
//! A build (see [`DefaultBindingFactory`]):
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

mod decode;
mod factory;
mod load;

pub use decode::DecodePool;
pub use load::TokenLoad;

pub use factory::{
    BindingStats, DefaultBindingFactory, FactoryConfig, PrefillBinding, DISCOVERY_CATCH_UP,
};
