//! A stateright model of one request's decode stream across migrations (issue 42): the
//! **real** [`prefill_router::migration::Migration`] machine in a world whose decode workers
//! die at any point.
//!
//! The world: a deterministic engine (greedy decoding: each token a function of the whole
//! context before it), whose uninterrupted output for the original prompt is the reference.
//! The current attempt streams one token at a time, its last one alone or with the finish; its
//! worker may die at any point ([`BreakReason`]: connection dropped, record vanished, worker
//! gone), a budget of deaths in all. An attempt that died, or that the driver dropped, may still
//! deliver one late event (a vanished worker's stream flushes a token; a dropped connection
//! reports its break). The client may cancel, time may pass beyond the deadline and the timer
//! fire, at any step. The driver carries out each [`Step`] as the real one does: emit the
//! tokens, start the continuation (a new attempt on the request the machine built), or end the
//! client's stream and drop the live attempt.
//!
//! The state records what the **world** saw (what the client got, which attempts started with
//! which request, whether one carried a used handoff, what happened after a cancel), never the
//! machine's account of itself. Properties MG1..MG7 are safety checks over those records
//! (docs/properties.md, "Migration"); [`Variant`] names the deliberately broken drivers each
//! shown caught (`model/tests/migration.rs`).
//!
//! Every step spends something (a token of an attempt's budget, a death, a late event, the
//! client's one cancel, time's one pass, the timer's one firing), so every path is finite and
//! acyclic; MG7's "at the end" is an `always` over states without a step.

use std::fmt;
use std::time::{Duration, Instant};

use prefill_router::migration::{
    AttemptId, BreakReason, Continuation, Migration, MigrationConfig, MigrationError, Next, Step,
    Usage,
};
use prefill_router::request::{FinishReason, GenerateRequest, PrefillInfo};
use stateright::{Model, Property};

mod mutants;

pub use mutants::Variant;

/// The model's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MigrationModelConfig {
    /// Tokens of the original prompt.
    pub prompt_len: u8,
    /// The request's `max_tokens`.
    pub max_tokens: u8,
    /// The machine's migration limit.
    pub limit: u8,
    /// Worker deaths the world may inject in all.
    pub deaths: u8,
}

impl MigrationModelConfig {
    /// Three tokens, a limit of 2 and one death more than the limit (so the limit is used up).
    pub const STANDARD: MigrationModelConfig = MigrationModelConfig {
        prompt_len: 2,
        max_tokens: 3,
        limit: 2,
        deaths: 3,
    };
}

/// The deterministic engine: the next token after `context`. Values are spread (FNV-1a) so a
/// token generated twice or from a wrong context shows.
pub fn next_token(context: &[u32]) -> u32 {
    let h = context
        .iter()
        .fold(0x811c_9dc5_u32, |h, &t| (h ^ t).wrapping_mul(0x0100_0193));
    1000 + h % 1_000_000
}

/// How far an attempt got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttemptState {
    /// Streaming: the current attempt as far as the world knows.
    Live,
    /// Its worker died; `late` says whether a late token may still come.
    Dead {
        /// One late token may still arrive.
        late: bool,
    },
    /// The driver dropped it (the stream ended); `late` says whether a late event may come.
    Dropped {
        /// One late event (a token or a break) may still arrive.
        late: bool,
    },
    /// It finished (the end).
    Done,
}

/// One attempt the driver started.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Attempt {
    /// The machine's id for it.
    pub id: AttemptId,
    /// The prompt it was sent plus what it generated.
    pub context: Vec<u32>,
    /// Tokens it may still generate.
    pub left: u32,
    /// Where it stands.
    pub state: AttemptState,
}

/// How the client's stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ending {
    /// Finished, with its reason and usage.
    Finished(FinishReason, Usage),
    /// Failed typed.
    Failed(MigrationError),
    /// Stopped after the client cancelled.
    Stopped,
}

/// One step of the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MigrationStep {
    /// The live attempt streams its next token.
    Token,
    /// The live attempt streams its last token together with the finish.
    LastWithFinish,
    /// The live attempt's worker dies.
    Die(BreakReason),
    /// Attempt `n` (dead or dropped) delivers a late token.
    LateToken(u32),
    /// Attempt `n` (dropped) reports a late break.
    LateBreak(u32),
    /// The client cancels.
    Cancel,
    /// Time passes beyond the deadline (the timer has not fired).
    TimePasses,
    /// The deadline timer fires.
    Timer,
}

