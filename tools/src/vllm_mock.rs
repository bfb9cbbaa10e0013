//! A lightweight engine that speaks vLLM 0.32's protocol (`docs/engines.md`, "The mock vLLM
//! engine"), so that routers can be run and compared against six or eight engines on two cores.
//! The `mock-vllm` binary runs one as a process; tests start them in-process with
//! [`MockVllm::start`].
//!
//! What it speaks, as captured from real vLLM (`shared/reference/engines/`):
//! - `POST /v1/completions` (a prompt as text, token ids, or a list of one) and
//!   `POST /v1/chat/completions` (messages through the model's chat template), streamed (SSE,
//!   `data: [DONE]`, `stream_options.include_usage`) or not, with `usage.prompt_tokens_details.
//!   cached_tokens` as `--enable-prompt-tokens-details` gives it and vLLM's 400/404 errors;
//! - P/D as vLLM with the NixlConnector: a prefill leg (`kv_transfer_params.do_remote_decode`)
//!   answers with the handle vLLM returns (`remote_engine_id`, `remote_block_ids`,
//!   `remote_host`/`remote_port` of a side channel it really listens on, ...); a decode leg with
//!   a usable handle dials that side channel (closed: HTTP 500, as vLLM's `fail` policy) and skips
//!   the prefill of the pulled tokens; a handle vLLM would call invalid makes it recompute;
//! - `GET /health`, `GET /v1/models`, `GET /metrics` (vLLM's metric names and labels),
//!   `POST /tokenize`, `POST /detokenize`, `POST /reset_prefix_cache`, `GET /kv_event_sources`;
//! - KV events over ZMQ in vLLM's exact framing and msgpack ([`events`]), with the replay
//!   endpoint.
//!
//! **The cache.** An LRU of full blocks keyed by vLLM's `sha256_cbor` chained block hash
//! ([`hash`], the very hashes real vLLM publishes when started as `.ci/vllm.sh` starts it);
//! see [`cache`] for what hits and what is evicted.
//!
//! **The timing model** is the replay's [`CostModel`](crate::replay::CostModel) (`docs/replay.md`):
//! - a request waits (`vllm:num_requests_waiting`) until one of `max_batch` prefill slots frees;
//! - its prefill takes `prefill_overhead + prefill_per_token x uncached x (1 + batch_slowdown x
//!   prefills already running)`, where uncached = prompt tokens minus the cached prefix minus
//!   the tokens pulled from a prefill engine; a decode leg adds `transfer_per_block` per block
//!   it pulls;
//! - the first token comes at the end of the prefill (`vllm:time_to_first_token_seconds`), each
//!   next one `decode_per_token` later (streamed) or all at once after `decode_per_token x
//!   (n - 1)` (not streamed); decodes do not slow each other down.
//!
//! Defaults: 5 ms + 100 µs per uncached token (a 1,000-token prompt: 105 ms uncached, 5 ms
//! cached), 4 prefills at once, 25 ms per output token, 20 µs per pulled block. Every wait is a
//! tokio timer or a semaphore: an idle engine uses no CPU.
//!
//! **Output** is deterministic: the tokens are a function of the prompt's tokens alone
//! ([`engine::output_tokens`]), so every engine gives the same answer to the same prompt and a
//! decode leg's answer equals an aggregated one.

pub mod app;
pub mod cache;
pub mod completions;
pub mod config;
pub mod engine;
pub mod events;
pub mod hash;
pub mod metrics;
pub mod request;
pub mod server;

pub use config::{KvRole, MockVllmConfig};
pub use server::{MockVllm, StartError};
