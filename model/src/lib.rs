//! # prefill-router-model
//!
//! A [stateright] model of the prefill hop's whole design. Its state wraps the **real**
//! [`prefill_router::lifecycle::Machine`] (not a copy of its logic) together with the world
//! around it: builds in flight that may finish in any order (also after being cancelled), armed
//! retry timers (which may fire late), the controller's bounded budget of retargets and its
//! shutdown, admission changes (a retired binding's admission set emptying), the snapshot the
//! adapter publishes after every step, and requests that load the snapshot, dispatch on the
//! binding they loaded (failing when its admission is empty) or bypass, and finish.
//!
//! - [`model::RouterModel`]: the model, generic over the machine under check ([`Subject`]).
//! - [`properties`]: the named properties (ids M1..M10, V1..V6, see docs/properties.md).
//! - [`mutants`]: deliberately broken machines, each caught by at least one property.
//! - [`trace`]: each step of a counterexample as readable inputs and actions
//!   ([`RouterModel::render`] prints a whole path).
//! - [`health`]: a small separate model of the worker-health machine (per-instance breakers):
//!   a reachable instance in discovery is routable again within the backoff cap.
//! - [`booking`]: a separate model of the booking rule of load reports (issue 29): frontends
//!   admitting work on shared workers by `own + others + work <= threshold`, with the real
//!   `LoadLedger` and `ReportedLoad` and reports late, lost or reordered.
//! - [`handoff`]: a small separate model of one request's prefill handoff (the real
//!   `Handoff` machine, issue 38): carried at most once, every handoff's ending counted
//!   exactly once, no decode after an abandon, with the dispatcher's retries, worker removal and
//!   the client leaving at any step.
//! - [`migration`]: a small separate model of one request's decode stream across migrations
//!   (the real `Migration` machine, issue 42): a deterministic engine's output as the
//!   reference, workers dying at any point, late tokens of dead workers, cancel and deadline.
//! - [`config`], [`step`]: the model's bounds and its steps (the world's actions).
//!
//! See docs/model.md for the bounds and why every path is finite and acyclic.

pub mod booking;
pub mod cli;
pub mod config;
pub mod handoff;
pub mod health;
pub mod migration;
pub mod model;
pub mod mutants;
pub mod properties;
pub mod step;
pub mod subject;
pub mod trace;
pub mod world;

pub use model::{Config, RouterModel, Step};
pub use subject::{Subject, Target};

/// The real machine over the model's targets.
pub type Real = prefill_router::lifecycle::Machine<Target>;

/// Unique states of [`Config::STANDARD`] with the real machine, pinned by the tests so that a
/// silently truncated or changed search fails (update it, with the reason, when the model changes).
///
/// History: 242,502 before admission was modelled; 532,833 since the standard configuration
/// has one admission change (a retired binding's admission set may empty at any later point,
/// and requests holding it then fail instead of dispatching).
pub const STANDARD_STATES: usize = 532_833;
