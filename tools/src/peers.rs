//! The head-to-head harness behind `bench-peers` (`docs/performance.md`, "Against the peers"):
//! a pool of engines (mock vLLM engines started here, or running ones), each router put in
//! front of it in turn in its KV-aware and round-robin modes (ours, the SGLang gateway `smg`,
//! vLLM's `vllm-router`), the same request stream replayed in real time, the engines' caches
//! cleared between routers, and per router: TTFT p50/p99, end-to-end p99, throughput, the
//! engines' own prefix-cache hit rate, failed requests, and the router's CPU and peak memory.
//!
//! - `workload.rs`: the request streams (a Mooncake conversation slice, a shared system
//!   prompt, multi-tenant prefixes) as text of one-token words;
//! - `client.rs`: one streamed completion, timed as a user sees it;
//! - `pool.rs`: the engines, their cache reset and prefix-cache counters;
//! - `routers.rs`: each router's command line;
//! - `procs.rs`: a process tree's CPU and peak memory from `/proc`;
//! - `run.rs`: one head-to-head; `report.rs`: the table, JSON and SVG.

pub mod client;
pub mod pool;
pub mod procs;
pub mod report;
pub mod routers;
pub mod run;
pub mod workload;
