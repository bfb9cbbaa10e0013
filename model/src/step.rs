//! The world's steps: the actions of the model, one input or request move each.

use std::fmt;

use prefill_router::lifecycle::BuildId;

use crate::subject::Target;

/// One step of the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// The controller calls `set_target`.
    SetTarget(Option<Target>),
    /// The controller shuts the hop down.
    Shutdown,
    /// A started build (possibly cancelled) reports success.
    BuildSucceeds(BuildId),
    /// A started build (possibly cancelled) reports failure.
    BuildFails(BuildId),
    /// An armed retry timer (possibly cancelled) fires.
    RetryFires(BuildId),
    /// The admission set of the (retired) binding of this build empties.
    EmptyAdmission(BuildId),
    /// Request slot `i` loads the snapshot.
    Load(usize),
    /// Request slot `i` dispatches on the binding it loaded, or fails when that binding's
    /// admission is empty.
    Dispatch(usize),
    /// Request slot `i` bypasses prefill (its snapshot had no binding).
    Bypass(usize),
    /// Request slot `i` finishes on its binding.
    Finish(usize),
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::SetTarget(Some(t)) => write!(f, "set_target({t})"),
            Step::SetTarget(None) => write!(f, "set_target(None)"),
            Step::Shutdown => write!(f, "shutdown"),
            Step::BuildSucceeds(b) => write!(f, "build {b} succeeds"),
            Step::BuildFails(b) => write!(f, "build {b} fails"),
            Step::RetryFires(b) => write!(f, "retry timer after {b} fires"),
            Step::EmptyAdmission(b) => write!(f, "admission of binding {b} empties"),
            Step::Load(i) => write!(f, "request {i} loads the snapshot"),
            Step::Dispatch(i) => write!(f, "request {i} dispatches"),
            Step::Bypass(i) => write!(f, "request {i} bypasses prefill"),
            Step::Finish(i) => write!(f, "request {i} finishes"),
        }
    }
}
