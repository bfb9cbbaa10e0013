//! The control core's deliberate mutants of its publication protocol, and the seam where they
//! break it (see `crate::hooks`). The loom suite (`tests/loom_control.rs`) and the unit tests
//! arm them through [`Control::with_mutant`](super::Control::with_mutant).

use std::sync::Arc;

use crate::hooks::{Seam, ARMABLE};
use crate::snapshot::{RouteCell, Snapshot, SnapshotGuard};

/// Which deliberate mutant a [`Control`](super::Control) runs (see `Control::with_mutant`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// The correct protocol.
    // Armed only by the loom suite and the tests.
    #[cfg_attr(not(any(test, prefill_loom)), allow(dead_code))]
    None,
    /// Upstream's layout: the lifecycle (with target and bypass reason) and the binding live in
    /// two cells, written in upstream's order (publish: binding then lifecycle; retarget:
    /// clear binding then lifecycle; clear: lifecycle only, binding retained) and read as
    /// lifecycle gate then binding. Loom only (its reads hand out loom's cell guard).
    #[cfg(prefill_loom)]
    TwoCells,
    /// The machine steps under the lock but the snapshot is stored after the lock is released.
    PublishOutsideLock,
    /// Bindings taken out by a step are dropped while the lock is still held.
    DropUnderLock,
}

#[cfg(prefill_loom)]
mod two_cells;
#[cfg(prefill_loom)]
use two_cells::TwoCells;

/// The core's seam: its publication protocol, as is unless a mutant is armed. Zero-sized in
/// normal builds.
pub(super) struct ControlSeam<T, B> {
    mutant: Seam<Mutant>,
    /// The `TwoCells` mutant's cells (loom only).
    #[cfg(prefill_loom)]
    two_cells: Seam<TwoCells<T, B>>,
    _types: std::marker::PhantomData<fn() -> (T, B)>,
}

const _: () = assert!(ARMABLE || std::mem::size_of::<ControlSeam<u64, [u8; 64]>>() == 0);

impl<T, B> Default for ControlSeam<T, B> {
    #[inline(always)]
    fn default() -> Self {
        ControlSeam {
            mutant: Seam::off(),
            #[cfg(prefill_loom)]
            two_cells: Seam::off(),
            _types: std::marker::PhantomData,
        }
    }
}

impl<T: Clone, B> ControlSeam<T, B> {
    /// The seam running `mutant`.
    #[cfg(any(test, prefill_loom))]
    pub(super) fn on(mutant: Mutant) -> Self {
        ControlSeam {
            mutant: Seam::on(mutant),
            #[cfg(prefill_loom)]
            two_cells: match mutant {
                Mutant::TwoCells => Seam::on(TwoCells::new()),
                _ => Seam::off(),
            },
            _types: std::marker::PhantomData,
        }
    }
}

impl<T: Clone, B> ControlSeam<T, B> {
    /// A request's load of the published snapshot (`TwoCells`: the upstream two-cell read).
    #[inline(always)]
    pub(super) fn load(&self, cell: &RouteCell<T, B>) -> SnapshotGuard<T, B> {
        #[cfg(prefill_loom)]
        if let Some(two_cells) = self.two_cells.armed() {
            return SnapshotGuard::detached(two_cells.load());
        }
        cell.load()
    }

    /// The end of a step's critical section (`DropUnderLock`: drop what it took out, here;
    /// otherwise nothing is dropped under the lock).
    #[inline(always)]
    pub(super) fn before_unlock<X: Default, Y>(&self, trash: &mut X, built: &mut Option<Y>) {
        if self.mutant.is(Mutant::DropUnderLock) {
            drop(std::mem::take(trash));
            drop(built.take());
        }
    }

    /// Publish `next` (if any) while `guard` still holds the lock, then release it; returns
    /// the snapshot it replaced, for the caller to drop after the lock (`PublishOutsideLock`:
    /// release first; `TwoCells`: also mirror into the two cells).
    #[inline(always)]
    pub(super) fn publish_and_unlock<G>(
        &self,
        cell: &RouteCell<T, B>,
        next: Option<Arc<Snapshot<T, B>>>,
        guard: G,
    ) -> Option<Arc<Snapshot<T, B>>> {
        let Some(next) = next else {
            drop(guard);
            return None;
        };
        if self.mutant.is(Mutant::PublishOutsideLock) {
            drop(guard);
            return Some(cell.swap(next));
        }
        #[cfg(prefill_loom)]
        if let Some(two_cells) = self.two_cells.armed() {
            two_cells.publish(&next);
        }
        let old = cell.swap(next);
        drop(guard);
        Some(old)
    }
}
