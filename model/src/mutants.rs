//! Deliberately broken machines, to show that each property of the model can fail.
//!
//! Every mutant wraps the real [`Machine`] and alters only its inputs or outputs, so
//! `src/lifecycle.rs` carries no mutation hooks; [`IgnoreAdmission`] leaves the machine alone
//! and breaks the adapter's admission check instead (`Subject::DISPATCH_CHECKS_ADMISSION`). Each one plays a plausible bug of a retarget
//! driver; `docs/properties.md` lists which property catches which mutant, and
//! `model/tests/mutants.rs` asserts that the checker finds the counterexample.

use prefill_router::lifecycle::{Action, BuildId, Input, Lifecycle, Machine, RetryPolicy};

use crate::subject::{Subject, Target};

/// Implements [`Subject`] for a mutant whose only field is the wrapped real machine, delegating
/// the getters and altering `feed` with the given body.
macro_rules! wrapper {
    ($(#[$doc:meta])* $name:ident, $label:literal, |$m:ident, $input:ident, $out:ident| $body:block) => {
        wrapper!($(#[$doc])* $name, $label, true, |$m, $input, $out| $body);
    };
    ($(#[$doc:meta])* $name:ident, $label:literal, $checks:literal, |$m:ident, $input:ident, $out:ident| $body:block) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash)]
        pub struct $name(pub Machine<Target>);

        impl Subject for $name {
            const NAME: &'static str = $label;
            const DISPATCH_CHECKS_ADMISSION: bool = $checks;

            fn fresh(policy: RetryPolicy) -> Self {
                $name(Machine::new(policy))
            }

            fn feed(&mut self, $input: Input<Target>, $out: &mut Vec<Action<Target>>) {
                let $m = &mut self.0;
                $body
            }

            fn lifecycle(&self) -> Lifecycle {
                self.0.lifecycle()
            }

            fn held(&self) -> Option<(BuildId, Target)> {
                Subject::held(&self.0)
            }
        }
    };
}

wrapper!(
    /// Publishes every finished build: each `Discard` becomes a `Publish` (no staleness check).
    NoStalenessCheck,
    "no-staleness-check",
    |m, input, out| {
        let target = m.desired().copied().unwrap_or(Target(0));
        for action in m.handle(input) {
            out.push(match action {
                Action::Discard { build } => Action::Publish { build, target },
                other => other,
            });
        }
    }
);

wrapper!(
    /// Treats any held binding as serving any target: a retarget to `x` while a binding for `y`
    /// is held is handled as a return to `y` (reuse without comparing targets).
    ReuseForOtherTarget,
    "reuse-for-other-target",
    |m, input, out| {
        let input = match (input, Subject::held(m)) {
            (Input::SetTarget(Some(_)), Some((_, held))) if !m.is_shut_down() => {
                Input::SetTarget(Some(held))
            }
            (input, _) => input,
        };
        m.feed(input, out);
    }
);

wrapper!(
    /// Forgets to disarm the retry timer on retarget or shutdown: drops `CancelRetry`.
    KeepRetryOnRetarget,
    "keep-retry-on-retarget",
    |m, input, out| {
        out.extend(
            m.handle(input)
                .into_iter()
                .filter(|a| !matches!(a, Action::CancelRetry { .. })),
        );
    }
);

wrapper!(
    /// Starts the next build without cancelling the one in flight: drops `CancelBuild`.
    SecondBuildInFlight,
    "second-build-in-flight",
    |m, input, out| {
        out.extend(
            m.handle(input)
                .into_iter()
                .filter(|a| !matches!(a, Action::CancelBuild { .. })),
        );
    }
);

wrapper!(
    /// Retires the held binding when the target is cleared, although the machine keeps it for
    /// reuse (and retires it again later).
    RetireOnClear,
    "retire-on-clear",
    |m, input, out| {
        let clearing = matches!(input, Input::SetTarget(None))
            && !m.is_shut_down()
            && m.lifecycle() != Lifecycle::Unavailable;
        let held = Subject::held(m);
        m.feed(input, out);
        if let (true, Some((build, _))) = (clearing, held) {
            out.push(Action::Retire { build });
        }
    }
);

wrapper!(
    /// Tears bindings down instead of retiring them: each `Retire` becomes a `Discard`, so a
    /// request still holding the binding loses it.
    RetireAsDiscard,
    "retire-as-discard",
    |m, input, out| {
        for action in m.handle(input) {
            out.push(match action {
                Action::Retire { build } => Action::Discard { build },
                other => other,
            });
        }
    }
);

/// Keeps the last retired binding in a cache and republishes it when its target comes back,
/// instead of building afresh (a retired binding re-published).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReuseRetired {
    machine: Machine<Target>,
    /// The binding this wrapper saw retired last, with its target.
    cache: Option<(BuildId, Target)>,
}

impl Subject for ReuseRetired {
    const NAME: &'static str = "reuse-retired";

    fn fresh(policy: RetryPolicy) -> Self {
        ReuseRetired {
            machine: Machine::new(policy),
            cache: None,
        }
    }

    fn feed(&mut self, input: Input<Target>, out: &mut Vec<Action<Target>>) {
        let held = Subject::held(&self.machine);
        let actions = self.machine.handle(input);
        for action in actions {
            match action {
                Action::StartBuild { build, target } if self.cache.map(|c| c.1) == Some(target) => {
                    // Pretend the cached binding is the fresh build: tell the real machine its
                    // build succeeded and publish the cached (retired) binding in its place.
                    let (cached, _) = self.cache.take().unwrap_or((build, target));
                    let _ = self.machine.handle(Input::BuildSucceeded(build));
                    out.push(Action::Publish {
                        build: cached,
                        target,
                    });
                }
                Action::Retire { build } => {
                    if let Some((h, t)) = held {
                        if h == build {
                            self.cache = Some((h, t));
                        }
                    }
                    out.push(Action::Retire { build });
                }
                other => out.push(other),
            }
        }
    }

    fn lifecycle(&self) -> Lifecycle {
        self.machine.lifecycle()
    }

    fn held(&self) -> Option<(BuildId, Target)> {
        Subject::held(&self.machine)
    }
}

wrapper!(
    /// Never arms the retry timer after a failed build: drops `ScheduleRetry`, so the hop stays
    /// Pending for good after one failure.
    NoRetry,
    "no-retry",
    |m, input, out| {
        out.extend(
            m.handle(input)
                .into_iter()
                .filter(|a| !matches!(a, Action::ScheduleRetry { .. })),
        );
    }
);

wrapper!(
    /// The real machine, driven by an adapter that dispatches on the binding a request loaded
    /// without checking its admission set: a request on a retired binding whose admission has
    /// emptied is sent to a worker outside admission instead of failing.
    IgnoreAdmission,
    "ignore-admission",
    false,
    |m, input, out| {
        m.feed(input, out);
    }
);
