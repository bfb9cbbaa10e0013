//! The handoff model's mutants: deliberately broken drivers of the real [`Handoff`] machine,
//! each altering only what goes in or comes out (the library has no mutation hooks), so that
//! every property is shown to bite (`model/tests/handoff.rs`).

use prefill_router::handoff::{AbandonReason, Ending, Handoff, HandoffError, SendOutcome};

use super::Subject;

/// Implements [`Subject`] for a mutant whose only field is the wrapped real machine, delegating
/// every call but the ones given.
macro_rules! wrapper {
    ($(#[$doc:meta])* $name:ident, $label:literal, { $($method:item)* }) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash)]
        pub struct $name(pub Handoff);

        impl Subject for $name {
            const NAME: &'static str = $label;
            fn fresh() -> Self {
                $name(Handoff::new())
            }
            fn may_send(&self) -> bool {
                self.0.may_send()
            }
            fn ending(&self) -> Option<Ending> {
                self.0.ending()
            }
            $($method)*
        }
    };
}

wrapper!(
    /// Mutant: the dispatcher classifies a failure after the request left as "unsent" (e.g. a
    /// reset or a worker removed mid-request read as connection refused) and retries with the
    /// used handle. Breaks HO1 (and HO2: nothing counts the ending).
    ResendAfterFailure,
    "resend-after-failure",
    {
        fn send(&mut self) -> Result<(), HandoffError> {
            self.0.handle_send()
        }
        fn send_result(&mut self, outcome: SendOutcome) -> Result<(), HandoffError> {
            let outcome = match outcome {
                SendOutcome::FailedAfterSend => SendOutcome::Unsent,
                other => other,
            };
            self.0.handle_send_result(outcome)
        }
        fn abandon(&mut self, reason: AbandonReason) -> Option<Ending> {
            self.0.handle_abandon(reason)
        }
    }
);

wrapper!(
    /// Mutant: the router's guard drops the handoff when the client goes without counting the
    /// ending (it calls `handle_abandon(ClientGone)` and ignores the answer). Breaks HO2.
    SilentClientGone,
    "silent-client-gone",
    {
        fn send(&mut self) -> Result<(), HandoffError> {
            self.0.handle_send()
        }
        fn send_result(&mut self, outcome: SendOutcome) -> Result<(), HandoffError> {
            self.0.handle_send_result(outcome)
        }
        fn abandon(&mut self, reason: AbandonReason) -> Option<Ending> {
            let ending = self.0.handle_abandon(reason);
            if reason == AbandonReason::ClientGone {
                None
            } else {
                ending
            }
        }
    }
);

wrapper!(
    /// Mutant: the router counts how the handoff ended every time it gives it up (it reports
    /// `ending()` when `handle_abandon` says nothing new), so a second give-up (the guard after
    /// the decode failed or was answered, the `DecodeUnreachable` check after the client went)
    /// counts the ending again. Breaks HO2.
    DoubleCount,
    "double-count",
    {
        fn send(&mut self) -> Result<(), HandoffError> {
            self.0.handle_send()
        }
        fn send_result(&mut self, outcome: SendOutcome) -> Result<(), HandoffError> {
            self.0.handle_send_result(outcome)
        }
        fn abandon(&mut self, reason: AbandonReason) -> Option<Ending> {
            self.0.handle_abandon(reason).or(self.0.ending())
        }
    }
);

/// Mutant: the dispatcher's retry loop works on its own copy of the handoff (a clone carried by
/// the request it was moved into), while the router's guard abandons
/// the original. An abandon then never reaches the loop, which sends the handle after the
/// router counted it abandoned. Breaks HO3 (and HO2: both copies end).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SendAfterAbandon {
    /// The loop's copy: sends, results, `may_send` and the ending it counts.
    pub dispatcher: Handoff,
    /// The router's copy: every abandon.
    pub guard: Handoff,
}

impl Subject for SendAfterAbandon {
    const NAME: &'static str = "send-after-abandon";
    fn fresh() -> Self {
        let h = Handoff::new();
        SendAfterAbandon {
            dispatcher: h.clone(),
            guard: h,
        }
    }
    fn send(&mut self) -> Result<(), HandoffError> {
        self.dispatcher.handle_send()
    }
    fn send_result(&mut self, outcome: SendOutcome) -> Result<(), HandoffError> {
        self.dispatcher.handle_send_result(outcome)
    }
    fn abandon(&mut self, reason: AbandonReason) -> Option<Ending> {
        self.guard.handle_abandon(reason)
    }
    fn may_send(&self) -> bool {
        self.dispatcher.may_send()
    }
    fn ending(&self) -> Option<Ending> {
        self.dispatcher.ending()
    }
}
