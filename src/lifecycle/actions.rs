//! The output batch of one [`Machine::handle`](super::Machine::handle) call.
//!
//! The shared inline [`Batch`](crate::batch::Batch): the machine is a plain value type and its
//! hot path must not allocate.

use super::Action;
use crate::batch::{Batch, IntoIter};

/// The actions produced by one input, in the order the driver must carry them out.
pub type Actions<T> = Batch<Action<T>>;

/// Owning iterator over an [`Actions`] batch.
pub type ActionsIntoIter<T> = IntoIter<Action<T>>;
