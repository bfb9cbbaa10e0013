//! Migration: one request's decode stream carried across decode workers that die, token for
//! token (pure: no I/O, no clock; time is passed in). Issue 42.
//!
//! A decode stream that ends without a finish (the connection dropped, the worker's record
//! vanished from discovery, the worker answered that it is gone) used to fail the client's
//! request. [`Migration`] turns it into a *continuation*: a fresh request to another decode
//! worker whose prompt is the original prompt plus every token the client already got, and
//! whose `max_tokens` is what is left. With a deterministic engine (greedy sampling) the
//! continuation's tokens are exactly the ones the broken attempt would have streamed next, so
//! the client sees one stream. The rules:
//!
//! 1. **Every token once.** Tokens are emitted in arrival order, only from the current
//!    attempt: an attempt is named by an [`AttemptId`], and tokens or breaks of an older one
//!    (a worker whose record vanished may still flush a token) are ignored. A continuation's
//!    prompt holds every emitted token, so none is generated twice; nothing beyond `max_tokens`
//!    is emitted whatever a worker sends.
//! 2. **A fresh request.** A continuation never carries the original's prefill handoff (an
//!    engine's handle is single-use, `crate::handoff`): the decode worker prefills the longer
//!    prompt itself, or the driver prefills it on the prefill pool first.
//! 3. **Bounded.** At most [`MigrationConfig::limit`] continuations (0 turns migration off: the
//!    first break fails the stream), none after the deadline; both end typed
//!    ([`MigrationError`]). Continuations are counted per [`BreakReason`].
//! 4. **One ending.** The client's stream ends once: a [`Finished`] with one
//!    [`FinishReason`] and usage counting the *original* prompt and every emitted token once, a
//!    [`MigrationError`], or [`Next::Stop`] after the client cancelled. After that every input is
//!    ignored: no continuation starts after a cancel.
//!
//! Inputs are `handle_*` methods, outputs the returned [`Step`] (`#[must_use]`); no input
//! sequence panics. `model/src/migration.rs` checks the rules with stateright (with mutants), and
//! the tests below compare the machine with a naive reference over random interleavings.

use std::time::Instant;

use crate::discovery::InstanceId;
use crate::request::{FinishReason, GenerateRequest};

/// Names one attempt of a request: the first is `AttemptId(0)`, each continuation the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AttemptId(pub u32);

/// Why an attempt ended without a finish.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BreakReason {
    /// The connection to the decode worker dropped (reset, EOF, the stream ended unfinished).
    ConnectionDropped,
    /// The worker's record vanished from discovery while it streamed.
    WorkerVanished,
    /// The worker answered with an error saying it is gone (shutting down, engine dead).
    WorkerGone,
}

impl BreakReason {
    /// Every reason, for counters and exhaustive drivers.
    pub const ALL: [BreakReason; 3] = [
        BreakReason::ConnectionDropped,
        BreakReason::WorkerVanished,
        BreakReason::WorkerGone,
    ];

    /// A short, stable label (metrics and logs).
    pub fn as_str(self) -> &'static str {
        match self {
            BreakReason::ConnectionDropped => "connection_dropped",
            BreakReason::WorkerVanished => "worker_vanished",
            BreakReason::WorkerGone => "worker_gone",
        }
    }

    fn index(self) -> usize {
        match self {
            BreakReason::ConnectionDropped => 0,
            BreakReason::WorkerVanished => 1,
            BreakReason::WorkerGone => 2,
        }
    }
}

/// The migration bounds of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MigrationConfig {
    /// Continuations allowed per request; 0 turns migration off.
    pub limit: u32,
}

impl MigrationConfig {
    /// The default limit: three continuations (docs/health.md, "Migration").
    pub const DEFAULT_LIMIT: u32 = 3;
}

impl Default for MigrationConfig {
    fn default() -> Self {
        MigrationConfig {
            limit: Self::DEFAULT_LIMIT,
        }
    }
}

/// Why a stream could not be continued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum MigrationError {
    /// The attempt broke and every allowed continuation was used (or migration is off).
    #[error(
        "the decode worker broke ({}) after {migrations} migration(s); the limit is {limit}",
        .reason.as_str()
    )]
    LimitUsedUp {
        /// The configured limit.
        limit: u32,
        /// Continuations started before this break.
        migrations: u32,
        /// How the last attempt broke.
        reason: BreakReason,
    },
    /// The request's deadline passed before the stream finished.
    #[error(
        "the request's deadline passed after {emitted} token(s) and {migrations} migration(s)"
    )]
    DeadlinePassed {
        /// Tokens the client got.
        emitted: u32,
        /// Continuations started.
        migrations: u32,
    },
}

