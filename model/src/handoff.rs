//! A small stateright model of one request's prefill handoff: the **real**
//! [`prefill_router::handoff::Handoff`] machine (vLLM's `kv_transfer_params`, a single-use
//! handle on KV blocks the prefill engine holds) in the world that drives it.
//!
//! The world: the prefill answers with a handle, without one (the decode recomputes), or with a
//! terminal answer (its one token was a stop); the decode dispatcher's retry loop makes up to
//! [`HandoffConfig::attempts`] attempts, each calling `handle_send` first and ending
//! [`Answered`](SendOutcome::Answered), [`Unsent`](SendOutcome::Unsent) (connection refused, or
//! the worker left discovery before the request did) or
//! [`FailedAfterSend`](SendOutcome::FailedAfterSend) (reset, engine error, the worker left
//! discovery mid-request); it may also find no routable decode worker at all. The client may go
//! (a cancel or the request's deadline) at any step, also while an attempt is in flight, and the
//! router's guard then calls `handle_abandon(ClientGone)`. The router counts every ending in a
//! ledger.
//!
//! The state records what the **world** saw, not the machine's account of itself: how many
//! decode attempts left carrying the handle (an attempt that did not end unsent, and an attempt
//! in flight when the client went, which "maybe left"), which endings the router counted, and
//! whether an attempt left carrying the handle after the router counted an abandon. Properties
//! HO1..HO3 are safety checks over those records (docs/properties.md, "Prefill handoff");
//! mutants ([`ResendAfterFailure`], [`SilentClientGone`], [`SendAfterAbandon`], [`DoubleCount`])
//! show each one bites (`model/tests/handoff.rs`).
//!
//! Every step spends something (the prefill answers once, an attempt spends the budget, the
//! client goes once, the phase only moves forward), so every path is finite and acyclic, and
//! the only states without a step are [`Phase::Over`]: HO2's "at the end" is a plain `always`
//! over `Over` states.

use std::fmt;
use std::hash::Hash;
use std::marker::PhantomData;

use prefill_router::handoff::{AbandonReason, Ending, Handoff, HandoffError, SendOutcome};
use stateright::{Model, Property};

/// A handoff machine the model can check: the real one or a deliberately broken driver of it.
///
/// The methods are the calls the router and the dispatcher make; a mutant wraps the real
/// [`Handoff`] and alters what goes in or comes out (the library has no mutation hooks).
pub trait Subject: Clone + fmt::Debug + Hash + Eq + Send + Sync + 'static {
    /// Name used in reports.
    const NAME: &'static str;
    /// The handoff the prefill just answered with.
    fn fresh() -> Self;
    /// The dispatcher is about to send an attempt carrying the handle.
    fn send(&mut self) -> Result<(), HandoffError>;
    /// The attempt in flight ended `outcome`.
    fn send_result(&mut self, outcome: SendOutcome) -> Result<(), HandoffError>;
    /// The router gives it up; the ending the router counts, if any.
    fn abandon(&mut self, reason: AbandonReason) -> Option<Ending>;
    /// Whether the retry loop may make another attempt carrying it.
    fn may_send(&self) -> bool;
    /// The ending the dispatcher counts after an attempt's result, if it ended.
    fn ending(&self) -> Option<Ending>;
}

/// The real machine, driven as the router and the dispatcher drive it.
pub type RealHandoff = Handoff;

impl Subject for Handoff {
    const NAME: &'static str = "real";
    fn fresh() -> Self {
        Handoff::new()
    }
    fn send(&mut self) -> Result<(), HandoffError> {
        self.handle_send()
    }
    fn send_result(&mut self, outcome: SendOutcome) -> Result<(), HandoffError> {
        self.handle_send_result(outcome)
    }
    fn abandon(&mut self, reason: AbandonReason) -> Option<Ending> {
        self.handle_abandon(reason)
    }
    fn may_send(&self) -> bool {
        Handoff::may_send(self)
    }
    fn ending(&self) -> Option<Ending> {
        Handoff::ending(self)
    }
}

mod mutants;

pub use mutants::{DoubleCount, ResendAfterFailure, SendAfterAbandon, SilentClientGone};

/// The model's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HandoffConfig {
    /// Decode attempts the retry loop may make in all (the retry budget plus one).
    pub attempts: u8,
}

impl HandoffConfig {
    /// A retry budget of 2 (3 attempts): enough for an unsent attempt, a retry that carries the
    /// handle, and one more a broken loop could resend it on.
    pub const STANDARD: HandoffConfig = HandoffConfig { attempts: 3 };
}

