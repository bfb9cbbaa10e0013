//! The migration rules, one test each, and the machine against a naive reference over random
//! interleavings of tokens, worker deaths, late tokens of dead workers, cancels and deadlines.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::request::PrefillInfo;

/// A deterministic engine: its next token is a function of everything before it (prompt and
/// tokens generated so far), as greedy decoding is. The values are spread so that a token
/// generated twice, or from the wrong context, shows.
fn next_token(context: &[u32]) -> u32 {
    let h = context
        .iter()
        .fold(0x811c_9dc5_u32, |h, &t| (h ^ t).wrapping_mul(0x0100_0193));
    // One value in 64 is the stop token, so some streams stop early.
    if h % 64 == 0 {
        STOP
    } else {
        1000 + h % 1_000_000
    }
}

const STOP: u32 = 7;

/// The engine's uninterrupted output for `request`: its tokens and finish reason.
fn uninterrupted(request: &GenerateRequest) -> (Vec<u32>, FinishReason) {
    let mut context = request.token_ids.clone();
    let mut out = Vec::new();
    while out.len() < request.max_tokens as usize {
        let t = next_token(&context);
        context.push(t);
        out.push(t);
        if request.stop_token_ids.contains(&t) {
            return (out, FinishReason::Stop);
        }
    }
    (out, FinishReason::Length)
}

fn request(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        stop_token_ids: vec![STOP],
        handoff: Some(PrefillInfo {
            worker: 1,
            prompt_tokens: u32::try_from(prompt.len()).unwrap(),
            engine_params: Some("{\"remote_block_ids\":[1]}".into()),
            ..PrefillInfo::default()
        }),
        ..GenerateRequest::new(prompt, max_tokens)
    }
}

fn now() -> Instant {
    Instant::now()
}

fn continuation(step: Step) -> Continuation {
    match step.next {
        Some(Next::Continue(c)) => c,
        other => panic!("expected a continuation, got {other:?}"),
    }
}

#[test]
fn a_continuation_carries_the_prompt_and_every_emitted_token_and_what_is_left() {
    let original = request(vec![1, 2, 3], 5);
    let mut m = Migration::new(original.clone(), MigrationConfig::default(), None);
    assert_eq!(m.handle_tokens(AttemptId(0), &[10, 11]).emit, vec![10, 11]);
    let c = continuation(m.handle_break(
        AttemptId(0),
        BreakReason::ConnectionDropped,
        Some(100),
        now(),
    ));
    assert_eq!(c.attempt, AttemptId(1));
    assert_eq!(c.request.token_ids, vec![1, 2, 3, 10, 11]);
    assert_eq!(c.request.max_tokens, 3);
    assert_eq!(c.request.stop_token_ids, original.stop_token_ids);
    assert_eq!(c.avoid, vec![100]);
    assert_eq!(c.reason, BreakReason::ConnectionDropped);
}

#[test]
fn a_handoff_is_never_reused_across_a_migration() {
    let original = request(vec![1, 2], 4);
    assert!(original.handoff.is_some());
    let mut m = Migration::new(original, MigrationConfig::default(), None);
    let c = continuation(m.handle_break(AttemptId(0), BreakReason::WorkerGone, None, now()));
    assert_eq!(c.request.handoff, None);
}

#[test]
fn no_token_is_emitted_twice_when_a_dead_worker_flushes_late() {
    let mut m = Migration::new(request(vec![1], 4), MigrationConfig::default(), None);
    let _ = m.handle_tokens(AttemptId(0), &[10]);
    let _ = continuation(m.handle_break(AttemptId(0), BreakReason::WorkerVanished, Some(5), now()));
    // The vanished worker's stream still delivers the token the continuation will make.
    assert_eq!(m.handle_tokens(AttemptId(0), &[11]), Step::default());
    assert_eq!(
        m.handle_break(AttemptId(0), BreakReason::ConnectionDropped, None, now()),
        Step::default()
    );
    assert_eq!(m.handle_tokens(AttemptId(1), &[11]).emit, vec![11]);
    assert_eq!(m.emitted(), &[10, 11]);
}

