//! The only module that names concrete synchronisation primitives.
//!
//! Normal builds use `parking_lot` for the control lock and `arc-swap` for the published
//! snapshot (`sync/std.rs`). Under `--cfg prefill_loom` both map to `loom` types so that loom
//! can preempt at every access (`sync/loom.rs`). Neither `arc-swap` nor `parking_lot` has loom
//! support: loom cannot schedule inside them, so running the real ones under a loom model would
//! glue each of their operations to the previous loom operation and hide interleavings (see
//! `docs/concurrency.md`). The cfg is crate-specific, so no dependency (tokio has `cfg(loom)`
//! code) changes behaviour. The choice is made once, here; both files offer the same API:
//!
//! - `Mutex<T>` / `MutexGuard<'_, T>`: a non-poisoning mutex with parking_lot's API shape;
//! - `ArcCell<S>`: a linearizable cell holding an `Arc<S>` (lock-free loads, whole-value
//!   stores) and `CellGuard<S>`, its read guard, which derefs to the `Arc<S>` loaded.

#[cfg_attr(not(prefill_loom), path = "sync/std.rs")]
#[cfg_attr(prefill_loom, path = "sync/loom.rs")]
mod imp;

pub(crate) use imp::{ArcCell, CellGuard, Mutex};