/// What the prefill answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PrefillAnswer {
    /// No engine handle: no handoff, the decode recomputes the prompt (counted `recomputed`).
    NoHandle,
    /// An engine handle: a fresh [`Handoff`] (held).
    Handle,
    /// A handle, but the prefill's one token was a stop: the request is finished, the router
    /// abandons the handoff (`PrefillFinished`).
    Stop,
}

/// How a decode attempt in flight ended, as the dispatcher sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttemptEnd {
    /// The worker answered (its first response).
    Answered,
    /// The connection was refused: the request never left.
    Refused,
    /// The worker left discovery before the request was written: it never left.
    RemovedBeforeSend,
    /// Reset, dead stream, engine 5xx or the attempt's timeout: it may have reached the worker.
    Failed,
    /// The worker left discovery while the request was in flight: it may have reached it.
    RemovedMidRequest,
}

impl AttemptEnd {
    /// Every way an attempt ends.
    pub const ALL: [AttemptEnd; 5] = [
        AttemptEnd::Answered,
        AttemptEnd::Refused,
        AttemptEnd::RemovedBeforeSend,
        AttemptEnd::Failed,
        AttemptEnd::RemovedMidRequest,
    ];

    /// The outcome the dispatcher feeds the machine.
    pub fn outcome(self) -> SendOutcome {
        match self {
            AttemptEnd::Answered => SendOutcome::Answered,
            AttemptEnd::Refused | AttemptEnd::RemovedBeforeSend => SendOutcome::Unsent,
            AttemptEnd::Failed | AttemptEnd::RemovedMidRequest => SendOutcome::FailedAfterSend,
        }
    }
}

/// Why the client went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Gone {
    /// It disconnected or cancelled.
    Cancel,
    /// The request's deadline passed.
    Deadline,
}

/// One step of the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HandoffStep {
    /// The prefill answers.
    Prefill(PrefillAnswer),
    /// The retry loop sends an attempt (calling `handle_send` first when there is a handoff).
    Send,
    /// The retry loop finds no routable decode worker: the decode fails.
    NoWorker,
    /// The attempt in flight ends.
    End(AttemptEnd),
    /// The answered decode's response completes.
    Finish,
    /// The client goes; the router's guard abandons the handoff (`ClientGone`).
    ClientGone(Gone),
    /// The retry loop notices the client is gone before its next attempt and stops.
    Notice,
}

impl fmt::Display for HandoffStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandoffStep::Prefill(PrefillAnswer::NoHandle) => {
                write!(f, "the prefill answers without a handle")
            }
            HandoffStep::Prefill(PrefillAnswer::Handle) => {
                write!(f, "the prefill answers with a handle")
            }
            HandoffStep::Prefill(PrefillAnswer::Stop) => {
                write!(f, "the prefill answers with a stop token")
            }
            HandoffStep::Send => write!(f, "the dispatcher sends a decode attempt"),
            HandoffStep::NoWorker => write!(f, "no decode worker is routable"),
            HandoffStep::End(AttemptEnd::Answered) => write!(f, "the attempt is answered"),
            HandoffStep::End(AttemptEnd::Refused) => {
                write!(f, "the attempt's connection is refused")
            }
            HandoffStep::End(AttemptEnd::RemovedBeforeSend) => {
                write!(f, "the attempt's worker is removed before the request left")
            }
            HandoffStep::End(AttemptEnd::Failed) => {
                write!(f, "the attempt fails after it left (reset)")
            }
            HandoffStep::End(AttemptEnd::RemovedMidRequest) => {
                write!(f, "the attempt's worker is removed mid-request")
            }
            HandoffStep::Finish => write!(f, "the decode's response completes"),
            HandoffStep::ClientGone(Gone::Cancel) => write!(f, "the client cancels"),
            HandoffStep::ClientGone(Gone::Deadline) => write!(f, "the request's deadline passes"),
            HandoffStep::Notice => write!(f, "the dispatcher notices the client is gone"),
        }
    }
}

/// Where the request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Waiting for the prefill's answer.
    Prefill,
    /// The retry loop is about to make an attempt.
    Idle,
    /// An attempt is in flight.
    InFlight,
    /// An attempt was answered; its response streams.
    Streaming,
    /// The request is over (the only phase without a step).
    Over,
}

