//! The prefill router's deliberate mutants of its request path, the test hook between a
//! conditional estimate and its dispatch, and the seam where they act (see `crate::hooks`).

use std::sync::{Arc, Mutex, MutexGuard};

use futures_util::future::{BoxFuture, OptionFuture};

use crate::hooks::{Seam, ARMABLE};
#[cfg(test)]
use crate::snapshot::BypassReason;
use crate::snapshot::Route;

/// A deliberate mutant of the router's request path (see `PrefillRouter::with_mutant`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RouterMutant {
    /// Requests read a route the driver refreshes when a build finishes, not the cell
    /// `set_target` publishes into (upstream's asynchronous binding store); the request-path
    /// race test must catch it.
    #[cfg_attr(not(test), allow(dead_code))]
    LaggingRoute,
    /// An estimated request's dispatch loads the route again instead of using the binding that estimated it
    /// (upstream's W10); the retarget-between-estimate-and-dispatch test must catch it.
    ReloadForDispatch,
}

/// What a test runs between a request's conditional estimate and its dispatch.
pub(crate) type PauseBeforeDispatch = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// The router's seam: the request path as is unless a mutant or the pause before dispatch is armed.
/// Zero-sized in normal builds.
pub(crate) struct RouterSeam<B> {
    mutant: Seam<RouterMutant>,
    /// The `LaggingRoute` mutant's copy of the route.
    lagging: Seam<Mutex<Route<B>>>,
    before_dispatch: Seam<PauseBeforeDispatch>,
}

const _: () = assert!(ARMABLE || std::mem::size_of::<RouterSeam<[u8; 64]>>() == 0);

impl<B> Default for RouterSeam<B> {
    #[inline(always)]
    fn default() -> Self {
        RouterSeam {
            mutant: Seam::off(),
            lagging: Seam::off(),
            before_dispatch: Seam::off(),
        }
    }
}

impl<B> RouterSeam<B> {
    /// The seam running `mutant` (if any) and awaiting `hook` (if any) between each
    /// conditional estimate and its dispatch.
    #[cfg(test)]
    pub(crate) fn on(mutant: Option<RouterMutant>, hook: Option<PauseBeforeDispatch>) -> Self {
        let lagging = Route::Bypass(BypassReason::NotYetTargeted);
        RouterSeam {
            mutant: mutant.map_or(Seam::off(), Seam::on),
            lagging: match mutant {
                Some(RouterMutant::LaggingRoute) => Seam::on(Mutex::new(lagging)),
                _ => Seam::off(),
            },
            before_dispatch: hook.map_or(Seam::off(), Seam::on),
        }
    }

    fn lagging(&self) -> Option<MutexGuard<'_, Route<B>>> {
        let lagging = self.lagging.armed()?;
        Some(lagging.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The route for one request: the real one (`LaggingRoute`: the lagging copy).
    #[inline(always)]
    pub(crate) fn route(&self, real: impl FnOnce() -> Route<B>) -> Route<B> {
        match self.lagging() {
            Some(lagging) => lagging.clone(),
            None => real(),
        }
    }

    /// A build finished: nothing to refresh (`LaggingRoute`: the copy catches up with `route`).
    #[inline(always)]
    pub(crate) fn build_finished(&self, route: impl FnOnce() -> Route<B>) {
        if let Some(mut lagging) = self.lagging() {
            *lagging = route();
        }
    }

    /// Between the conditional estimate and the dispatch: nothing happens (or the test's hook).
    #[inline(always)]
    pub(crate) fn before_dispatch(&self) -> OptionFuture<BoxFuture<'static, ()>> {
        self.before_dispatch.armed().map(|hook| hook()).into()
    }

    /// The binding an estimated request dispatches on: the one that estimated it
    /// (`ReloadForDispatch`: whatever the route says now).
    #[inline(always)]
    pub(crate) fn dispatch_binding(
        &self,
        estimated: Arc<B>,
        reload: impl FnOnce() -> Route<B>,
    ) -> Arc<B> {
        if !self.mutant.is(RouterMutant::ReloadForDispatch) {
            return estimated;
        }
        match reload() {
            Route::Prefill(now) => now,
            Route::Bypass(_) => estimated,
        }
    }
}
