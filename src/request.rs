//! The request vocabulary every seam speaks: what a frontend asks for ([`GenerateRequest`]),
//! what comes back ([`GenerateResponse`], [`FinishReason`]) and the prefill-to-decode handoff
//! ([`PrefillInfo`]), and what an engine reports of its own ([`EngineUsage`]).
//!
//! Plain data (serde, no I/O): the request plane ([`transport`](crate::transport)) carries
//! these types on the wire, and the router, the bindings and the decode hop pass them along.

use serde::{Deserialize, Serialize};

use crate::discovery::InstanceId;

/// One generation request (prefill, or prefill plus decode).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// The prompt, already tokenized.
    pub token_ids: Vec<u32>,
    /// How many tokens to generate; a disaggregated prefill hop sends 1.
    pub max_tokens: u32,
    /// A conversation or session key: requests sharing one prefill on the same worker while
    /// the binding's session-affinity TTL allows (docs/router.md), and the engine may use it
    /// for its own bookkeeping.
    pub session: Option<String>,
    /// Tokens that end generation early.
    pub stop_token_ids: Vec<u32>,
    /// The KV-cache location a decode worker should pull from, when this request is the decode
    /// half of a handoff (the prefill response's [`PrefillInfo`]).
    pub handoff: Option<PrefillInfo>,
    /// Sampling fields an engine honours (`temperature`, `top_p`, `seed`, `ignore_eos`, ...),
    /// as the JSON text of one object the frontend took from the client's request: an engine
    /// link forwards them verbatim on both legs (the fields the hop owns, such as `prompt`,
    /// `max_tokens` and `stream`, are set by the link and win). Our own workers ignore it.
    pub engine_fields: Option<String>,
    /// The caller's own id for this request, for in-process engines that need to recognise
    /// it (the simulator, the trace replay). Never routed on and never sent on the wire (not
    /// serialized: frames are unchanged, and a decoded request has `None`).
    #[serde(skip)]
    pub request_id: Option<u64>,
}

impl GenerateRequest {
    /// A request for `max_tokens` tokens after the prompt `token_ids`, with no session.
    pub fn new(token_ids: Vec<u32>, max_tokens: u32) -> Self {
        GenerateRequest {
            token_ids,
            max_tokens,
            ..GenerateRequest::default()
        }
    }
}

/// What a prefill worker reports so decode can take over (the handoff).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PrefillInfo {
    /// The worker that ran the prefill and now holds the KV blocks.
    pub worker: InstanceId,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// How many leading prompt blocks were already cached on that worker (not recomputed).
    pub cached_blocks: u32,
    /// The KV block size the worker used, in tokens.
    pub block_size: u32,
    /// An engine's own handoff, kept opaque: the JSON text of vLLM's `kv_transfer_params`
    /// exactly as the prefill engine answered it, sent verbatim to the decode engine (never
    /// rebuilt from known fields, so whatever a newer engine adds passes through). `None` for
    /// our own workers. A single-use handle: see docs/engines.md, "The handoff rules".
    pub engine_params: Option<String>,
}

impl PrefillInfo {
    /// Whether the handoff is a single-use handle on resources the prefill worker holds for
    /// one decode request (an engine's `engine_params`): such a handoff is carried by at most
    /// one decode request ([`crate::handoff`]). Our own workers' handoff holds nothing, so
    /// resending it is harmless.
    pub fn is_single_use(&self) -> bool {
        self.engine_params.is_some()
    }
}

/// Why a stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop token was generated.
    Stop,
    /// The request was cancelled.
    Cancelled,
}

/// One streamed piece of a response.
///
/// A response whose `finish` is set is the stream's last: the worker stops reading the engine
/// stream after it, and the client ends the stream after delivering it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerateResponse {
    /// Tokens generated since the previous response.
    pub token_ids: Vec<u32>,
    /// Set on the last response.
    pub finish: Option<FinishReason>,
    /// Set by a prefill worker (typically on its only response) for the decode handoff.
    pub prefill: Option<PrefillInfo>,
    /// The text of `token_ids` as the engine rendered it, when the worker is an engine that
    /// says (`None` from our own workers: the frontend renders the tokens itself).
    pub text: Option<String>,
    /// Token accounting as the engine reported it, on the response that carries it (usually
    /// the last).
    pub usage: Option<EngineUsage>,
}

/// Token accounting an engine reports for one request (OpenAI's `usage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineUsage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens served from a prefix cache (`prompt_tokens_details.cached_tokens`).
    pub cached_tokens: Option<u32>,
}
