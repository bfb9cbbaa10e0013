//! Normal builds: every hook is zero-sized and does exactly what the real code does, inlined.

use std::marker::PhantomData;
use std::sync::Arc;

#[cfg(feature = "runtime")]
use crate::snapshot::Route;
use crate::snapshot::{RouteCell, Snapshot, SnapshotGuard};

/// The control core's hooks: its publication protocol, as is.
pub(crate) struct ControlHooks<T, B>(PhantomData<fn() -> (T, B)>);

impl<T, B> Default for ControlHooks<T, B> {
    #[inline(always)]
    fn default() -> Self {
        ControlHooks(PhantomData)
    }
}

impl<T, B> ControlHooks<T, B> {
    /// A request's load of the published snapshot.
    #[inline(always)]
    pub(crate) fn load(&self, cell: &RouteCell<T, B>) -> SnapshotGuard<T, B> {
        cell.load()
    }

    /// The end of a step's critical section: nothing is dropped under the lock.
    #[inline(always)]
    pub(crate) fn before_unlock<X, Y>(&self, _trash: &mut X, _built: &mut Option<Y>) {}

    /// Publish `next` (if any) while `guard` still holds the lock, then release it; returns
    /// the snapshot it replaced, for the caller to drop after the lock.
    #[inline(always)]
    pub(crate) fn publish_and_unlock<G>(
        &self,
        cell: &RouteCell<T, B>,
        next: Option<Arc<Snapshot<T, B>>>,
        guard: G,
    ) -> Option<Arc<Snapshot<T, B>>> {
        let old = next.map(|next| cell.swap(next));
        drop(guard);
        old
    }
}

/// The prefill router's hooks: requests read the route `Control` publishes.
#[cfg(feature = "runtime")]
pub(crate) struct RouterHooks<B>(PhantomData<fn() -> B>);

#[cfg(feature = "runtime")]
impl<B> Default for RouterHooks<B> {
    #[inline(always)]
    fn default() -> Self {
        RouterHooks(PhantomData)
    }
}

#[cfg(feature = "runtime")]
impl<B> RouterHooks<B> {
    /// The route for one request: the real one.
    #[inline(always)]
    pub(crate) fn route(&self, real: impl FnOnce() -> Route<B>) -> Route<B> {
        real()
    }

    /// A build finished: nothing to refresh.
    #[inline(always)]
    pub(crate) fn build_finished(&self, _route: impl FnOnce() -> Route<B>) {}

    /// Between the conditional probe and the dispatch: nothing happens.
    #[inline(always)]
    pub(crate) fn after_probe(&self) -> std::future::Ready<()> {
        std::future::ready(())
    }

    /// The binding a probed request dispatches on: the one it probed.
    #[inline(always)]
    pub(crate) fn dispatch_binding(
        &self,
        probed: Arc<B>,
        _reload: impl FnOnce() -> Route<B>,
    ) -> Arc<B> {
        probed
    }
}

/// The binding factory's hooks: views honour the admission set.
#[cfg(feature = "runtime")]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FactoryHooks(());

#[cfg(feature = "runtime")]
impl FactoryHooks {
    /// Whether views ignore the admission set: never.
    #[inline(always)]
    pub(crate) const fn ignores_admission(&self) -> bool {
        false
    }

    /// The session-affinity table of a new binding's dispatcher: the fresh one it was given.
    #[inline(always)]
    pub(crate) fn affinity_table(
        &self,
        fresh: Option<Arc<crate::push::AffinityTable>>,
    ) -> Option<Arc<crate::push::AffinityTable>> {
        fresh
    }
}

/// The dispatcher's hooks: a retry never picks a worker that failed the request.
#[cfg(feature = "runtime")]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct DispatchHooks(());

#[cfg(feature = "runtime")]
impl DispatchHooks {
    /// Whether a failed worker is excluded from the request's later attempts: always.
    #[inline(always)]
    pub(crate) const fn excludes_failed(&self) -> bool {
        true
    }

    /// Whether a session's remembered worker must be routable (admitted, discovered, breaker
    /// closed) to get the request: always.
    #[inline(always)]
    pub(crate) const fn affinity_checks_routable(&self) -> bool {
        true
    }

    /// Whether a reconnect or a closed connection drops the worker's KV index entries: always.
    #[inline(always)]
    pub(crate) const fn resets_kv_on_reconnect(&self) -> bool {
        true
    }
}

/// The discovery watchers' known-set hooks: a resync diffs against what is known.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct KnownHooks(());

impl KnownHooks {
    /// Whether a resync forgets what is known before diffing: never.
    #[inline(always)]
    pub(crate) const fn is_blind_resync(&self) -> bool {
        false
    }
}

// The hooks cost nothing in normal builds: none adds a byte to the type holding it.
const _: () = {
    use std::mem::size_of;
    assert!(size_of::<ControlHooks<u64, [u8; 64]>>() == 0);
    #[cfg(feature = "runtime")]
    assert!(size_of::<RouterHooks<[u8; 64]>>() == 0);
    #[cfg(feature = "runtime")]
    assert!(size_of::<FactoryHooks>() == 0);
    #[cfg(feature = "runtime")]
    assert!(size_of::<DispatchHooks>() == 0);
    assert!(size_of::<KnownHooks>() == 0);
};