#[test]
fn at_most_limit_migrations_then_a_typed_error() {
    let mut m = Migration::new(request(vec![1], 9), MigrationConfig { limit: 2 }, None);
    for i in 0..2 {
        let c = continuation(m.handle_break(AttemptId(i), BreakReason::WorkerGone, None, now()));
        assert_eq!(c.attempt, AttemptId(i + 1));
    }
    let step = m.handle_break(AttemptId(2), BreakReason::ConnectionDropped, None, now());
    assert_eq!(
        step.next,
        Some(Next::Fail(MigrationError::LimitUsedUp {
            limit: 2,
            migrations: 2,
            reason: BreakReason::ConnectionDropped
        }))
    );
    assert_eq!(m.state(), MigrationState::Failed);
    assert_eq!(m.migrations(), 2);
    assert_eq!(m.migrations_for(BreakReason::WorkerGone), 2);
    assert_eq!(m.migrations_for(BreakReason::ConnectionDropped), 0);
}

#[test]
fn a_limit_of_zero_turns_migration_off() {
    let mut m = Migration::new(request(vec![1], 9), MigrationConfig { limit: 0 }, None);
    let step = m.handle_break(AttemptId(0), BreakReason::WorkerVanished, None, now());
    assert!(matches!(
        step.next,
        Some(Next::Fail(MigrationError::LimitUsedUp { limit: 0, .. }))
    ));
}

#[test]
fn no_continuation_after_the_deadline() {
    let start = now();
    let deadline = start + Duration::from_secs(10);
    let mut m = Migration::new(
        request(vec![1], 9),
        MigrationConfig::default(),
        Some(deadline),
    );
    assert_eq!(m.poll_timeout(), Some(deadline));
    let _ = m.handle_tokens(AttemptId(0), &[10]);
    assert_eq!(
        m.handle_timeout(start + Duration::from_secs(9)),
        Step::default()
    );
    let step = m.handle_break(AttemptId(0), BreakReason::WorkerGone, None, deadline);
    assert_eq!(
        step.next,
        Some(Next::Fail(MigrationError::DeadlinePassed {
            emitted: 1,
            migrations: 0
        }))
    );
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn a_deadline_passing_mid_stream_fails_it() {
    let start = now();
    let mut m = Migration::new(request(vec![1], 9), MigrationConfig::default(), Some(start));
    let step = m.handle_timeout(start);
    assert!(matches!(
        step.next,
        Some(Next::Fail(MigrationError::DeadlinePassed { .. }))
    ));
    assert_eq!(m.handle_tokens(AttemptId(0), &[1]), Step::default());
}

#[test]
fn after_a_cancel_no_continuation_starts() {
    let mut m = Migration::new(request(vec![1], 9), MigrationConfig::default(), None);
    assert_eq!(m.handle_cancel().next, Some(Next::Stop));
    assert_eq!(m.handle_cancel(), Step::default());
    assert_eq!(
        m.handle_break(AttemptId(0), BreakReason::WorkerGone, None, now()),
        Step::default()
    );
    assert_eq!(m.state(), MigrationState::Cancelled);
    assert_eq!(m.migrations(), 0);
}

#[test]
fn a_finished_stream_counts_the_original_prompt_and_each_token_once() {
    let mut m = Migration::new(request(vec![1, 2, 3], 4), MigrationConfig::default(), None);
    let _ = m.handle_tokens(AttemptId(0), &[10, 11]);
    let _ = continuation(m.handle_break(AttemptId(0), BreakReason::WorkerGone, None, now()));
    let step = m.handle_finish(AttemptId(1), &[12], FinishReason::Stop);
    assert_eq!(step.emit, vec![12]);
    assert_eq!(
        step.next,
        Some(Next::Finish(Finished {
            reason: FinishReason::Stop,
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 3
            }
        }))
    );
}

#[test]
fn nothing_past_max_tokens_is_emitted_and_a_full_stream_finishes_by_length() {
    let mut m = Migration::new(request(vec![1], 3), MigrationConfig::default(), None);
    let step = m.handle_tokens(AttemptId(0), &[10, 11, 12, 13]);
    assert_eq!(step.emit, vec![10, 11, 12]);
    assert!(matches!(
        step.next,
        Some(Next::Finish(Finished {
            reason: FinishReason::Length,
            ..
        }))
    ));
}

#[test]
fn a_break_after_the_last_token_finishes_instead_of_continuing() {
    // A stream whose finish was lost with the connection: nothing is left to generate.
    let mut m = Migration::new(request(vec![1], 0), MigrationConfig::default(), None);
    let step = m.handle_break(AttemptId(0), BreakReason::ConnectionDropped, None, now());
    assert!(matches!(
        step.next,
        Some(Next::Finish(Finished {
            reason: FinishReason::Length,
            ..
        }))
    ));
}