/// The router's ledger: each ending counted, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ledger {
    /// `Ending::Delivered`.
    pub delivered: u8,
    /// `Ending::CarriedThenFailed`.
    pub carried_then_failed: u8,
    /// `Ending::Abandoned`, by [`AbandonReason`] (in `AbandonReason::ALL` order).
    pub abandoned: [u8; 3],
}

impl Ledger {
    /// Counts one ending.
    pub fn count(&mut self, ending: Ending) {
        match ending {
            Ending::Delivered => self.delivered += 1,
            Ending::CarriedThenFailed => self.carried_then_failed += 1,
            Ending::Abandoned(reason) => self.abandoned[reason_index(reason)] += 1,
        }
    }

    /// Endings counted in all.
    pub fn total(&self) -> u8 {
        self.delivered + self.carried_then_failed + self.abandoned.iter().sum::<u8>()
    }

    /// Abandons counted for `reason`.
    pub fn abandoned(&self, reason: AbandonReason) -> u8 {
        self.abandoned[reason_index(reason)]
    }
}

fn reason_index(reason: AbandonReason) -> usize {
    match reason {
        AbandonReason::PrefillFinished => 0,
        AbandonReason::DecodeUnreachable => 1,
        AbandonReason::ClientGone => 2,
    }
}

/// A state of the model: the machine under check and what the world saw.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct World<H> {
    /// Where the request stands.
    pub phase: Phase,
    /// The handoff, once the prefill answered with a handle.
    pub handoff: Option<H>,
    /// Handoffs issued (0 or 1).
    pub issued: u8,
    /// Decode attempts the loop may still make.
    pub attempts_left: u8,
    /// Decode attempts that left carrying the handle: those that did not end unsent, and one in
    /// flight when the client went ("maybe left").
    pub left_carrying: u8,
    /// The endings the router counted.
    pub ledger: Ledger,
    /// The prefill answered without a handle (the decode recomputes).
    pub recomputed: bool,
    /// The client went (cancel or deadline).
    pub client_gone: bool,
    /// The router counted an abandon.
    pub abandoned: bool,
    /// An attempt left carrying the handle after the router counted an abandon (HO3's fault).
    pub sent_after_abandon: bool,
    /// An attempt carrying the handle ended unsent and gave it back (HOV1's premise).
    pub given_back: bool,
    /// The client went while an attempt carrying the handle was in flight.
    pub cancelled_in_flight: bool,
    /// The loop tried an attempt after the handoff ended and `handle_send` refused it (HO3's
    /// premise: the loop does try).
    pub send_refused: bool,
}

/// The model over machine `H`.
#[derive(Clone, Debug)]
pub struct HandoffModel<H> {
    /// Its bounds.
    pub config: HandoffConfig,
    _subject: PhantomData<fn() -> H>,
}

impl<H: Subject> HandoffModel<H> {
    /// The model with these bounds.
    pub fn new(config: HandoffConfig) -> Self {
        HandoffModel {
            config,
            _subject: PhantomData,
        }
    }
}

impl<H: Subject> World<H> {
    /// The router counts `ending` (if the machine gave one) after an abandon.
    fn count_abandon(&mut self, ending: Option<Ending>) {
        if let Some(ending) = ending {
            if matches!(ending, Ending::Abandoned(_)) {
                self.abandoned = true;
            }
            self.ledger.count(ending);
        }
    }

    /// The decode failed: when no attempt left carrying the handle (every one unsent, or none
    /// routable), the router abandons it as `DecodeUnreachable`.
    fn decode_failed(&mut self) {
        if self.left_carrying == 0 {
            let ending = self
                .handoff
                .as_mut()
                .and_then(|h| h.abandon(AbandonReason::DecodeUnreachable));
            self.count_abandon(ending);
        }
        self.phase = Phase::Over;
    }

    /// The attempt in flight ended `outcome`: feed it, count an ending, and let the loop decide.
    fn attempt_ended(&mut self, outcome: SendOutcome) {
        if let Some(h) = self.handoff.as_mut() {
            let fed = h.send_result(outcome);
            match outcome {
                SendOutcome::Unsent => self.given_back |= fed.is_ok(),
                SendOutcome::Answered | SendOutcome::FailedAfterSend => self.left_carrying += 1,
            }
            if fed.is_ok() {
                if let Some(ending) = h.ending() {
                    self.ledger.count(ending);
                }
            }
        }
        if outcome == SendOutcome::Answered {
            self.phase = Phase::Streaming;
            return;
        }
        let may_send = self.handoff.as_ref().is_none_or(H::may_send);
        if self.attempts_left > 0 && may_send && !self.client_gone {
            self.phase = Phase::Idle;
        } else {
            self.decode_failed();
        }
    }
}

