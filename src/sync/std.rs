//! Normal builds: `parking_lot` for the control lock, `arc-swap` for the published snapshot.

use std::sync::Arc;

/// A non-poisoning mutex (parking_lot's).
pub(crate) struct Mutex<T>(parking_lot::Mutex<T>);

/// The guard of [`Mutex`].
pub(crate) type MutexGuard<'a, T> = parking_lot::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Mutex(parking_lot::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock()
    }

    /// Whether some thread holds the lock (for tests that check where work happens).
    #[cfg(test)]
    pub(crate) fn is_locked(&self) -> bool {
        self.0.is_locked()
    }
}

/// A read guard of an [`ArcCell`]: an `arc_swap::Guard`, which pins the snapshot without
/// touching its reference count (the hot path's whole point).
pub(crate) type CellGuard<S> = arc_swap::Guard<Arc<S>>;

/// A linearizable cell holding an `Arc<S>`: `arc_swap::ArcSwap<S>`, whose every operation
/// contains a SeqCst read-modify-write, so all operations on one cell are totally ordered.
pub(crate) struct ArcCell<S>(arc_swap::ArcSwap<S>);

impl<S> ArcCell<S> {
    pub(crate) fn new(value: Arc<S>) -> Self {
        ArcCell(arc_swap::ArcSwap::new(value))
    }

    /// The current value, pinned by a guard (no reference-count traffic).
    #[inline]
    pub(crate) fn load(&self) -> CellGuard<S> {
        self.0.load()
    }

    /// Replace the value; the previous one is handed back so the caller chooses where it drops.
    pub(crate) fn swap(&self, value: Arc<S>) -> Arc<S> {
        self.0.swap(value)
    }
}