#[test]
fn break_reasons_have_stable_labels() {
    let labels: Vec<&str> = BreakReason::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(
        labels,
        ["connection_dropped", "worker_vanished", "worker_gone"]
    );
}

/// What the world does next, in a random run.
#[derive(Clone, Debug)]
enum Op {
    /// The current attempt streams up to this many tokens in one response.
    Tokens(usize),
    /// The current attempt's worker dies.
    Break(BreakReason),
    /// A dead attempt flushes its next token late.
    Late,
    /// The client cancels.
    Cancel,
    /// Time passes beyond the deadline (the driver's timer has not fired yet).
    Pass,
    /// The driver's timer fires.
    Timer,
    /// The current attempt sends everything it has left, and more, then finishes.
    Runaway,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1usize..4).prop_map(Op::Tokens),
        3 => prop::sample::select(BreakReason::ALL.to_vec()).prop_map(Op::Break),
        1 => Just(Op::Late),
        1 => Just(Op::Cancel),
        1 => Just(Op::Pass),
        1 => Just(Op::Timer),
        1 => Just(Op::Runaway),
    ]
}

/// One engine attempt: the request it got and what it generated.
struct Attempt {
    id: AttemptId,
    context: Vec<u32>,
    left: u32,
    stopped: bool,
}

impl Attempt {
    fn new(id: AttemptId, request: &GenerateRequest) -> Self {
        Attempt {
            id,
            context: request.token_ids.clone(),
            left: request.max_tokens,
            stopped: false,
        }
    }

    /// Up to `n` next tokens, and whether it is done.
    fn generate(&mut self, n: usize) -> (Vec<u32>, bool) {
        let mut out = Vec::new();
        while out.len() < n && self.left > 0 && !self.stopped {
            let t = next_token(&self.context);
            self.context.push(t);
            self.left -= 1;
            self.stopped = t == STOP;
            out.push(t);
        }
        (out, self.left == 0 || self.stopped)
    }
}

