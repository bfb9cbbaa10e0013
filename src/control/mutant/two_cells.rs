//! The `TwoCells` mutant's state (loom only): upstream's publication in two cells, so the loom
//! suite can show that it catches the torn reads that layout allows.

use std::sync::Arc;

use crate::lifecycle::Lifecycle;
use crate::snapshot::{BypassReason, Route, Snapshot};
use crate::sync::ArcCell;

/// The lifecycle gate cell and the binding cell.
pub(super) struct TwoCells<T, B> {
    meta: ArcCell<Snapshot<T, B>>,
    binding: ArcCell<Option<Arc<B>>>,
}

impl<T: Clone, B> TwoCells<T, B> {
    pub(super) fn new() -> Self {
        TwoCells {
            meta: ArcCell::new(Arc::new(Snapshot::initial())),
            binding: ArcCell::new(Arc::new(None)),
        }
    }

    /// Mirror `next` into the two cells in upstream's order.
    pub(super) fn publish(&self, next: &Snapshot<T, B>) {
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

    /// The upstream read: gate load, then binding load if Active.
    pub(super) fn load(&self) -> Arc<Snapshot<T, B>> {
        let meta = self.meta.load();
        let route = if meta.lifecycle == Lifecycle::Active {
            match &*self.binding.load() {
                Some(b) => Route::Prefill(Arc::clone(b)),
                None => Route::Bypass(BypassReason::Building),
            }
        } else {
            meta.route.clone()
        };
        Arc::new(Snapshot {
            lifecycle: meta.lifecycle,
            route,
            target: meta.target.clone(),
            build: meta.build,
            epoch: meta.epoch,
        })
    }
}