impl<H: Subject> Model for HandoffModel<H> {
    type State = World<H>;
    type Action = HandoffStep;

    fn init_states(&self) -> Vec<World<H>> {
        vec![World {
            phase: Phase::Prefill,
            handoff: None,
            issued: 0,
            attempts_left: self.config.attempts,
            left_carrying: 0,
            ledger: Ledger::default(),
            recomputed: false,
            client_gone: false,
            abandoned: false,
            sent_after_abandon: false,
            given_back: false,
            cancelled_in_flight: false,
            send_refused: false,
        }]
    }

    fn actions(&self, s: &World<H>, out: &mut Vec<HandoffStep>) {
        match s.phase {
            Phase::Prefill => {
                for answer in [
                    PrefillAnswer::NoHandle,
                    PrefillAnswer::Handle,
                    PrefillAnswer::Stop,
                ] {
                    out.push(HandoffStep::Prefill(answer));
                }
            }
            Phase::Idle => {
                if s.attempts_left > 0 {
                    out.push(HandoffStep::Send);
                }
                out.push(HandoffStep::NoWorker);
                if s.client_gone {
                    out.push(HandoffStep::Notice);
                }
            }
            Phase::InFlight => {
                for end in AttemptEnd::ALL {
                    out.push(HandoffStep::End(end));
                }
            }
            Phase::Streaming => out.push(HandoffStep::Finish),
            Phase::Over => return,
        }
        if !s.client_gone {
            out.push(HandoffStep::ClientGone(Gone::Cancel));
            out.push(HandoffStep::ClientGone(Gone::Deadline));
        }
    }

    fn next_state(&self, s: &World<H>, step: HandoffStep) -> Option<World<H>> {
        let mut n = s.clone();
        match step {
            HandoffStep::Prefill(answer) => {
                n.phase = Phase::Idle;
                match answer {
                    PrefillAnswer::NoHandle => n.recomputed = true,
                    PrefillAnswer::Handle => {
                        n.issued = 1;
                        n.handoff = Some(H::fresh());
                    }
                    PrefillAnswer::Stop => {
                        n.issued = 1;
                        let mut h = H::fresh();
                        let ending = h.abandon(AbandonReason::PrefillFinished);
                        n.handoff = Some(h);
                        n.count_abandon(ending);
                        n.phase = Phase::Over;
                    }
                }
            }
            HandoffStep::Send => {
                n.attempts_left -= 1;
                match n.handoff.as_mut().map(H::send) {
                    Some(Err(_)) => {
                        n.send_refused = true;
                        n.decode_failed();
                    }
                    sent => {
                        if sent.is_some() && n.abandoned {
                            n.sent_after_abandon = true;
                        }
                        n.phase = Phase::InFlight;
                    }
                }
            }
            HandoffStep::NoWorker | HandoffStep::Notice => n.decode_failed(),
            HandoffStep::End(end) => n.attempt_ended(end.outcome()),
            HandoffStep::Finish => n.phase = Phase::Over,
            HandoffStep::ClientGone(_) => {
                n.client_gone = true;
                let ending = n
                    .handoff
                    .as_mut()
                    .and_then(|h| h.abandon(AbandonReason::ClientGone));
                n.count_abandon(ending);
                match s.phase {
                    // The prefill is cancelled before it answered: no handoff was issued.
                    Phase::Prefill | Phase::Streaming => n.phase = Phase::Over,
                    // The loop may not notice yet: it may still try its next attempt.
                    Phase::Idle => {}
                    // The attempt in flight is cancelled with the connection: it may have
                    // reached the worker; the dispatcher sees it fail after it left.
                    Phase::InFlight => {
                        if n.handoff.is_some() {
                            n.cancelled_in_flight = true;
                        }
                        n.attempt_ended(SendOutcome::FailedAfterSend);
                    }
                    Phase::Over => unreachable!("no step after the end"),
                }
            }
        }
        Some(n)
    }

