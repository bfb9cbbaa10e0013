//! The stateright model: the real machine (or a mutant) driven by every interleaving of the
//! controller, the builds, the retry timers, admission changes and the requests.

use std::fmt;
use std::fmt::Write as _;
use std::marker::PhantomData;
use std::sync::Arc;

use prefill_router::lifecycle::{Action, BuildId, Input, Lifecycle, RetryPolicy};
use stateright::{Expectation, Model, Property};

pub use crate::config::Config;
pub use crate::step::Step;
use crate::subject::{Subject, Target};
use crate::world::{bit, fault, seen, Binding, Build, Outcome, Request, State, Timer};

/// The model, generic over the machine under check (the real one or a mutant).
pub struct RouterModel<S> {
    /// The bounds.
    pub config: Config,
    /// Set for the Explorer: where to get the shortest counterexample.
    hint: Option<Arc<ExplorerHint>>,
    _subject: PhantomData<fn() -> S>,
}

/// The Explorer's pointer to the shortest counterexample. Its on-demand checker links each
/// property to the last violating path it saw, often many steps past the violation, and its
/// page cannot be changed; so the page says, in the property names and at the violating step,
/// which `check` command prints the shortest one.
#[derive(Debug)]
struct ExplorerHint {
    /// The `check` command line for the same model.
    command: String,
    /// Each always/eventually property's name, and the name the Explorer shows instead.
    names: Vec<(&'static str, &'static str)>,
}

impl<S> Clone for RouterModel<S> {
    fn clone(&self) -> Self {
        RouterModel {
            config: self.config,
            hint: self.hint.clone(),
            _subject: PhantomData,
        }
    }
}

impl<S> fmt::Debug for RouterModel<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouterModel")
            .field("config", &self.config)
            .finish()
    }
}

impl<S> RouterModel<S> {
    /// A model with the given bounds.
    pub fn new(config: Config) -> Self {
        RouterModel {
            config,
            hint: None,
            _subject: PhantomData,
        }
    }

    /// The `check` command (as printed for the Explorer) if this model was made by
    /// [`RouterModel::for_explorer`].
    pub fn check_command(&self) -> Option<&str> {
        self.hint.as_deref().map(|h| h.command.as_str())
    }
}

impl<S: Subject> RouterModel<S> {
    /// The model as the Explorer should show it: each always/eventually property's name ends
    /// with "shortest counterexample: `check_command`", and a step that violates an always
    /// property says so in its outcome, with the same command. The states and the steps are
    /// those of [`RouterModel::new`].
    pub fn for_explorer(config: Config, check_command: String) -> Self {
        let names = crate::properties::all::<S, Self>()
            .into_iter()
            .filter(|p| p.expectation != Expectation::Sometimes)
            .map(|p| {
                // Property names are `&'static str`: leaked once per Explorer process.
                let shown = format!("{} (shortest counterexample: {check_command})", p.name);
                (p.name, &*Box::leak(shown.into_boxed_str()))
            })
            .collect();
        RouterModel {
            config,
            hint: Some(Arc::new(ExplorerHint {
                command: check_command,
                names,
            })),
            _subject: PhantomData,
        }
    }
}

impl<S: Subject> RouterModel<S> {
    /// The whole path from the initial state, one numbered line per step, replayed through the
    /// model so the printed actions are the ones the checker saw.
    pub fn render(&self, steps: &[Step]) -> String {
        let mut out = String::new();
        let Some(mut state) = self.init_states().into_iter().next() else {
            return out;
        };
        for (i, step) in steps.iter().enumerate() {
            let (next, actions) = self.apply(&state, *step);
            let _ = writeln!(
                out,
                "  {:>2}. {}",
                i + 1,
                crate::trace::describe(&state, *step, &actions, &next)
            );
            state = next;
        }
        out
    }

