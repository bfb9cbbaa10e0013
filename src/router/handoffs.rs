//! The router's side of the handoff rules ([`crate::handoff`]): every single-use handoff a
//! prefill answered with ends exactly once, and is counted.
//!
//! [`Obligation`] holds one request's [`Handoff`] from the prefill's answer to the decode
//! hop's verdict. Whatever happens in between (the decode opened, failed, found nothing to
//! reach, or the request's future was dropped because the client went away) ends it through
//! the pure machine, and its `Drop` ends whatever is left as [`AbandonReason::ClientGone`]: a
//! handoff cannot leave the router uncounted.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::decode::DecodeError;
use crate::handoff::{AbandonReason, Ending, Handoff, SendOutcome};
use crate::request::PrefillInfo;

/// How the router's single-use handoffs ended, since it was created.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HandoffCounts {
    /// Prefill answers that carried a single-use handoff.
    pub issued: u64,
    /// Handoffs one decode request carried and that decode answered.
    pub delivered: u64,
    /// Handoffs one decode request carried and that decode failed (the request failed typed;
    /// the handle was not sent again).
    pub carried_then_failed: u64,
    /// Handoffs no decode request carried, by reason (the prefill engine frees their blocks
    /// when its lease expires: vLLM's `kv_lease_duration`, 30 s by default).
    pub abandoned: BTreeMap<AbandonReason, u64>,
}

impl HandoffCounts {
    /// Handoffs that ended (delivered, carried then failed, or abandoned): equals `issued`
    /// whenever no request is between its prefill and its decode.
    pub fn ended(&self) -> u64 {
        self.delivered + self.carried_then_failed + self.abandoned.values().sum::<u64>()
    }
}

/// The live counters behind [`HandoffCounts`].
#[derive(Debug, Default)]
pub(crate) struct HandoffTally {
    issued: AtomicU64,
    delivered: AtomicU64,
    carried_then_failed: AtomicU64,
    abandoned: [AtomicU64; AbandonReason::ALL.len()],
}

fn reason_index(reason: AbandonReason) -> usize {
    match reason {
        AbandonReason::PrefillFinished => 0,
        AbandonReason::DecodeUnreachable => 1,
        AbandonReason::ClientGone => 2,
    }
}

impl HandoffTally {
    fn count(&self, ending: Ending) {
        // Relaxed: independent statistics.
        let counter = match ending {
            Ending::Delivered => &self.delivered,
            Ending::CarriedThenFailed => &self.carried_then_failed,
            Ending::Abandoned(reason) => {
                tracing::info!(
                    reason = reason.as_str(),
                    "prefill handoff abandoned: the prefill engine frees its blocks when its lease expires"
                );
                &self.abandoned[reason_index(reason)]
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> HandoffCounts {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        HandoffCounts {
            issued: get(&self.issued),
            delivered: get(&self.delivered),
            carried_then_failed: get(&self.carried_then_failed),
            abandoned: AbandonReason::ALL
                .iter()
                .map(|r| (*r, get(&self.abandoned[reason_index(*r)])))
                .collect(),
        }
    }
}

/// One request's handoff from the prefill's answer to its ending (see the module docs).
pub(crate) struct Obligation<'a> {
    /// `None`: the prefill answered without a single-use handoff (nothing to account for).
    handoff: Option<Handoff>,
    tally: &'a HandoffTally,
}

impl<'a> Obligation<'a> {
    /// The obligation a prefill answer creates (none unless it carries a single-use handle).
    pub(crate) fn of(info: Option<&PrefillInfo>, tally: &'a HandoffTally) -> Self {
        let handoff = info.filter(|i| i.is_single_use()).map(|_| {
            tally.issued.fetch_add(1, Ordering::Relaxed);
            Handoff::new()
        });
        Obligation { handoff, tally }
    }

    /// No decode will carry it, for `reason`.
    pub(crate) fn abandon(&mut self, reason: AbandonReason) {
        if let Some(ending) = self.handoff.as_mut().and_then(|h| h.handle_abandon(reason)) {
            self.tally.count(ending);
        }
    }

    /// The decode hop's verdict on the request that carried it: opened (answered), failed
    /// with nothing sent (the handle is unused: abandoned, unreachable), or failed after it
    /// may have been sent (carried, then failed).
    pub(crate) fn decoded<T>(&mut self, result: &Result<T, DecodeError>) {
        let Some(handoff) = self.handoff.as_mut() else {
            return;
        };
        let outcome = match result {
            Ok(_) => SendOutcome::Answered,
            Err(DecodeError::Push(e)) if e.request_unsent() => {
                self.abandon(AbandonReason::DecodeUnreachable);
                return;
            }
            Err(_) => SendOutcome::FailedAfterSend,
        };
        // The decode hop's attempts fed their own machine (the dispatcher's); this one sees
        // the verdict: one send, one result.
        if handoff.handle_send().is_ok() && handoff.handle_send_result(outcome).is_ok() {
            if let Some(ending) = handoff.ending() {
                self.tally.count(ending);
            }
        }
    }
}

impl Drop for Obligation<'_> {
    fn drop(&mut self) {
        // Still held: the request's future was dropped between the prefill's answer and the
        // decode's verdict (the client went away, or its deadline cut the request off).
        self.abandon(AbandonReason::ClientGone);
    }
}
