//! Bookkeeping of retired bindings that in-flight requests still hold.

use std::sync::{Arc, Weak};

/// How many retired bindings are tracked at most. Requests hold a retired binding only for
/// their own duration, so live ones are few; the cap bounds memory if a caller leaks `Arc`s.
pub(crate) const TRACK_CAP: usize = 64;

/// `Weak` references to retired bindings, pruned of dead ones on every retirement.
#[derive(Debug)]
pub(crate) struct Retired<B> {
    weak: Vec<Weak<B>>,
    /// Retired bindings pushed out of the full list while possibly still alive.
    untracked: u64,
}

impl<B> Retired<B> {
    pub(crate) fn new() -> Self {
        Retired {
            weak: Vec::new(),
            untracked: 0,
        }
    }

    pub(crate) fn track(&mut self, binding: &Arc<B>) {
        self.weak.retain(|w| w.strong_count() > 0);
        if self.weak.len() >= TRACK_CAP {
            self.weak.remove(0);
            self.untracked += 1;
        }
        self.weak.push(Arc::downgrade(binding));
    }

    /// Tracked retired bindings still referenced by someone (a request, or a stale snapshot
    /// that is about to drop).
    pub(crate) fn alive(&self) -> usize {
        self.weak.iter().filter(|w| w.strong_count() > 0).count()
    }

    pub(crate) fn untracked(&self) -> u64 {
        self.untracked
    }
}
