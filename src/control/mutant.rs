//! Deliberately broken publication protocols, compiled only under `--cfg prefill_loom`, so the
//! loom suite can show that it catches them (a check that cannot fail proves nothing).

use std::sync::Arc;

use crate::lifecycle::Lifecycle;
use crate::route::{BypassReason, Route, Snapshot};
use crate::sync::ArcCell;

/// Which broken protocol a [`Control`](super::Control) uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// The correct protocol.
    None,
    /// Upstream's layout: the lifecycle (with target and bypass reason) and the binding live in
    /// two cells, written in upstream's order (publish: binding then lifecycle; retarget:
    /// clear binding then lifecycle; clear: lifecycle only, binding retained) and read as
    /// lifecycle gate then binding.
    TwoCells,
    /// The machine steps under the lock but the snapshot is stored after the lock is released.
    PublishOutsideLock,
}

pub(super) struct State<T, B> {
    mutant: Mutant,
    meta: ArcCell<Snapshot<T, B>>,
    binding: ArcCell<Option<Arc<B>>>,
}

impl<T: Clone, B> State<T, B> {
    pub(super) fn new(mutant: Mutant) -> Self {
        State {
            mutant,
            meta: ArcCell::new(Arc::new(Snapshot::initial())),
            binding: ArcCell::new(Arc::new(None)),
        }
    }

    pub(super) fn publishes_outside_lock(&self) -> bool {
        self.mutant == Mutant::PublishOutsideLock
    }

    /// Mirror `next` into the two cells in upstream's order (no-op unless `TwoCells`).
    pub(super) fn publish_two_cells(&self, next: &Snapshot<T, B>) {
        if self.mutant != Mutant::TwoCells {
            return;
        }
        let meta = Arc::new(Snapshot {
            lifecycle: next.lifecycle,
            // The gate cell carries no binding; when Active the reason is never read.
            route: match &next.route {
                Route::Prefill(_) => Route::Bypass(BypassReason::Building),
                Route::Bypass(r) => Route::Bypass(*r),
            },
            target: next.target.clone(),
            build: next.build,
            epoch: next.epoch,
        });
        match next.binding() {
            Some(b) => {
                self.binding.swap(Arc::new(Some(Arc::clone(b))));
                self.meta.swap(meta);
            }
            None if next.lifecycle == Lifecycle::Pending => {
                self.binding.swap(Arc::new(None));
                self.meta.swap(meta);
            }
            None => {
                self.meta.swap(meta);
            }
        }
    }

    /// Under `TwoCells`, the upstream read: gate load, then binding load if Active.
    pub(super) fn load(&self) -> Option<Arc<Snapshot<T, B>>> {
        if self.mutant != Mutant::TwoCells {
            return None;
        }
        let meta = self.meta.load();
        let route = if meta.lifecycle == Lifecycle::Active {
            match &*self.binding.load() {
                Some(b) => Route::Prefill(Arc::clone(b)),
                None => Route::Bypass(BypassReason::Building),
            }
        } else {
            meta.route.clone()
        };
        Some(Arc::new(Snapshot {
            lifecycle: meta.lifecycle,
            route,
            target: meta.target.clone(),
            build: meta.build,
            epoch: meta.epoch,
        }))
    }
}