/// Token accounting of the client's stream: the original prompt, and every token emitted once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Usage {
    /// Tokens of the original prompt (not of a continuation's longer prompt).
    pub prompt_tokens: u32,
    /// Every token the client got, across all attempts.
    pub completion_tokens: u32,
}

/// The client's stream is complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Finished {
    /// Its one finish reason.
    pub reason: FinishReason,
    /// Its usage.
    pub usage: Usage,
}

/// A continuation to start: send `request` to a decode worker not in `avoid`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Continuation {
    /// The attempt it is: tag its tokens and its end with this id.
    pub attempt: AttemptId,
    /// The original prompt plus every emitted token, `max_tokens` what is left, no handoff.
    pub request: GenerateRequest,
    /// Workers that broke under this request (those the driver knew).
    pub avoid: Vec<InstanceId>,
    /// Why the previous attempt ended.
    pub reason: BreakReason,
}

/// What the caller must do after emitting [`Step::emit`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Next {
    /// Start this continuation (the broken attempt is already gone).
    Continue(Continuation),
    /// End the client's stream with this finish; drop the current attempt.
    Finish(Finished),
    /// End the client's stream with this error; drop the current attempt.
    Fail(MigrationError),
    /// The client cancelled: drop the current attempt (cancelling it at its worker); the stream
    /// ends with nothing more.
    Stop,
}

/// The machine's answer to one input: tokens to send the client, then at most one order.
#[must_use = "the caller must emit the tokens and carry out the order"]
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Step {
    /// Tokens to send the client now, in order (possibly none).
    pub emit: Vec<u32>,
    /// What to do next, if anything.
    pub next: Option<Next>,
}

impl Step {
    fn next(next: Next) -> Step {
        Step {
            emit: Vec::new(),
            next: Some(next),
        }
    }
}

/// Where the stream stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MigrationState {
    /// The current attempt streams (or is being started).
    Streaming,
    /// Finished (the end).
    Finished,
    /// Failed (the end).
    Failed,
    /// The client cancelled (the end).
    Cancelled,
}

/// One request's decode stream across migrations (see the module rules).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Migration {
    /// The original request (its prompt, `max_tokens`, stop tokens, session).
    original: GenerateRequest,
    limit: u32,
    deadline: Option<Instant>,
    /// Every token the client got, in order.
    emitted: Vec<u32>,
    attempt: AttemptId,
    state: MigrationState,
    avoid: Vec<InstanceId>,
    /// Continuations started, per [`BreakReason`] (in `BreakReason::ALL` order).
    by_reason: [u32; 3],
}

impl Migration {
    /// The stream of `original` (its first attempt is `AttemptId(0)`, carrying the original's
    /// handoff), bounded by `config` and, if given, `deadline`.
    pub fn new(
        original: GenerateRequest,
        config: MigrationConfig,
        deadline: Option<Instant>,
    ) -> Self {
        Migration {
            original,
            limit: config.limit,
            deadline,
            emitted: Vec::new(),
            attempt: AttemptId(0),
            state: MigrationState::Streaming,
            avoid: Vec::new(),
            by_reason: [0; 3],
        }
    }

    /// Where the stream stands.
    pub fn state(&self) -> MigrationState {
        self.state
    }

    /// The attempt whose tokens count now.
    pub fn attempt(&self) -> AttemptId {
        self.attempt
    }

    /// Every token the client got, in order.
    pub fn emitted(&self) -> &[u32] {
        &self.emitted
    }

    /// Continuations started in all.
    pub fn migrations(&self) -> u32 {
        self.by_reason.iter().sum()
    }

    /// Continuations started after breaks of `reason`.
    pub fn migrations_for(&self, reason: BreakReason) -> u32 {
        self.by_reason[reason.index()]
    }