impl fmt::Display for MigrationStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MigrationStep::Token => write!(f, "the live attempt streams a token"),
            MigrationStep::LastWithFinish => {
                write!(f, "the live attempt streams its last token with the finish")
            }
            MigrationStep::Die(r) => write!(f, "the live attempt's worker dies ({})", r.as_str()),
            MigrationStep::LateToken(n) => write!(f, "attempt #{n} delivers a late token"),
            MigrationStep::LateBreak(n) => write!(f, "attempt #{n} reports a late break"),
            MigrationStep::Cancel => write!(f, "the client cancels"),
            MigrationStep::TimePasses => write!(f, "time passes beyond the deadline"),
            MigrationStep::Timer => write!(f, "the deadline timer fires"),
        }
    }
}

/// A state of the model: the machine and what the world saw.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct World {
    /// The machine under check (driven through the model's [`Variant`]).
    pub machine: Migration,
    /// The prompt length of the last request sent (a mutant's memory; the real one ignores it).
    pub last_prompt: u32,
    /// Every attempt started, in order (index = attempt id).
    pub attempts: Vec<Attempt>,
    /// Every token the client got, in order.
    pub emitted: Vec<u32>,
    /// How the client's stream ended.
    pub ending: Option<Ending>,
    /// Deaths the world may still inject.
    pub deaths_left: u8,
    /// Continuations started.
    pub continuations: u8,
    /// The client cancelled.
    pub cancelled: bool,
    /// Time is past the deadline.
    pub past_deadline: bool,
    /// The timer fired.
    pub timer_fired: bool,
    /// A continuation started after the client cancelled (MG4's fault).
    pub continued_after_cancel: bool,
    /// A continuation carried a handoff an attempt already carried (MG5's fault).
    pub handoff_reused: bool,
    /// The machine ended the client's stream a second time (MG7's fault).
    pub ended_twice: bool,
    /// A late token of a dead attempt arrived while a continuation streamed (MGV4's premise).
    pub late_during_continuation: bool,
}

impl World {
    fn live(&self) -> Option<usize> {
        self.attempts
            .iter()
            .position(|a| a.state == AttemptState::Live)
    }
}

/// The model with machine variant `variant`.
#[derive(Clone, Debug)]
pub struct MigrationModel {
    /// Its bounds.
    pub config: MigrationModelConfig,
    /// The real machine or a mutant.
    pub variant: Variant,
    /// The original request (its handoff is the prefill's single-use handle).
    pub original: GenerateRequest,
    /// The engine's uninterrupted output for the original request.
    pub reference: Vec<u32>,
    base: Instant,
}

impl MigrationModel {
    /// The model with these bounds over `variant`.
    pub fn new(config: MigrationModelConfig, variant: Variant) -> Self {
        let prompt: Vec<u32> = (1..=u32::from(config.prompt_len)).collect();
        let original = GenerateRequest {
            handoff: Some(PrefillInfo {
                worker: 1,
                prompt_tokens: u32::from(config.prompt_len),
                engine_params: Some("{\"remote_block_ids\":[1]}".into()),
                ..PrefillInfo::default()
            }),
            ..GenerateRequest::new(prompt.clone(), u32::from(config.max_tokens))
        };
        let mut context = prompt;
        let mut reference = Vec::new();
        for _ in 0..config.max_tokens {
            let t = next_token(&context);
            context.push(t);
            reference.push(t);
        }
        MigrationModel {
            config,
            variant,
            original,
            reference,
            base: Instant::now(),
        }
    }

    fn deadline(&self) -> Instant {
        self.base + Duration::from_secs(1)
    }

    fn now(&self, s: &World) -> Instant {
        if s.past_deadline {
            self.deadline()
        } else {
            self.base
        }
    }

    /// Carries out what the machine answered, as the driver does.
    fn carry_out(&self, s: &mut World, step: Step) {
        s.emitted.extend(step.emit);
        match step.next {
            None => {}
            Some(Next::Continue(c)) => self.start(s, c),
            Some(next) => {
                let ending = match next {
                    Next::Finish(f) => Ending::Finished(f.reason, f.usage),
                    Next::Fail(e) => Ending::Failed(e),
                    Next::Stop => Ending::Stopped,
                    Next::Continue(_) => unreachable!("handled above"),
                };
                s.ended_twice |= s.ending.is_some();
                s.ending = Some(ending);
                // The stream ended: the driver drops the live attempt with it.
                if let Some(i) = s.live() {
                    s.attempts[i].state = AttemptState::Dropped { late: true };
                }
            }
        }
    }

    fn start(&self, s: &mut World, c: Continuation) {
        s.continuations += 1;
        s.continued_after_cancel |= s.cancelled;
        // Every attempt so far carried the original's handle (the first) or none.
        s.handoff_reused |=
            c.request.handoff.is_some() && c.request.handoff == self.original.handoff;
        s.last_prompt = u32::try_from(c.request.token_ids.len()).unwrap_or(u32::MAX);
        s.attempts.push(Attempt {
            id: c.attempt,
            context: c.request.token_ids,
            left: c.request.max_tokens,
            state: AttemptState::Live,
        });
    }

