//! The migration model's variants: the real machine and deliberately broken drivers of it,
//! each altering only what goes in or comes out (the library has no mutation hooks), so that
//! every property is shown to bite (`model/tests/migration.rs`).

use std::time::Instant;

use prefill_router::migration::{
    AttemptId, BreakReason, Migration, MigrationConfig, MigrationError, Next, Step,
};
use prefill_router::request::{FinishReason, GenerateRequest};

use super::World;

/// The machine under check: the real one, or a mutant named after the bug it plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// The real [`Migration`], driven as the decode hop drives it.
    Real,
    /// Tokens and breaks are taken as the current attempt's whatever attempt sent them (no
    /// attempt ids): a dead worker's late token is emitted beside the continuation's. Breaks
    /// MG2 (and MG1).
    AcceptsStale,
    /// The continuation's prompt leaves out the last emitted token (and asks for one more):
    /// the new worker generates it again. Breaks MG2 (and MG1).
    ForgetsLastToken,
    /// The limit check is off by one. Breaks MG3.
    LimitOffByOne,
    /// The client's cancel stops the attempt but never reaches the machine: a late break of the
    /// dropped attempt starts a continuation. Breaks MG4 (and MG7: that continuation ends the
    /// stream again).
    ContinuesAfterCancel,
    /// The continuation is the original request with a longer prompt, its handoff kept.
    /// Breaks MG5.
    ReusesHandoff,
    /// The finish reports the last attempt's prompt (the original plus the tokens before the
    /// last migration) as the prompt tokens. Breaks MG6.
    UsageOfLastAttempt,
    /// A break past the limit is swallowed: the stream is left hanging with no ending. Breaks
    /// MG7.
    NoEndAtLimit,
}

impl Variant {
    /// Every variant, the real one first.
    pub const ALL: [Variant; 8] = [
        Variant::Real,
        Variant::AcceptsStale,
        Variant::ForgetsLastToken,
        Variant::LimitOffByOne,
        Variant::ContinuesAfterCancel,
        Variant::ReusesHandoff,
        Variant::UsageOfLastAttempt,
        Variant::NoEndAtLimit,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Real => "real",
            Variant::AcceptsStale => "accepts-stale",
            Variant::ForgetsLastToken => "forgets-last-token",
            Variant::LimitOffByOne => "limit-off-by-one",
            Variant::ContinuesAfterCancel => "continues-after-cancel",
            Variant::ReusesHandoff => "reuses-handoff",
            Variant::UsageOfLastAttempt => "usage-of-last-attempt",
            Variant::NoEndAtLimit => "no-end-at-limit",
        }
    }

    pub(super) fn fresh(
        self,
        original: GenerateRequest,
        mut config: MigrationConfig,
        deadline: Option<Instant>,
    ) -> Migration {
        if self == Variant::LimitOffByOne {
            config.limit += 1;
        }
        Migration::new(original, config, deadline)
    }

    /// The attempt id the machine is told.
    fn id(self, s: &World, attempt: AttemptId) -> AttemptId {
        if self == Variant::AcceptsStale {
            s.machine.attempt()
        } else {
            attempt
        }
    }

    pub(super) fn tokens(self, s: &mut World, attempt: AttemptId, tokens: &[u32]) -> Step {
        let attempt = self.id(s, attempt);
        s.machine.handle_tokens(attempt, tokens)
    }

    pub(super) fn finish(
        self,
        s: &mut World,
        attempt: AttemptId,
        tokens: &[u32],
        reason: FinishReason,
    ) -> Step {
        let attempt = self.id(s, attempt);
        s.machine.handle_finish(attempt, tokens, reason)
    }

    pub(super) fn broke(
        self,
        s: &mut World,
        attempt: AttemptId,
        reason: BreakReason,
        now: Instant,
    ) -> Step {
        let attempt = self.id(s, attempt);
        s.machine.handle_break(attempt, reason, None, now)
    }

    pub(super) fn cancel(self, s: &mut World) -> Step {
        if self == Variant::ContinuesAfterCancel {
            return Step {
                emit: Vec::new(),
                next: Some(Next::Stop),
            };
        }
        s.machine.handle_cancel()
    }

    pub(super) fn timeout(self, s: &mut World, now: Instant) -> Step {
        s.machine.handle_timeout(now)
    }

    /// What the driver sees of the machine's answer `step`.
    pub(super) fn after(self, original: &GenerateRequest, s: &World, mut step: Step) -> Step {
        match (self, &mut step.next) {
            (Variant::ForgetsLastToken, Some(Next::Continue(c)))
                if c.request.token_ids.len() > original.token_ids.len() =>
            {
                c.request.token_ids.pop();
                c.request.max_tokens += 1;
            }
            (Variant::ReusesHandoff, Some(Next::Continue(c))) => {
                c.request.handoff = original.handoff.clone();
            }
            (Variant::UsageOfLastAttempt, Some(Next::Finish(f))) => {
                f.usage.prompt_tokens = s.last_prompt;
            }
            (Variant::NoEndAtLimit, Some(Next::Fail(MigrationError::LimitUsedUp { .. }))) => {
                step.next = None;
            }
            _ => {}
        }
        step
    }
}
