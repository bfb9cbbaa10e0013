//! The request plane and the dispatchers, in one test binary (each module was a binary of its
//! own; one link of the crate instead of five; KV cache events over the wire need the mock
//! engines' real caches and are `tools/tests/kv_events_wire.rs`). A module is named after the binary it was, so
//! `cargo test --test request_plane push_modes` runs what `--test push_modes` ran.
//!
//! - `transport_stream`: streaming, multiplexing, cancellation, deadlines, errors on loopback.
//! - `transport_drain`: a stopping worker drains: in-flight streams finish, new work elsewhere.
//! - `transport_garbage`: hostile peers (garbage, oversized frames).
//! - `push_modes`: round robin, random, direct, KV on loopback workers.
//! - `push_admission`: the routable view under admission and discovery changes.
//! - `push_health`: worker breakers: a blipped worker comes back, load never opens a breaker.
//! - `push_retry`: a failed request retried on another worker, the attempts listed, KV next-best.
//! - `push_kv_selector`: the KV selector alone (hashing, scoring, ties, bounded memory).
//! - `tls`: TLS and mutual TLS on the request plane, and each refusal (feature `tls`; `certs`
//!   makes the certificates at test time).
#![cfg(feature = "runtime")]

#[cfg(feature = "tls")]
mod certs;
mod push_admission;
mod push_health;
mod push_kv_selector;
mod push_modes;
mod push_retry;
mod support;
#[cfg(feature = "tls")]
mod tls;
mod transport_drain;
mod transport_garbage;
mod transport_stream;