    /// Applies one step and returns the next state with the machine's actions (the trace printer
    /// replays paths through this too, so traces show exactly what the checker saw). Steps are
    /// meant to come from [`Model::actions`]; a request step that does not fit its request's
    /// stage leaves the request unchanged rather than panicking.
    pub fn apply(&self, s: &State<S>, step: Step) -> (State<S>, Vec<Action<Target>>) {
        let mut n = s.clone();
        let mut actions = Vec::new();
        // The binding a successful build just produced, and that build's record.
        let mut produced: Option<Build> = None;
        let mut failed: Option<Build> = None;
        let before = s.subject.lifecycle();
        match step {
            Step::SetTarget(t) => {
                n.retargets_left = n.retargets_left.saturating_sub(1);
                n.desired = Some(t);
                n.subject.feed(Input::SetTarget(t), &mut actions);
            }
            Step::Shutdown => {
                n.retargets_left = n.retargets_left.saturating_sub(1);
                n.shut_down = true;
                n.subject.feed(Input::Shutdown, &mut actions);
            }
            Step::BuildSucceeds(id) => {
                produced = take_build(&mut n.builds, id);
                n.subject.feed(Input::BuildSucceeded(id), &mut actions);
            }
            Step::BuildFails(id) => {
                failed = take_build(&mut n.builds, id);
                n.failures_left = n.failures_left.saturating_sub(1);
                n.subject.feed(Input::BuildFailed(id), &mut actions);
            }
            Step::RetryFires(after) => {
                n.timers.retain(|t| t.after != after);
                n.subject.feed(Input::RetryElapsed(after), &mut actions);
            }
            Step::EmptyAdmission(build) => {
                n.admission_left = n.admission_left.saturating_sub(1);
                n.emptied |= bit(build);
            }
            Step::Load(i) => {
                if s.requests.get(i) == Some(&Request::Idle) {
                    n.requests[i] = Request::Loaded {
                        binding: s.snapshot().binding,
                        desired: s.desired.flatten(),
                    };
                }
            }
            Step::Dispatch(i) => {
                if let Some(Request::Loaded {
                    binding: Some(b),
                    desired,
                }) = s.requests.get(i).copied()
                {
                    if s.torn & bit(b.build) != 0 {
                        n.faults |= fault::REQUEST_LOST;
                    }
                    let empty = s.emptied & bit(b.build) != 0;
                    if empty && S::DISPATCH_CHECKS_ADMISSION {
                        // The adapter finds no worker in admission: the request ends at once
                        // with a typed failure instead of waiting or picking an outsider.
                        n.seen |= seen::ADMISSION_FAILED;
                        n.requests[i] = Request::done(Outcome::Failed(b));
                    } else {
                        if empty {
                            n.faults |= fault::OUTSIDE_ADMISSION;
                        }
                        if desired != Some(b.target) {
                            n.faults |= fault::STALE_DISPATCH;
                        }
                        n.requests[i] = Request::Running(b);
                    }
                }
            }
            Step::Bypass(i) => {
                if let Some(Request::Loaded { binding: None, .. }) = s.requests.get(i) {
                    n.requests[i] = Request::done(Outcome::Bypassed);
                }
            }
            Step::Finish(i) => {
                if let Some(Request::Running(b)) = s.requests.get(i).copied() {
                    if s.torn & bit(b.build) != 0 {
                        n.faults |= fault::REQUEST_LOST;
                    } else if s.retired & bit(b.build) != 0 {
                        n.seen |= seen::RETIRED_SERVED;
                    }
                    n.requests[i] = Request::done(Outcome::Served(b));
                }
            }
        }
        let from_retry = matches!(step, Step::RetryFires(_));
        for action in &actions {
            self.carry_out(&mut n, action, produced, failed, from_retry);
        }
        if let Step::SetTarget(Some(_)) = step {
            let started = actions
                .iter()
                .any(|a| matches!(a, Action::StartBuild { .. }));
            if !started && before != Lifecycle::Active && n.subject.lifecycle() == Lifecycle::Active
            {
                n.seen |= seen::REUSED;
            }
        }
        n.requests.sort_unstable();
        (n, actions)
    }