    /// Whether the world has no step left (the end of a path).
    pub fn is_over(&self, s: &World) -> bool {
        let mut steps = Vec::new();
        self.actions(s, &mut steps);
        steps.is_empty()
    }
}

impl Model for MigrationModel {
    type State = World;
    type Action = MigrationStep;

    fn init_states(&self) -> Vec<World> {
        vec![World {
            machine: self.variant.fresh(
                self.original.clone(),
                MigrationConfig {
                    limit: u32::from(self.config.limit),
                },
                Some(self.deadline()),
            ),
            last_prompt: u32::from(self.config.prompt_len),
            attempts: vec![Attempt {
                id: AttemptId(0),
                context: self.original.token_ids.clone(),
                left: self.original.max_tokens,
                state: AttemptState::Live,
            }],
            emitted: Vec::new(),
            ending: None,
            deaths_left: self.config.deaths,
            continuations: 0,
            cancelled: false,
            past_deadline: false,
            timer_fired: false,
            continued_after_cancel: false,
            handoff_reused: false,
            ended_twice: false,
            late_during_continuation: false,
        }]
    }

    fn actions(&self, s: &World, out: &mut Vec<MigrationStep>) {
        if let Some(i) = s.live() {
            let a = &s.attempts[i];
            if a.left > 0 {
                out.push(MigrationStep::Token);
            }
            if a.left == 1 {
                out.push(MigrationStep::LastWithFinish);
            }
            if s.deaths_left > 0 {
                for reason in BreakReason::ALL {
                    out.push(MigrationStep::Die(reason));
                }
            }
        }
        for (n, a) in s.attempts.iter().enumerate() {
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            match a.state {
                AttemptState::Dead { late: true } => out.push(MigrationStep::LateToken(n)),
                AttemptState::Dropped { late: true } => {
                    out.push(MigrationStep::LateToken(n));
                    out.push(MigrationStep::LateBreak(n));
                }
                _ => {}
            }
        }
        if !s.cancelled {
            out.push(MigrationStep::Cancel);
        }
        if !s.past_deadline {
            out.push(MigrationStep::TimePasses);
        } else if !s.timer_fired {
            out.push(MigrationStep::Timer);
        }
    }

    fn next_state(&self, s: &World, step: MigrationStep) -> Option<World> {
        let mut n = s.clone();
        let v = self.variant;
        let machine_step = match step {
            MigrationStep::Token | MigrationStep::LastWithFinish => {
                let i = n.live()?;
                let a = &mut n.attempts[i];
                let t = next_token(&a.context);
                a.context.push(t);
                a.left -= 1;
                let id = a.id;
                if step == MigrationStep::LastWithFinish {
                    a.state = AttemptState::Done;
                    v.finish(&mut n, id, &[t], FinishReason::Length)
                } else {
                    v.tokens(&mut n, id, &[t])
                }
            }
            MigrationStep::Die(reason) => {
                n.deaths_left -= 1;
                let i = n.live()?;
                n.attempts[i].state = AttemptState::Dead { late: true };
                let id = n.attempts[i].id;
                let now = self.now(&n);
                v.broke(&mut n, id, reason, now)
            }
            MigrationStep::LateToken(k) => {
                let a = n.attempts.get_mut(usize::try_from(k).ok()?)?;
                a.state = match a.state {
                    AttemptState::Dead { .. } => AttemptState::Dead { late: false },
                    _ => AttemptState::Dropped { late: false },
                };
                let t = next_token(&a.context);
                a.context.push(t);
                let id = a.id;
                n.late_during_continuation |= n.live().is_some() && n.ending.is_none();
                v.tokens(&mut n, id, &[t])
            }
            MigrationStep::LateBreak(k) => {
                let a = n.attempts.get_mut(usize::try_from(k).ok()?)?;
                a.state = AttemptState::Dropped { late: false };
                let id = a.id;
                let now = self.now(&n);
                v.broke(&mut n, id, BreakReason::ConnectionDropped, now)
            }
            MigrationStep::Cancel => {
                n.cancelled = true;
                v.cancel(&mut n)
            }
            MigrationStep::TimePasses => {
                n.past_deadline = true;
                Step::default()
            }
            MigrationStep::Timer => {
                n.timer_fired = true;
                let now = self.now(&n);
                v.timeout(&mut n, now)
            }
        };
        let machine_step = v.after(&self.original, &n, machine_step);
        self.carry_out(&mut n, machine_step);
        Some(n)
    }