    /// The deadline the caller should wake at, while the stream is not over.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadline.filter(|_| self.live())
    }

    fn live(&self) -> bool {
        self.state == MigrationState::Streaming
    }

    fn is_current(&self, attempt: AttemptId) -> bool {
        self.live() && attempt == self.attempt
    }

    fn remaining(&self) -> u32 {
        self.original.max_tokens.saturating_sub(self.emitted_u32())
    }

    fn emitted_u32(&self) -> u32 {
        u32::try_from(self.emitted.len()).unwrap_or(u32::MAX)
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: u32::try_from(self.original.token_ids.len()).unwrap_or(u32::MAX),
            completion_tokens: self.emitted_u32(),
        }
    }

    fn finish(&mut self, reason: FinishReason) -> Next {
        self.state = MigrationState::Finished;
        Next::Finish(Finished {
            reason,
            usage: self.usage(),
        })
    }

    fn fail(&mut self, error: MigrationError) -> Next {
        self.state = MigrationState::Failed;
        Next::Fail(error)
    }

    /// Emits what fits of `tokens`; the finish it implies, if any: a stop token emitted, or
    /// `max_tokens` reached.
    fn take(&mut self, tokens: &[u32]) -> (Vec<u32>, Option<FinishReason>) {
        // A worker sending past `max_tokens` (it was told what is left) is cut off there.
        // Nothing follows a stop token either.
        let room = usize::try_from(self.remaining()).unwrap_or(usize::MAX);
        let stops = &self.original.stop_token_ids;
        let end = match tokens.iter().position(|t| stops.contains(t)) {
            Some(stop) => (stop + 1).min(room),
            None => tokens.len().min(room),
        };
        let emit = tokens[..end].to_vec();
        self.emitted.extend_from_slice(&emit);
        let stopped = emit.last().is_some_and(|t| stops.contains(t));
        let implied = if stopped {
            Some(FinishReason::Stop)
        } else if self.remaining() == 0 {
            Some(FinishReason::Length)
        } else {
            None
        };
        (emit, implied)
    }

    /// Tokens arrived from `attempt` (ignored unless it is the current one and the stream is
    /// live).
    pub fn handle_tokens(&mut self, attempt: AttemptId, tokens: &[u32]) -> Step {
        if !self.is_current(attempt) {
            return Step::default();
        }
        let (emit, implied) = self.take(tokens);
        let next = implied.map(|reason| self.finish(reason));
        Step { emit, next }
    }

    /// `attempt` ended with `reason` (after its last `tokens`): the client's stream finishes,
    /// with the worker's reason (a stop it saw wins over a length the machine counted).
    pub fn handle_finish(
        &mut self,
        attempt: AttemptId,
        tokens: &[u32],
        reason: FinishReason,
    ) -> Step {
        if !self.is_current(attempt) {
            return Step::default();
        }
        let (emit, implied) = self.take(tokens);
        let reason = match (implied, reason) {
            (Some(FinishReason::Stop), _) => FinishReason::Stop,
            (_, reason) => reason,
        };
        let next = Some(self.finish(reason));
        Step { emit, next }
    }

    /// `attempt`, served by `worker` when the caller knows it, ended without a finish at
    /// `now`: continue on another worker, or fail typed.
    pub fn handle_break(
        &mut self,
        attempt: AttemptId,
        reason: BreakReason,
        worker: Option<InstanceId>,
        now: Instant,
    ) -> Step {
        if !self.is_current(attempt) {
            return Step::default();
        }
        if let Some(worker) = worker {
            if !self.avoid.contains(&worker) {
                self.avoid.push(worker);
            }
        }
        // Everything was streamed but the finish was lost: the stream is complete.
        if self.remaining() == 0 {
            return Step::next(self.finish(FinishReason::Length));
        }
        if self.deadline.is_some_and(|d| now >= d) {
            return Step::next(self.fail(self.deadline_error()));
        }
        let migrations = self.migrations();
        if migrations >= self.limit {
            return Step::next(self.fail(MigrationError::LimitUsedUp {
                limit: self.limit,
                migrations,
                reason,
            }));
        }
        self.by_reason[reason.index()] += 1;
        self.attempt = AttemptId(self.attempt.0.saturating_add(1));
        let mut token_ids = self.original.token_ids.clone();
        token_ids.extend_from_slice(&self.emitted);
        let request = GenerateRequest {
            token_ids,
            max_tokens: self.remaining(),
            // Never the original's handoff: a single-use handle is spent (rule 2).
            handoff: None,
            ..self.original.clone()
        };
        Step::next(Next::Continue(Continuation {
            attempt: self.attempt,
            request,
            avoid: self.avoid.clone(),
            reason,
        }))
    }

    /// The client cancelled (or went away): stop the current attempt; nothing continues.
    pub fn handle_cancel(&mut self) -> Step {
        if !self.live() {
            return Step::default();
        }
        self.state = MigrationState::Cancelled;
        Step::next(Next::Stop)
    }

    /// Time passed: at or past the deadline a live stream fails typed.
    pub fn handle_timeout(&mut self, now: Instant) -> Step {
        if !self.live() || self.deadline.is_none_or(|d| now < d) {
            return Step::default();
        }
        Step::next(self.fail(self.deadline_error()))
    }

    fn deadline_error(&self) -> MigrationError {
        MigrationError::DeadlinePassed {
            emitted: self.emitted_u32(),
            migrations: self.migrations(),
        }
    }
}

#[cfg(test)]
mod tests;
