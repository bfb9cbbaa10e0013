//! Under `--cfg prefill_loom`: loom types, so that loom can preempt at every access.

use std::sync::Arc;

/// A mutex that never reports poisoning.
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

/// The guard of [`Mutex`].
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Mutex(loom::sync::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        // A loom mutex is only poisoned by a panicking model thread, which already fails the
        // model; recover the data rather than panic a second time.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A read guard of an [`ArcCell`]: a plain cloned `Arc`.
pub(crate) type CellGuard<S> = Arc<S>;

/// A linearizable cell holding an `Arc<S>`: a `loom::sync::Mutex<Arc<S>>`, a linearizable
/// register whose every access is a loom scheduling point.
pub(crate) struct ArcCell<S>(loom::sync::Mutex<Arc<S>>);

impl<S> ArcCell<S> {
    pub(crate) fn new(value: Arc<S>) -> Self {
        ArcCell(loom::sync::Mutex::new(value))
    }

    /// The current value (a cloned `Arc`).
    #[inline]
    pub(crate) fn load(&self) -> CellGuard<S> {
        Arc::clone(&self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Replace the value; the previous one is handed back so the caller chooses where it drops.
    pub(crate) fn swap(&self, value: Arc<S>) -> Arc<S> {
        std::mem::replace(
            &mut *self.0.lock().unwrap_or_else(|p| p.into_inner()),
            value,
        )
    }
}