/// How the client's stream ended.
#[derive(Clone, Debug, PartialEq, Eq)]
enum End {
    Finished(FinishReason, Usage),
    Failed(&'static str),
    Cancelled,
}

/// The client's view: every token emitted, in order, and the end.
#[derive(Debug, PartialEq, Eq)]
struct Transcript {
    tokens: Vec<u32>,
    end: Option<End>,
    migrations: u32,
}

/// Drives the real machine with a deterministic engine through `ops`.
fn drive(original: &GenerateRequest, limit: u32, ops: &[Op]) -> (Transcript, Vec<GenerateRequest>) {
    let start = Instant::now();
    let deadline = start + Duration::from_secs(1);
    let mut m = Migration::new(original.clone(), MigrationConfig { limit }, Some(deadline));
    let mut current = Some(Attempt::new(AttemptId(0), original));
    let mut dead: Vec<Attempt> = Vec::new();
    let mut sent = vec![original.clone()];
    let mut t = Transcript {
        tokens: Vec::new(),
        end: None,
        migrations: 0,
    };
    let mut clock = start;
    for op in ops {
        let step = match op {
            Op::Tokens(n) => match current.as_mut() {
                Some(a) => {
                    let (tokens, done) = a.generate(*n);
                    let id = a.id;
                    if done {
                        let reason = if a.stopped {
                            FinishReason::Stop
                        } else {
                            FinishReason::Length
                        };
                        current = None;
                        m.handle_finish(id, &tokens, reason)
                    } else {
                        m.handle_tokens(id, &tokens)
                    }
                }
                None => continue,
            },
            Op::Runaway => match current.as_mut() {
                Some(a) => {
                    let id = a.id;
                    let (mut tokens, _) = a.generate(usize::MAX);
                    tokens.extend([1, 2, 3]);
                    current = None;
                    m.handle_finish(id, &tokens, FinishReason::Length)
                }
                None => continue,
            },
            Op::Break(reason) => match current.take() {
                Some(a) => {
                    let id = a.id;
                    dead.push(a);
                    m.handle_break(id, *reason, None, clock)
                }
                None => continue,
            },
            Op::Late => match dead.last_mut() {
                Some(a) => {
                    let (tokens, _) = a.generate(1);
                    m.handle_tokens(a.id, &tokens)
                }
                None => continue,
            },
            Op::Cancel => m.handle_cancel(),
            Op::Pass => {
                clock = deadline;
                continue;
            }
            Op::Timer => m.handle_timeout(clock),
        };
        t.tokens.extend(step.emit);
        match step.next {
            None => {}
            Some(Next::Continue(c)) => {
                t.migrations += 1;
                current = Some(Attempt::new(c.attempt, &c.request));
                sent.push(c.request);
            }
            Some(next) => {
                assert!(t.end.is_none(), "a second ending: {next:?}");
                t.end = Some(match next {
                    Next::Finish(f) => End::Finished(f.reason, f.usage),
                    Next::Fail(MigrationError::LimitUsedUp { .. }) => End::Failed("limit"),
                    Next::Fail(MigrationError::DeadlinePassed { .. }) => End::Failed("deadline"),
                    Next::Stop => End::Cancelled,
                    Next::Continue(_) => unreachable!(),
                });
                // The driver drops the current attempt with the stream.
                if let Some(a) = current.take() {
                    dead.push(a);
                }
            }
        }
    }
    (t, sent)
}

/// The naive reference: the client's view is a cursor over the uninterrupted output.
fn reference(original: &GenerateRequest, limit: u32, ops: &[Op]) -> Transcript {
    let (output, reason) = uninterrupted(original);
    let prompt_tokens = u32::try_from(original.token_ids.len()).unwrap();
    let mut t = Transcript {
        tokens: Vec::new(),
        end: None,
        migrations: 0,
    };
    let mut past = false;
    let mut streaming = true; // an attempt of the stream is live
    for op in ops {
        if t.end.is_some() {
            break;
        }
        match op {
            Op::Tokens(_) | Op::Runaway if !streaming => {}
            Op::Tokens(n) => {
                let to = (t.tokens.len() + n).min(output.len());
                t.tokens.extend_from_slice(&output[t.tokens.len()..to]);
            }
            Op::Runaway => t.tokens = output.clone(),
            Op::Break(_) if !streaming || t.tokens.len() == output.len() => {}
            Op::Break(_) if past => t.end = Some(End::Failed("deadline")),
            Op::Break(_) if t.migrations >= limit => t.end = Some(End::Failed("limit")),
            Op::Break(_) => t.migrations += 1,
            Op::Late => {}
            Op::Cancel => t.end = Some(End::Cancelled),
            Op::Pass => past = true,
            Op::Timer if past => t.end = Some(End::Failed("deadline")),
            Op::Timer => {}
        }
        // The machine learns the stream is complete from the current attempt only.
        let attempt_spoke = matches!(op, Op::Tokens(_) | Op::Runaway | Op::Break(_));
        if t.end.is_none() && attempt_spoke && t.tokens.len() == output.len() {
            let completion_tokens = u32::try_from(output.len()).unwrap();
            let usage = Usage {
                prompt_tokens,
                completion_tokens,
            };
            t.end = Some(End::Finished(reason, usage));
        }
        streaming = t.end.is_none();
    }
    t
}

proptest! {
    // Shrinking is bounded so that a broken machine (a cargo-mutants mutant) fails in seconds.
    #![proptest_config(ProptestConfig {
        cases: 2000,
        max_shrink_iters: 512,
        ..ProptestConfig::default()
    })]

    /// Over any interleaving, the client sees what the reference says: a prefix of the
    /// uninterrupted output (every token once, in order), at most `limit` migrations, one ending
    /// with usage counting the original prompt and each token once; and no continuation carries
    /// a handoff.
    #[test]
    fn the_machine_matches_the_reference_over_random_interleavings(
        prompt in prop::collection::vec(0u32..50, 1..6),
        max_tokens in 0u32..12,
        limit in 0u32..4,
        ops in prop::collection::vec(op(), 0..40),
    ) {
        let original = request(prompt, max_tokens);
        let (got, sent) = drive(&original, limit, &ops);
        let want = reference(&original, limit, &ops);
        prop_assert_eq!(&got, &want);
        let (output, _) = uninterrupted(&original);
        prop_assert!(output.starts_with(&got.tokens));
        prop_assert!(got.migrations <= limit);
        prop_assert!(sent.iter().skip(1).all(|r| r.handoff.is_none()));
    }
}
