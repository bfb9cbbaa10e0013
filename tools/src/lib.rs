//! # prefill-router-tools
//!
//! What is not library in prefill-router: the tools that exercise it, kept out of the
//! library's build (`docs/design.md`, "Crates").
//!
//! - [`mock`]: mock prefill and decode engines with a bounded KV block cache, for the demo,
//!   tests and benchmarks, and [`mock::spawn_registered`] to start one as a registered worker.
//! - [`engines`]: the probe-and-register loop that keeps a real engine (vLLM) registered in
//!   discovery while it answers `/health`, behind `register` and `serve --engine`
//!   (`docs/engines.md`, "Engines as workers: static and register").
//! - [`sim`]: the deterministic simulator of the hop under seeded faults
//!   (`docs/simulation.md`).
//! - [`vllm_mock`]: a lightweight engine speaking vLLM's protocol (OpenAI endpoints, P/D
//!   `kv_transfer_params`, metrics, KV events over ZMQ), behind the `mock-vllm` binary.
//! - [`replay`]: a request trace replayed in virtual time through the router, per routing
//!   policy (`docs/replay.md`).
//!
//! The `prefill-router` binary (demo, simulate, replay, serve, worker, register) is this package's.

pub mod engines;
pub mod mock;
pub mod replay;
pub mod sim;
pub mod vllm_mock;
