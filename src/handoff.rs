//! The handoff rules: one request's single-use prefill handle, from the prefill's answer to the
//! decode request that carries it (pure: no I/O, no clock).
//!
//! An engine's prefill answer ([`PrefillInfo::engine_params`](crate::request::PrefillInfo),
//! vLLM's `kv_transfer_params`) names KV blocks the prefill engine now holds for one decode
//! request to pull. The users' worst failures with engine-backed routers are about that handle
//! (docs/engines.md, "The handoff rules"): a decode leg retried with a used handle, or dropped
//! after the prefill answered, strands the prefill's blocks until its lease expires. So:
//!
//! 1. **Carried at most once.** A decode attempt may carry the handle only while it is
//!    [`Held`](HandoffState::Held). An attempt that provably never left (the connection was
//!    refused: [`SendOutcome::Unsent`]) gives it back, and another worker may carry it; any
//!    other failure counts as carried ([`SendOutcome::FailedAfterSend`]): the request fails
//!    typed, and only a whole new prefill could try again.
//! 2. **Never dropped silently.** Every handoff ends exactly once ([`Ending`]): delivered,
//!    carried by a decode that failed, or abandoned with a reason the caller counts.
//!
//! [`Handoff`] is the machine the dispatcher's retry loop and the router's request path both
//! feed; `model/` checks it with stateright (`handoff` model, with mutants) and the
//! dispatcher's tests hold the code around it to the same rules.

/// Where one handoff stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HandoffState {
    /// The prefill answered with the handle; no decode request carries it yet.
    Held,
    /// A decode attempt carrying it is being sent.
    Sending,
    /// A decode request carried it (the end: never sent again).
    Carried {
        /// Whether that decode request was answered (false: it failed after it left).
        answered: bool,
    },
    /// Given up before any decode request carried it (the end).
    Abandoned(AbandonReason),
}

/// Why a handoff was given up. The prefill engine frees the blocks by itself when its lease
/// expires (vLLM: `kv_lease_duration`, 30 s); counting these is how an operator sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AbandonReason {
    /// The prefill already finished the request (its one token was a stop): nothing to decode.
    PrefillFinished,
    /// No decode attempt could leave (no routable decode worker, every connection refused).
    DecodeUnreachable,
    /// The client went away (or cancelled) before a decode request carried it.
    ClientGone,
}

impl AbandonReason {
    /// Every reason, for counters and exhaustive drivers.
    pub const ALL: [AbandonReason; 3] = [
        AbandonReason::PrefillFinished,
        AbandonReason::DecodeUnreachable,
        AbandonReason::ClientGone,
    ];

    /// A short, stable label (metrics and logs).
    pub fn as_str(self) -> &'static str {
        match self {
            AbandonReason::PrefillFinished => "prefill_finished",
            AbandonReason::DecodeUnreachable => "decode_unreachable",
            AbandonReason::ClientGone => "client_gone",
        }
    }
}

/// How a decode attempt that carried the handle ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SendOutcome {
    /// The decode worker answered: the handle is delivered.
    Answered,
    /// The attempt never left (connection refused, TLS failed): the handle is still ours.
    Unsent,
    /// The attempt failed after it may have reached the worker: the handle counts as used.
    FailedAfterSend,
}

/// How a handoff ended (exactly once per handoff).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ending {
    /// One decode request carried it and was answered.
    Delivered,
    /// One decode request carried it and failed; the request fails typed.
    CarriedThenFailed,
    /// No decode request carried it.
    Abandoned(AbandonReason),
}

/// Why the machine refused an input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HandoffError {
    /// A decode request already carried the handle: sending it again is what strands blocks.
    #[error("the prefill handoff was already carried by a decode request: never sent twice")]
    AlreadyCarried,
    /// The handoff was abandoned.
    #[error("the prefill handoff was abandoned ({})", .0.as_str())]
    Abandoned(AbandonReason),
    /// An attempt carrying it is already being sent.
    #[error("a decode attempt carrying the handoff is already in flight")]
    InFlight,
    /// No attempt was being sent.
    #[error("no decode attempt carrying the handoff is in flight")]
    NotSending,
}

/// One request's handoff (see the module rules).
///
/// Deliberately not `Copy`: one request has one handoff, and a copy held by a second driver
/// (a retry loop with its own copy, say) is how a send after an abandon happens (the model's
/// `SendAfterAbandon` mutant).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Handoff {
    state: HandoffState,
}

impl Default for Handoff {
    fn default() -> Self {
        Handoff::new()
    }
}

impl Handoff {
    /// A handoff the prefill just answered with.
    pub fn new() -> Self {
        Handoff {
            state: HandoffState::Held,
        }
    }

    /// Where it stands.
    pub fn state(&self) -> HandoffState {
        self.state
    }

    /// A decode attempt is about to carry the handle: allowed only while it is held.
    pub fn handle_send(&mut self) -> Result<(), HandoffError> {
        match self.state {
            HandoffState::Held => {
                self.state = HandoffState::Sending;
                Ok(())
            }
            HandoffState::Sending => Err(HandoffError::InFlight),
            HandoffState::Carried { .. } => Err(HandoffError::AlreadyCarried),
            HandoffState::Abandoned(reason) => Err(HandoffError::Abandoned(reason)),
        }
    }

