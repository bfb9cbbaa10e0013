//! What a pick works on and hands back inside the dispatcher: the candidates it chooses from
//! and the chosen instance with the work booked there. A leaf, so that the pick, the wait for
//! room, the send and the held pick can all name it without naming each other.

use std::sync::Arc;

use super::booking::Booking;
use crate::discovery::{Instance, InstanceId};
use crate::push::affinity::AffinityOutcome;

/// What a pick chooses from: the view's shared routable set, that set minus the excluded
/// workers, and the excluded workers.
pub(super) type Candidates<'a> = (
    &'a Arc<[Arc<Instance>]>,
    &'a [Arc<Instance>],
    &'a [InstanceId],
);

/// One pick: the instance, the KV overlap expected there, how affinity decided it.
pub(super) struct Pick {
    pub(super) instance: Arc<Instance>,
    pub(super) overlap: Option<usize>,
    pub(super) affinity: Option<AffinityOutcome>,
    /// The work booked on the instance by this pick (KV mode), released when dropped.
    pub(super) booking: Option<Booking>,
}
