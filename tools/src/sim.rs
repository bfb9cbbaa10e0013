//! Deterministic simulation of the prefill hop.
//!
//! One seed drives a whole world on a current-thread tokio runtime whose clock is paused (it
//! jumps to the next timer whenever every task is idle, so a run covers seconds of simulated
//! time in milliseconds): the real [`PrefillRouter`](prefill_router::router::PrefillRouter), driven by a
//! seeded controller through a faulty discovery feed, building bindings with a fake factory
//! whose builds fail, hang past the timeout or outlive their cancellation; each binding picks
//! workers with the real [`RoutableView`](prefill_router::push::RoutableView) and
//! [`Dispatcher`](prefill_router::push::Dispatcher) over simulated workers that answer, reject, crash
//! mid-stream or hang. Oracles run throughout (see [`Violation`]) and a failing run prints the
//! one-line command that replays it. See `docs/simulation.md`.
//!
//! ```
//! use prefill_router_tools::sim::{simulate, SimConfig};
//!
//! let report = simulate(&SimConfig::new(7, 50)).expect("runtime");
//! assert!(report.passed(), "{report}");
//! // Same seed, same history (exactly so unless tokio's own RNG is involved, see the docs).
//! if report.exact_replay() {
//!     assert_eq!(report.digest, simulate(&SimConfig::new(7, 50)).unwrap().digest);
//! }
//! ```

mod binding;
pub mod conditional;
mod config;
mod controller;
mod discovery;
mod fate;
mod feed;
pub mod frontends;
pub mod kv_events;
mod link;
mod oracle;
mod pool;
mod report;
mod rng;
mod run;
pub mod sessions;
mod sink;
mod world;

pub use config::{Mutant, SimConfig, TargetSource};
pub use oracle::Violation;
pub use report::{mutant_name, parse_mutant, repro_command, SimReport, SimStats};
pub use rng::SimRng;
pub use run::simulate;
