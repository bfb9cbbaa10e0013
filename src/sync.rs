//! The only module that names concrete synchronisation primitives.
//!
//! Normal builds use `parking_lot` for the control lock and `arc-swap` for the published
//! snapshot. Under `--cfg prefill_loom` both map to `loom` types so that loom can preempt at
//! every access. Neither `arc-swap` nor `parking_lot` has loom support: loom cannot schedule
//! inside them, so running the real ones under a loom model would glue each of their
//! operations to the previous loom operation and hide interleavings (see `docs/concurrency.md`).
//! The cfg is crate-specific, so no dependency (tokio has `cfg(loom)` code) changes behaviour.

use std::sync::Arc;

/// A non-poisoning mutex with parking_lot's API shape.
pub(crate) struct Mutex<T>(
    #[cfg(not(prefill_loom))] parking_lot::Mutex<T>,
    #[cfg(prefill_loom)] loom::sync::Mutex<T>,
);

/// The guard of [`Mutex`].
#[cfg(not(prefill_loom))]
pub(crate) type MutexGuard<'a, T> = parking_lot::MutexGuard<'a, T>;
/// The guard of [`Mutex`].
#[cfg(prefill_loom)]
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        #[cfg(not(prefill_loom))]
        {
            Mutex(parking_lot::Mutex::new(value))
        }
        #[cfg(prefill_loom)]
        {
            Mutex(loom::sync::Mutex::new(value))
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        #[cfg(not(prefill_loom))]
        {
            self.0.lock()
        }
        #[cfg(prefill_loom)]
        {
            // A loom mutex is only poisoned by a panicking model thread, which already fails
            // the model; recover the data rather than panic a second time.
            self.0
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        }
    }

    /// Whether some thread holds the lock (for tests that check where work happens).
    #[cfg(not(prefill_loom))]
    pub(crate) fn is_locked(&self) -> bool {
        self.0.is_locked()
    }
}

/// A read guard of an [`ArcCell`]: derefs to the `Arc<S>` that was current at load time.
///
/// Normally an `arc_swap::Guard`, which pins the snapshot without touching its reference count
/// (the hot path's whole point). Under loom it is a plain cloned `Arc`.
#[cfg(not(prefill_loom))]
pub type CellGuard<S> = arc_swap::Guard<Arc<S>>;
/// A read guard of an [`ArcCell`]: derefs to the `Arc<S>` that was current at load time.
#[cfg(prefill_loom)]
pub type CellGuard<S> = Arc<S>;

/// A linearizable cell holding an `Arc<S>`: lock-free loads, whole-value stores.
///
/// Normally `arc_swap::ArcSwap<S>` (every operation contains a SeqCst read-modify-write, so all
/// operations on one cell are totally ordered). Under loom, a `loom::sync::Mutex<Arc<S>>`: a
/// linearizable register whose every access is a loom scheduling point.
pub(crate) struct ArcCell<S> {
    #[cfg(not(prefill_loom))]
    inner: arc_swap::ArcSwap<S>,
    #[cfg(prefill_loom)]
    inner: loom::sync::Mutex<Arc<S>>,
}

impl<S> ArcCell<S> {
    pub(crate) fn new(value: Arc<S>) -> Self {
        #[cfg(not(prefill_loom))]
        {
            ArcCell {
                inner: arc_swap::ArcSwap::new(value),
            }
        }
        #[cfg(prefill_loom)]
        {
            ArcCell {
                inner: loom::sync::Mutex::new(value),
            }
        }
    }

    /// The current value, pinned by a guard (no reference-count traffic in normal builds).
    #[inline]
    pub(crate) fn load(&self) -> CellGuard<S> {
        #[cfg(not(prefill_loom))]
        {
            self.inner.load()
        }
        #[cfg(prefill_loom)]
        {
            Arc::clone(&self.inner.lock().unwrap_or_else(|p| p.into_inner()))
        }
    }

    /// Replace the value; the previous one is handed back so the caller chooses where it drops.
    pub(crate) fn swap(&self, value: Arc<S>) -> Arc<S> {
        #[cfg(not(prefill_loom))]
        {
            self.inner.swap(value)
        }
        #[cfg(prefill_loom)]
        {
            std::mem::replace(
                &mut *self.inner.lock().unwrap_or_else(|p| p.into_inner()),
                value,
            )
        }
    }
}
