//! The decode hop: what the router hands a request to after its prefill ([`Decode`]), how that
//! fails ([`DecodeError`]) and what comes back ([`DecodeStream`]), with the two implementations:
//! [`DecodePool`] over one decode dispatcher, and [`FollowingDecode`] following the topology's
//! decode set (the one a [`PrefillHop`](crate::PrefillHop) embeds).

mod following;
mod migrating;
mod pool;

pub use following::FollowingDecode;
pub use migrating::{break_reason, ContinuationPrefill, MigratingDecode, MigrationCounts};
pub use pool::DecodePool;

use std::pin::Pin;

use futures_core::Stream;
use futures_util::future::BoxFuture;

use crate::binding::PrefillOutcome;
use crate::discovery::InstanceId;
use crate::push::PushError;
use crate::request::{GenerateRequest, GenerateResponse};

/// Why the decode hop failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The decode dispatcher could not route or carry the request.
    #[error("decode routing failed: {0}")]
    Push(#[from] PushError),
    /// The stream broke and could not be continued on another decode worker (its migration
    /// limit was used up, or its deadline passed).
    #[error("decode stream lost: {0}")]
    Migration(crate::migration::MigrationError),
    /// Any other failure, described.
    #[error("decode failed: {message}")]
    Failed {
        /// What went wrong.
        message: String,
    },
}

/// The decode responses handed back to the caller.
pub type DecodeStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, DecodeError>> + Send>>;

/// The decode hop (the decode pool's dispatcher).
pub trait Decode: Send + Sync {
    /// Decode `request` (original `max_tokens`; `handoff` set from `prefill` when there was a
    /// prefill). `prefill` is `None` when the request bypassed the prefill hop.
    fn decode(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>>;

    /// [`decode`](Self::decode), steering away from the workers in `avoid` (those a migrated
    /// stream broke on: [`crate::migration::Continuation::avoid`]) while any other worker is
    /// routable; only when none is may one of them take it (it may have come back). The
    /// default cannot steer and ignores `avoid`; [`DecodePool`] and [`FollowingDecode`] steer.
    fn decode_avoiding<'a>(
        &'a self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
        avoid: &'a [InstanceId],
    ) -> BoxFuture<'a, Result<DecodeStream, DecodeError>> {
        let _ = avoid;
        self.decode(request, prefill)
    }
}

/// A decode hop whose every decode steers away from `avoid` ([`Decode::decode_avoiding`]):
/// what a continuation hands the prefill pool, so the decode after its new prefill avoids the
/// broken workers too.
pub(crate) struct Avoiding<'a> {
    /// The hop that decodes.
    pub(crate) inner: &'a dyn Decode,
    /// The workers to steer away from.
    pub(crate) avoid: &'a [InstanceId],
}

impl Decode for Avoiding<'_> {
    fn decode(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        self.inner.decode_avoiding(request, prefill, self.avoid)
    }
}
