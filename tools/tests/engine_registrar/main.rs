//! Engines as workers (docs/engines.md, "Engines as workers: static and register"): the
//! probe-and-register loop against a stub engine on loopback (registered with the engine's
//! card, withdrawn after failed probes, registered again, junk answers never panic it), the
//! `register` sidecar and `serve --engine` as processes on a file store, and their usage
//! errors. Needs only a Rust toolchain; every wait is bounded.

#[path = "../frontend/mod.rs"]
mod frontend;
mod registrar;
mod sidecar;
mod stub;