    /// The adapter carrying out one action of the machine, recording what it observes.
    fn carry_out(
        &self,
        n: &mut State<S>,
        action: &Action<Target>,
        produced: Option<Build>,
        failed: Option<Build>,
        from_retry: bool,
    ) {
        match *action {
            Action::StartBuild { build, target } => {
                if !n.builds.iter().any(|b| b.id == build) {
                    n.builds.push(Build {
                        id: build,
                        target,
                        cancelled: false,
                        retry: from_retry,
                    });
                    n.builds.sort_unstable();
                }
                n.newest = n.newest.max(build);
            }
            Action::CancelBuild { build } => {
                for b in n.builds.iter_mut().filter(|b| b.id == build) {
                    b.cancelled = true;
                }
            }
            Action::Publish { build, target } => {
                let binding = match produced {
                    Some(p) if p.id == build => {
                        if p.cancelled || p.id < n.newest {
                            n.faults |= fault::STALE_PUBLISHED;
                        }
                        if p.retry {
                            n.seen |= seen::RETRY_ACTIVE;
                        }
                        Binding {
                            build,
                            target: p.target,
                        }
                    }
                    _ => {
                        // Not the build that just succeeded: only an earlier binding could be
                        // meant, and it must at least be one the adapter knows.
                        if n.published & bit(build) == 0 {
                            n.faults |= fault::STALE_PUBLISHED;
                        }
                        Binding { build, target }
                    }
                };
                if n.retired & bit(build) != 0 {
                    n.faults |= fault::REPUBLISHED;
                }
                if let Some(c) = n.current {
                    if c.build != build {
                        // The previous binding would be dropped without a Retire.
                        n.faults |= fault::BAD_RETIRE;
                    }
                }
                n.current = Some(binding);
                n.published |= bit(build);
            }
            Action::Retire { build } => {
                if n.published & bit(build) == 0 || n.retired & bit(build) != 0 {
                    n.faults |= fault::BAD_RETIRE;
                }
                n.retired |= bit(build);
                if n.current.is_some_and(|c| c.build == build) {
                    n.current = None;
                }
            }
            Action::Discard { build } => {
                if n.published & bit(build) != 0 {
                    // A published binding is torn down: requests holding it lose it.
                    n.torn |= bit(build);
                    if n.current.is_some_and(|c| c.build == build) {
                        n.current = None;
                    }
                } else if produced.is_some_and(|p| p.id == build) {
                    n.seen |= seen::STALE_REJECTED;
                }
            }
            Action::ScheduleRetry { after, .. } => {
                let target = failed
                    .filter(|f| f.id == after)
                    .map(|f| f.target)
                    .or(n.desired.flatten())
                    .unwrap_or(Target(0));
                n.timers.push(Timer {
                    after,
                    target,
                    cancelled: false,
                });
                n.timers.sort_unstable();
            }
            Action::CancelRetry { after } => {
                for t in n.timers.iter_mut().filter(|t| t.after == after) {
                    t.cancelled = true;
                }
            }
        }
    }
}

impl<S> RouterModel<S> {
    /// A ranking function that every step strictly decreases (checked over the whole state space
    /// by `model/tests/bounding.rs`): so no path revisits a state, every path is finite, and
    /// stateright's `eventually` (judged only at terminal states) is sound here.
    ///
    /// Weights: a controller call may start one build (+1), so it weighs more; a failure arms a
    /// timer (+2) but spends a failure (-3) and a build (-1); a firing timer (-2) starts at most
    /// one build (+1); an admission change spends one change (-1); each request step lowers the
    /// request's stage.
    pub fn rank(&self, s: &State<S>) -> u64 {
        let controller = u64::from(s.retargets_left) * 4 + u64::from(!s.shut_down);
        let requests: u64 = s
            .requests
            .iter()
            .map(|r| match r {
                Request::Idle => 3,
                Request::Loaded { .. } => 2,
                Request::Running(_) => 1,
                Request::Done(_) => 0,
            })
            .sum();
        controller
            + u64::from(s.failures_left) * 3
            + s.timers.len() as u64 * 2
            + s.builds.len() as u64
            + u64::from(s.admission_left)
            + requests
    }
}

impl<S: Subject> RouterModel<S> {
    /// The shortest counterexample (or example) for `property`: breadth-first runs with a
    /// growing depth bound, stopping at the first depth where the property has a discovery.
    /// (One unbounded run may report a longer path: stateright overwrites discoveries while it
    /// finishes a block of states.) Returns `None` if none exists within `max_steps` steps.
    pub fn shortest_discovery(
        &self,
        property: &'static str,
        max_steps: usize,
    ) -> Option<Vec<Step>> {
        use stateright::{Checker, HasDiscoveries};
        for depth in 1..=max_steps + 1 {
            let checker = RouterModel::<S>::new(self.config)
                .checker()
                .target_max_depth(depth)
                .finish_when(HasDiscoveries::AnyOf([property].into()))
                .spawn_bfs()
                .join();
            if let Some(path) = checker.discovery(property) {
                return Some(path.into_actions());
            }
        }
        None
    }
}