    fn format_action(&self, step: &HandoffStep) -> String {
        step.to_string()
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(HANDOFF_CARRIED_AT_MOST_ONCE, |_, s: &World<H>| {
                s.left_carrying <= 1
            }),
            Property::always(
                EVERY_HANDOFF_ENDS_COUNTED_EXACTLY_ONCE,
                |_, s: &World<H>| {
                    let counted = s.ledger.total();
                    counted <= s.issued && (s.phase != Phase::Over || counted == s.issued)
                },
            ),
            Property::always(NO_DECODE_AFTER_ABANDON, |_, s: &World<H>| {
                !s.sent_after_abandon
            }),
            Property::sometimes(UNSENT_ATTEMPT_MAY_RETRY, |_, s: &World<H>| {
                s.given_back && s.ledger.delivered == 1
            }),
            Property::sometimes(SOMETIMES_DELIVERED, |_, s: &World<H>| {
                s.ledger.delivered == 1
            }),
            Property::sometimes(SOMETIMES_CARRIED_THEN_FAILED, |_, s: &World<H>| {
                s.ledger.carried_then_failed == 1
            }),
            Property::sometimes(SOMETIMES_PREFILL_FINISHED, |_, s: &World<H>| {
                s.ledger.abandoned(AbandonReason::PrefillFinished) == 1
            }),
            Property::sometimes(SOMETIMES_DECODE_UNREACHABLE, |_, s: &World<H>| {
                s.ledger.abandoned(AbandonReason::DecodeUnreachable) == 1
            }),
            Property::sometimes(SOMETIMES_CLIENT_GONE, |_, s: &World<H>| {
                s.ledger.abandoned(AbandonReason::ClientGone) == 1
            }),
            Property::sometimes(SOMETIMES_CANCELLED_IN_FLIGHT, |_, s: &World<H>| {
                s.cancelled_in_flight && s.phase == Phase::Over
            }),
            Property::sometimes(SOMETIMES_RECOMPUTED, |_, s: &World<H>| {
                s.recomputed && s.phase == Phase::Over
            }),
            Property::sometimes(SOMETIMES_SEND_REFUSED_AFTER_ABANDON, |_, s: &World<H>| {
                s.send_refused && s.abandoned
            }),
        ]
    }
}

/// HO1: at most one decode attempt leaves carrying the handle (counting an attempt in flight
/// when the client went as "maybe left").
pub const HANDOFF_CARRIED_AT_MOST_ONCE: &str = "HO1 handoff_carried_at_most_once";
/// HO2: the router never counts more endings than handoffs issued (at most one), and when the
/// request is over it has counted exactly one per handoff issued.
pub const EVERY_HANDOFF_ENDS_COUNTED_EXACTLY_ONCE: &str =
    "HO2 every_handoff_ends_counted_exactly_once";
/// HO3: no decode attempt leaves carrying the handle after the router counted it abandoned.
pub const NO_DECODE_AFTER_ABANDON: &str = "HO3 no_decode_after_abandon";
/// HOV1: an attempt gives the handle back unsent and a later attempt delivers it (HO1 is not
/// met by never retrying).
pub const UNSENT_ATTEMPT_MAY_RETRY: &str = "HOV1 unsent_attempt_may_retry";
/// HOV2: the ending `Delivered` is reachable.
pub const SOMETIMES_DELIVERED: &str = "HOV2 sometimes delivered";
/// HOV3: the ending `CarriedThenFailed` is reachable.
pub const SOMETIMES_CARRIED_THEN_FAILED: &str = "HOV3 sometimes carried then failed";
/// HOV4: the ending `Abandoned(PrefillFinished)` is reachable.
pub const SOMETIMES_PREFILL_FINISHED: &str = "HOV4 sometimes abandoned: prefill finished";
/// HOV5: the ending `Abandoned(DecodeUnreachable)` is reachable.
pub const SOMETIMES_DECODE_UNREACHABLE: &str = "HOV5 sometimes abandoned: decode unreachable";
/// HOV6: the ending `Abandoned(ClientGone)` is reachable.
pub const SOMETIMES_CLIENT_GONE: &str = "HOV6 sometimes abandoned: client gone";
/// HOV7: the client goes while an attempt carrying the handle is in flight, and the request
/// ends (the "maybe left" case HO1 counts).
pub const SOMETIMES_CANCELLED_IN_FLIGHT: &str = "HOV7 sometimes cancelled in flight";
/// HOV8: a prefill without a handle ends with the decode recomputing (no handoff issued).
pub const SOMETIMES_RECOMPUTED: &str = "HOV8 sometimes recomputed without a handle";
/// HOV9: the loop tries an attempt after the router abandoned the handoff and `handle_send`
/// refuses it (HO3's premise is reached: the loop does try).
pub const SOMETIMES_SEND_REFUSED_AFTER_ABANDON: &str =
    "HOV9 sometimes a send after an abandon is refused";