    fn format_action(&self, step: &MigrationStep) -> String {
        step.to_string()
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(EMITTED_IS_A_PREFIX, |m: &MigrationModel, s: &World| {
                m.reference.starts_with(&s.emitted)
            }),
            Property::always(NO_TOKEN_EMITTED_TWICE, |_, s: &World| {
                s.emitted
                    .iter()
                    .enumerate()
                    .all(|(i, t)| !s.emitted[..i].contains(t))
            }),
            Property::always(AT_MOST_LIMIT_MIGRATIONS, |m: &MigrationModel, s: &World| {
                s.continuations <= m.config.limit
            }),
            Property::always(CANCEL_STOPS_EVERY_CONTINUATION, |_, s: &World| {
                !s.cancelled || (!s.continued_after_cancel && s.live().is_none())
            }),
            Property::always(HANDOFF_NEVER_REUSED, |_, s: &World| !s.handoff_reused),
            Property::always(
                USAGE_COUNTS_EACH_TOKEN_ONCE,
                |m: &MigrationModel, s: &World| match s.ending {
                    Some(Ending::Finished(_, usage)) => {
                        usage.prompt_tokens == u32::from(m.config.prompt_len)
                            && usage.completion_tokens as usize == s.emitted.len()
                    }
                    _ => true,
                },
            ),
            Property::always(STREAM_ENDS_EXACTLY_ONCE, |m: &MigrationModel, s: &World| {
                !s.ended_twice && (s.ending.is_some() || !m.is_over(s))
            }),
            Property::sometimes(
                MIGRATED_STREAM_COMPLETES,
                |m: &MigrationModel, s: &World| {
                    s.continuations == m.config.limit
                        && s.emitted == m.reference
                        && matches!(s.ending, Some(Ending::Finished(..)))
                },
            ),
            Property::sometimes(LIMIT_USED_UP, |_, s: &World| {
                matches!(
                    s.ending,
                    Some(Ending::Failed(MigrationError::LimitUsedUp { .. }))
                )
            }),
            Property::sometimes(DEADLINE_AT_A_BREAK, |_, s: &World| {
                !s.timer_fired
                    && matches!(
                        s.ending,
                        Some(Ending::Failed(MigrationError::DeadlinePassed { .. }))
                    )
            }),
            Property::sometimes(LATE_TOKEN_DURING_CONTINUATION, |_, s: &World| {
                s.late_during_continuation && s.continuations > 0
            }),
            Property::sometimes(CANCEL_AFTER_MIGRATION, |_, s: &World| {
                s.cancelled && s.continuations > 0 && s.ending == Some(Ending::Stopped)
            }),
        ]
    }
}

/// MG1: the tokens the client got are always a prefix of the engine's uninterrupted output.
pub const EMITTED_IS_A_PREFIX: &str = "MG1 emitted_tokens_are_a_prefix_of_the_uninterrupted_output";
/// MG2: no token reaches the client twice.
pub const NO_TOKEN_EMITTED_TWICE: &str = "MG2 no_token_is_emitted_twice";
/// MG3: at most `limit` continuations start.
pub const AT_MOST_LIMIT_MIGRATIONS: &str = "MG3 at_most_limit_migrations";
/// MG4: after the client cancelled no continuation starts and no attempt is live.
pub const CANCEL_STOPS_EVERY_CONTINUATION: &str = "MG4 a_cancel_stops_every_continuation";
/// MG5: no continuation carries the original's (single-use) handoff.
pub const HANDOFF_NEVER_REUSED: &str = "MG5 a_handoff_is_never_reused_across_a_migration";
/// MG6: a finished stream's usage counts the original prompt and each emitted token once.
pub const USAGE_COUNTS_EACH_TOKEN_ONCE: &str = "MG6 usage_counts_each_token_once";
/// MG7: the client's stream ends at most once, and every path's end has ended it.
pub const STREAM_ENDS_EXACTLY_ONCE: &str = "MG7 the_stream_ends_exactly_once";
/// MGV1: a stream migrated `limit` times finishes with the whole uninterrupted output.
pub const MIGRATED_STREAM_COMPLETES: &str = "MGV1 a stream migrated to the limit completes whole";
/// MGV2: a break after the limit ends the stream typed.
pub const LIMIT_USED_UP: &str = "MGV2 sometimes the limit is used up";
/// MGV3: a break after the deadline (before the timer fired) ends the stream typed.
pub const DEADLINE_AT_A_BREAK: &str = "MGV3 sometimes a break finds the deadline passed";
/// MGV4: a dead attempt's late token arrives while a continuation streams.
pub const LATE_TOKEN_DURING_CONTINUATION: &str = "MGV4 sometimes a late token races a continuation";
/// MGV5: the client cancels a migrated stream.
pub const CANCEL_AFTER_MIGRATION: &str = "MGV5 sometimes a migrated stream is cancelled";