fn take_build(builds: &mut Vec<Build>, id: BuildId) -> Option<Build> {
    let i = builds.iter().position(|b| b.id == id)?;
    Some(builds.remove(i))
}

impl<S: Subject> Model for RouterModel<S> {
    type State = State<S>;
    type Action = Step;

    fn init_states(&self) -> Vec<State<S>> {
        vec![State {
            subject: S::fresh(RetryPolicy::default()),
            desired: None,
            shut_down: false,
            retargets_left: self.config.retargets,
            failures_left: self.config.failures,
            builds: Vec::new(),
            timers: Vec::new(),
            current: None,
            newest: BuildId(0),
            requests: vec![Request::Idle; usize::from(self.config.requests)],
            published: 0,
            retired: 0,
            torn: 0,
            admission_left: self.config.admission_changes,
            emptied: 0,
            faults: 0,
            seen: 0,
        }]
    }

    fn actions(&self, s: &State<S>, out: &mut Vec<Step>) {
        // The order is deterministic: stateright stores paths as action indices.
        // Shutdown spends the controller's budget too: were it always enabled, every maximal
        // path would end in it and M9 would never be judged on a path without shutdown.
        if !s.shut_down && s.retargets_left > 0 {
            out.push(Step::SetTarget(None));
            for t in 0..self.config.targets {
                out.push(Step::SetTarget(Some(Target(t))));
            }
            if self.config.shutdown {
                out.push(Step::Shutdown);
            }
        }
        for b in &s.builds {
            out.push(Step::BuildSucceeds(b.id));
            if s.failures_left > 0 {
                out.push(Step::BuildFails(b.id));
            }
        }
        for t in &s.timers {
            out.push(Step::RetryFires(t.after));
        }
        if s.admission_left > 0 {
            // Only retired bindings lose their admission (the controller empties the set before
            // dropping a retired binding's sender); ids ascending, as the mask is.
            let candidates = s.retired & !s.emptied;
            for id in 0..64u32 {
                if candidates & (1u64 << id) != 0 {
                    out.push(Step::EmptyAdmission(BuildId(u64::from(id))));
                }
            }
        }
        for (i, r) in s.requests.iter().enumerate() {
            // Equal requests are interchangeable: step only the first of a run.
            if i > 0 && s.requests[i - 1] == *r {
                continue;
            }
            match r {
                Request::Idle => out.push(Step::Load(i)),
                Request::Loaded {
                    binding: Some(_), ..
                } => out.push(Step::Dispatch(i)),
                Request::Loaded { binding: None, .. } => out.push(Step::Bypass(i)),
                Request::Running(_) => out.push(Step::Finish(i)),
                Request::Done(_) => {}
            }
        }
    }

    fn next_state(&self, s: &State<S>, step: Step) -> Option<State<S>> {
        Some(self.apply(s, step).0)
    }

    fn format_action(&self, step: &Step) -> String {
        step.to_string()
    }

    fn format_step(&self, s: &State<S>, step: Step) -> Option<String> {
        let (n, actions) = self.apply(s, step);
        let mut text = crate::trace::describe(s, step, &actions, &n);
        if let Some(hint) = &self.hint {
            // The Explorer's link may run past the violation: mark the step where it happens.
            for p in crate::properties::all::<S, Self>() {
                if p.expectation == Expectation::Always
                    && (p.condition)(self, s)
                    && !(p.condition)(self, &n)
                {
                    text.push_str(&format!(
                        "\n\nthis step violates \"{}\"; the shortest counterexample: {}",
                        p.name, hint.command
                    ));
                }
            }
        }
        Some(text)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = crate::properties::all::<S, Self>();
        if let Some(hint) = &self.hint {
            for p in &mut properties {
                if let Some((_, shown)) = hint.names.iter().find(|(name, _)| *name == p.name) {
                    p.name = shown;
                }
            }
        }
        properties
    }
}
