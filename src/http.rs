//! The OpenAI-compatible HTTP frontend over a [`PrefillHop`](crate::PrefillHop) (feature
//! `http`; `prefill-router serve` runs it).
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming with `"stream":
//! true`: server-sent events ending with `data: [DONE]`), `GET /v1/models`, `GET /health`,
//! `GET /ready` (200 only when a request would be served), `GET /metrics` (the router's
//! Prometheus metrics and the HTTP counters). Errors are OpenAI-style JSON bodies. Prompts go
//! through [`HttpConfig::tokenizer`]: the built-in word [`tokenizer`], or (feature
//! `model-tokenizer`) a real model's `ModelTokenizer`. [`serve`] runs its own accept loop over
//! hyper's HTTP/1.1 connections: header, body, idle and request timeouts, a connection cap, and an
//! ordered shutdown (drain delay with `/ready` 503, then a bounded drain). With
//! [`HttpConfig::api_keys`], every route but `/health`, `/ready` and (optionally) `/metrics`
//! asks for `Authorization: Bearer KEY`, checked in constant time ([`ApiKeys`]). See
//! `docs/frontend.md`.

mod auth;
mod completion;
mod conn;
mod openai;
mod reply;
mod server;
mod session;
mod state;
pub mod tokenizer;

pub use auth::{ApiKeys, AuthError, KeysError};
pub use conn::ServeSummary;
pub use openai::ApiError;
pub use server::{app, serve};
pub use session::{MAX_SESSION_LEN, SESSION_HEADER};
pub use state::HttpConfig;
#[cfg(feature = "model-tokenizer")]
pub use tokenizer::{LoadError, ModelTokenizer};
pub use tokenizer::{PromptError, Tokenizer};