    /// The attempt in flight ended `outcome`.
    pub fn handle_send_result(&mut self, outcome: SendOutcome) -> Result<(), HandoffError> {
        match self.state {
            HandoffState::Sending => {}
            // The answer raced the client's cancel: the abandon stands.
            HandoffState::Abandoned(reason) => return Err(HandoffError::Abandoned(reason)),
            HandoffState::Held | HandoffState::Carried { .. } => {
                return Err(HandoffError::NotSending)
            }
        }
        self.state = match outcome {
            SendOutcome::Answered => HandoffState::Carried { answered: true },
            SendOutcome::Unsent => HandoffState::Held,
            SendOutcome::FailedAfterSend => HandoffState::Carried { answered: false },
        };
        Ok(())
    }

    /// Give it up for `reason` unless it already ended; the ending, if this call made it end.
    ///
    /// While an attempt is being sent, giving up still ends it as abandoned: the caller stopped
    /// waiting (the client left), so whatever the worker got is cancelled with the connection.
    /// Such an attempt may have reached its worker: the ending says the router gave the handle
    /// up, not that no worker saw it (the model counts it as carried for the at-most-once rule).
    pub fn handle_abandon(&mut self, reason: AbandonReason) -> Option<Ending> {
        match self.state {
            HandoffState::Held | HandoffState::Sending => {
                self.state = HandoffState::Abandoned(reason);
                Some(Ending::Abandoned(reason))
            }
            HandoffState::Carried { .. } | HandoffState::Abandoned(_) => None,
        }
    }

    /// Whether another decode attempt may carry it now (after an unsent attempt, or before any).
    pub fn may_send(&self) -> bool {
        self.state == HandoffState::Held
    }

    /// How it ended, once it did.
    pub fn ending(&self) -> Option<Ending> {
        match self.state {
            HandoffState::Held | HandoffState::Sending => None,
            HandoffState::Carried { answered: true } => Some(Ending::Delivered),
            HandoffState::Carried { answered: false } => Some(Ending::CarriedThenFailed),
            HandoffState::Abandoned(reason) => Some(Ending::Abandoned(reason)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_carried_handle_is_never_sent_again() {
        for outcome in [SendOutcome::Answered, SendOutcome::FailedAfterSend] {
            let mut h = Handoff::new();
            h.handle_send().unwrap();
            h.handle_send_result(outcome).unwrap();
            assert_eq!(h.handle_send(), Err(HandoffError::AlreadyCarried));
            assert!(!h.may_send());
        }
    }

    #[test]
    fn an_unsent_attempt_gives_the_handle_back() {
        let mut h = Handoff::new();
        h.handle_send().unwrap();
        h.handle_send_result(SendOutcome::Unsent).unwrap();
        assert!(h.may_send());
        h.handle_send().unwrap();
        h.handle_send_result(SendOutcome::Answered).unwrap();
        assert_eq!(h.ending(), Some(Ending::Delivered));
    }

    #[test]
    fn every_handoff_ends_exactly_once() {
        let mut h = Handoff::new();
        assert_eq!(h.ending(), None);
        assert_eq!(
            h.handle_abandon(AbandonReason::ClientGone),
            Some(Ending::Abandoned(AbandonReason::ClientGone))
        );
        assert_eq!(h.handle_abandon(AbandonReason::DecodeUnreachable), None);
        assert_eq!(
            h.handle_send(),
            Err(HandoffError::Abandoned(AbandonReason::ClientGone))
        );
        let mut carried = Handoff::new();
        carried.handle_send().unwrap();
        carried
            .handle_send_result(SendOutcome::FailedAfterSend)
            .unwrap();
        assert_eq!(carried.handle_abandon(AbandonReason::ClientGone), None);
        assert_eq!(carried.ending(), Some(Ending::CarriedThenFailed));
    }

    #[test]
    fn abandon_reasons_have_stable_labels_and_a_result_after_an_abandon_says_so() {
        let labels: Vec<&str> = AbandonReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            labels,
            ["prefill_finished", "decode_unreachable", "client_gone"]
        );
        let mut h = Handoff::default();
        assert_eq!(h.state(), HandoffState::Held);
        h.handle_send().unwrap();
        assert_eq!(h.state(), HandoffState::Sending);
        assert_eq!(h.ending(), None);
        assert_eq!(
            h.handle_abandon(AbandonReason::ClientGone),
            Some(Ending::Abandoned(AbandonReason::ClientGone))
        );
        assert_eq!(
            h.handle_send_result(SendOutcome::Answered),
            Err(HandoffError::Abandoned(AbandonReason::ClientGone))
        );
        let mut carried = Handoff::new();
        carried.handle_send().unwrap();
        carried.handle_send_result(SendOutcome::Answered).unwrap();
        assert_eq!(carried.state(), HandoffState::Carried { answered: true });
        assert_eq!(
            carried.handle_send_result(SendOutcome::Answered),
            Err(HandoffError::NotSending)
        );
    }

    #[test]
    fn results_without_a_send_are_refused() {
        let mut h = Handoff::new();
        assert_eq!(
            h.handle_send_result(SendOutcome::Answered),
            Err(HandoffError::NotSending)
        );
        h.handle_send().unwrap();
        assert_eq!(h.handle_send(), Err(HandoffError::InFlight));
    }
}
