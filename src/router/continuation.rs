//! The prefill router as the prefill pool of a migrated stream's continuation.

use futures_util::future::BoxFuture;
use futures_util::FutureExt;

use super::handle::PrefillRouter;
use crate::binding::BindingFactory;
use crate::decode::{ContinuationPrefill, Decode, DecodeError, DecodeStream};
use crate::request::GenerateRequest;

impl<F: BindingFactory> ContinuationPrefill for PrefillRouter<F> {
    fn prefill_then_decode<'a>(
        &'a self,
        request: GenerateRequest,
        decode: &'a dyn Decode,
    ) -> BoxFuture<'a, Option<Result<DecodeStream, DecodeError>>> {
        self.prefill_continuation(request, decode).boxed()
    }
}
