//! The machine under check, seen through a narrow trait so that the same model can drive the real
//! [`Machine`] and deliberately broken variants of it ([`crate::mutants`]).

use std::fmt::{self, Debug};
use std::hash::Hash;

use prefill_router::lifecycle::{Action, BuildId, Input, Lifecycle, Machine, RetryPolicy};

/// A prefill target of the model: a small label, printed as `A`, `B`, `C`, ...
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target(pub u8);

impl Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Letters keep counterexample traces short and readable.
        write!(f, "{}", (b'A' + self.0.min(25)) as char)
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Debug::fmt(self, f)
    }
}

/// What the model needs from a lifecycle machine: feed an input, collect its actions, read the
/// lifecycle and the binding it claims to hold. The real [`Machine`] implements it directly; each
/// mutant wraps the real machine and alters its inputs or outputs.
pub trait Subject: Clone + Debug + PartialEq + Eq + Hash + Send + Sync + 'static {
    /// A short name, used in reports.
    const NAME: &'static str;

    /// Whether the adapter driving this machine checks a binding's admission set at dispatch
    /// (and fails the request when it is empty). Always true but for the `ignore-admission`
    /// mutant: the check belongs to the adapter, not the machine, yet a mutant of it must be
    /// selectable like the others.
    const DISPATCH_CHECKS_ADMISSION: bool = true;

    /// A fresh machine.
    fn fresh(policy: RetryPolicy) -> Self;

    /// Apply one input and append the resulting actions to `out`, in order.
    fn feed(&mut self, input: Input<Target>, out: &mut Vec<Action<Target>>);

    /// The lifecycle the machine reports (what the adapter publishes to readers).
    fn lifecycle(&self) -> Lifecycle;

    /// The binding the machine claims to hold.
    fn held(&self) -> Option<(BuildId, Target)>;
}

impl Subject for Machine<Target> {
    const NAME: &'static str = "real";

    fn fresh(policy: RetryPolicy) -> Self {
        Machine::new(policy)
    }

    fn feed(&mut self, input: Input<Target>, out: &mut Vec<Action<Target>>) {
        out.extend(self.handle(input));
    }

    fn lifecycle(&self) -> Lifecycle {
        Machine::lifecycle(self)
    }

    fn held(&self) -> Option<(BuildId, Target)> {
        Machine::held(self).map(|(b, t)| (b, *t))
    }
}
