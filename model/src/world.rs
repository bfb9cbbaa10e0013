//! The model's state: the machine under check plus the world the tokio adapter lives in.

use std::fmt;

use prefill_router::lifecycle::{BuildId, Lifecycle};

use crate::subject::Target;

/// A build the adapter started and whose result has not been reported yet. A cancelled build
/// may still report (late), in any order with the others.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Build {
    /// The id from `StartBuild`.
    pub id: BuildId,
    /// What it builds (the adapter's own record, not the machine's).
    pub target: Target,
    /// Whether the machine ordered `CancelBuild` for it.
    pub cancelled: bool,
    /// Whether it was started by a retry timer (for the vacuity check "a retry reaches Active").
    pub retry: bool,
}

/// A retry timer the adapter armed. A cancelled timer may still fire late (a firing racing its
/// cancellation), which the machine must ignore.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Timer {
    /// The failed build the retry follows.
    pub after: BuildId,
    /// The target the failed build was for.
    pub target: Target,
    /// Whether the machine ordered `CancelRetry` for it.
    pub cancelled: bool,
}

impl fmt::Debug for Build {
    // One line (`#1 for A, cancelled`): the Explorer's complete state lists several.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} for {}", self.id, self.target)?;
        if self.cancelled {
            f.write_str(", cancelled")?;
        }
        if self.retry {
            f.write_str(", by a retry")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Timer {
    // One line (`after #1 for A, cancelled`), as for builds.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "after {} for {}", self.after, self.target)?;
        if self.cancelled {
            f.write_str(", cancelled")?;
        }
        Ok(())
    }
}

/// A binding the adapter built: the worker set of one build, for the target it really serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Binding {
    /// The build that produced it.
    pub build: BuildId,
    /// The target it serves.
    pub target: Target,
}

impl fmt::Display for Binding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.target, self.build)
    }
}

/// A note on how a state was reached, kept for people reading states (the Explorer shows the
/// state's `Debug`) and ignored by `Eq`, `Ord` and `Hash`: the checker identifies states
/// without it, so the state space and every pinned count stay what they were. Its value in a
/// state is the one of the path replayed to reach it.
#[derive(Clone, Copy)]
pub struct Note<T>(pub T);

impl<T> PartialEq for Note<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl<T> Eq for Note<T> {}

impl<T> PartialOrd for Note<T> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<T> Ord for Note<T> {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

impl<T> std::hash::Hash for Note<T> {
    // Writes nothing, so a variant holding a note hashes exactly as it did without one.
    fn hash<H: std::hash::Hasher>(&self, _: &mut H) {}
}

impl<T: fmt::Debug> fmt::Debug for Note<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// How a request finished.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It finished on the binding it dispatched on.
    Served(Binding),
    /// Its snapshot had no binding: it went straight to decode.
    Bypassed,
    /// It failed with a typed error: the admission set of the binding it loaded was empty.
    Failed(Binding),
}

impl fmt::Debug for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Served(b) => write!(f, "served on {b}"),
            Outcome::Bypassed => write!(f, "bypassed prefill"),
            Outcome::Failed(b) => write!(f, "failed on {b}: its admission set was empty"),
        }
    }
}

/// One request's progress: load the snapshot, then dispatch on the loaded binding or bypass to
/// decode, then finish.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Request {
    /// Not arrived yet.
    Idle,
    /// Loaded the snapshot: the binding it will use (`None`: bypass) and the controller's
    /// decision in force when it loaded.
    Loaded {
        /// The binding the snapshot routed it to.
        binding: Option<Binding>,
        /// The target of the last `SetTarget` that had returned before the load.
        desired: Option<Target>,
    },
    /// Prefilling on the binding it loaded.
    Running(Binding),
    /// Finished: on its binding, by bypass, or by a typed failure (its binding's admission
    /// had emptied). A failure is an ending, not a loss. The outcome is a [`Note`]: requests
    /// that finished differently are the same state to the checker, as before it was recorded.
    Done(Note<Outcome>),
}

impl Request {
    /// A finished request with this outcome.
    pub fn done(outcome: Outcome) -> Request {
        Request::Done(Note(outcome))
    }

    /// Whether the request has finished (whatever its outcome).
    pub fn is_done(&self) -> bool {
        matches!(self, Request::Done(_))
    }
}

impl fmt::Debug for Request {
    // Bindings as `A@#1` and the outcome in words: the Explorer shows this text.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opt = |t: Option<Target>| t.map_or("None".to_string(), |t| t.to_string());
        match self {
            Request::Idle => write!(f, "idle"),
            Request::Loaded { binding, desired } => {
                let on = binding.map_or("no binding".to_string(), |b| b.to_string());
                write!(f, "loaded {on} (target then {})", opt(*desired))
            }
            Request::Running(b) => write!(f, "running on {b}"),
            Request::Done(Note(outcome)) => write!(f, "done: {outcome:?}"),
        }
    }
}

/// What readers see: the lifecycle and the binding to route on (only when Active).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Snapshot {
    /// The machine's lifecycle.
    pub lifecycle: Lifecycle,
    /// The adapter's published binding, exposed only when Active.
    pub binding: Option<Binding>,
}

/// Sticky records of bad events (a safety property reads one bit each).
pub mod fault {
    /// A cancelled or superseded build was published.
    pub const STALE_PUBLISHED: u16 = 1 << 0;
    /// A `Retire` named a binding never published or already retired, or a published binding
    /// was replaced without being retired.
    pub const BAD_RETIRE: u16 = 1 << 1;
    /// A retired binding was published again.
    pub const REPUBLISHED: u16 = 1 << 2;
    /// A request that loaded after a retarget dispatched to a binding of an earlier target.
    pub const STALE_DISPATCH: u16 = 1 << 3;
    /// A request lost the binding it loaded (torn down under it).
    pub const REQUEST_LOST: u16 = 1 << 4;
    /// A `Publish` named a build that had not just succeeded and is not a known binding.
    pub const UNKNOWN_PUBLISH: u16 = 1 << 5;
    /// A request was dispatched on a binding whose admission set was empty (to a worker
    /// outside admission).
    pub const OUTSIDE_ADMISSION: u16 = 1 << 6;

    /// Each bit with the name the state's `Debug` shows for it.
    pub const NAMES: [(u16, &str); 7] = [
        (STALE_PUBLISHED, "stale-published"),
        (BAD_RETIRE, "bad-retire"),
        (REPUBLISHED, "republished"),
        (STALE_DISPATCH, "stale-dispatch"),
        (REQUEST_LOST, "request-lost"),
        (UNKNOWN_PUBLISH, "unknown-publish"),
        (OUTSIDE_ADMISSION, "outside-admission"),
    ];
}

/// Sticky records of good events, so `sometimes` properties show the model is not vacuous.
pub mod seen {
    /// A build started by a retry timer was published.
    pub const RETRY_ACTIVE: u8 = 1 << 0;
    /// A request finished on a binding that had been retired meanwhile.
    pub const RETIRED_SERVED: u8 = 1 << 1;
    /// A finished build was discarded as stale.
    pub const STALE_REJECTED: u8 = 1 << 2;
    /// A held binding was reused on a return to its target (Active without a build).
    pub const REUSED: u8 = 1 << 3;
    /// A request on a retired binding failed because the binding's admission had emptied.
    pub const ADMISSION_FAILED: u8 = 1 << 4;

    /// Each bit with the name the state's `Debug` shows for it.
    pub const NAMES: [(u8, &str); 5] = [
        (RETRY_ACTIVE, "retry-active"),
        (RETIRED_SERVED, "retired-served"),
        (STALE_REJECTED, "stale-rejected"),
        (REUSED, "reused"),
        (ADMISSION_FAILED, "admission-failed"),
    ];
}

/// The whole model state. Its `Debug` (what the Explorer shows as the complete state) names
/// the members of the bit sets instead of printing the masks.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct State<S> {
    /// The machine under check.
    pub subject: S,
    /// The controller's last decision (`None`: no `SetTarget` yet).
    pub desired: Option<Option<Target>>,
    /// Whether the controller shut the hop down.
    pub shut_down: bool,
    /// Retargets the controller may still make.
    pub retargets_left: u8,
    /// Build failures the world may still inject.
    pub failures_left: u8,
    /// Builds started and not yet reported, by id.
    pub builds: Vec<Build>,
    /// Retry timers armed and not yet fired, by id.
    pub timers: Vec<Timer>,
    /// The adapter's published binding (set by `Publish`, cleared by `Retire`).
    pub current: Option<Binding>,
    /// The newest build ever started: an older one that finishes is superseded.
    pub newest: BuildId,
    /// Requests, kept sorted: they are interchangeable, so the sorted list is a canonical form.
    pub requests: Vec<Request>,
    /// Bit `i`: build `i` was ever published.
    pub published: u64,
    /// Bit `i`: build `i` was retired.
    pub retired: u64,
    /// Bit `i`: binding `i` was torn down (its workers dropped).
    pub torn: u64,
    /// Admission changes the world may still make (each empties one retired binding's set).
    pub admission_left: u8,
    /// Bit `i`: the admission set of binding `i` is empty.
    pub emptied: u64,
    /// [`fault`] bits.
    pub faults: u16,
    /// [`seen`] bits.
    pub seen: u8,
}

/// A set of build ids (one bit each), shown as `{#1, #3}`.
struct Builds(u64);

impl fmt::Debug for Builds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids = (0..64u64).filter(|i| self.0 & (1 << i) != 0).map(BuildId);
        write_set(f, ids)
    }
}

/// Flag bits (faults or seen events), shown by name as `{stale-published}`.
struct Flags<T: 'static>(T, &'static [(T, &'static str)]);

impl<T> fmt::Debug for Flags<T>
where
    T: Copy + std::ops::BitAnd<Output = T> + PartialEq + Default,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = self
            .1
            .iter()
            .filter(|(bit, _)| self.0 & *bit != T::default());
        write_set(f, names.map(|(_, name)| name))
    }
}

/// Writes `{a, b}` on one line, also under `{:#?}`: short sets read better flat.
fn write_set<T: fmt::Display>(
    f: &mut fmt::Formatter<'_>,
    items: impl Iterator<Item = T>,
) -> fmt::Result {
    f.write_str("{")?;
    for (i, item) in items.enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{item}")?;
    }
    f.write_str("}")
}

/// A binding shown as `A@#1` (or `None`).
struct Shown(Option<Binding>);

impl fmt::Debug for Shown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(b) => write!(f, "{b}"),
            None => f.write_str("None"),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for State<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("State")
            .field("subject", &self.subject)
            .field("desired", &self.desired)
            .field("shut_down", &self.shut_down)
            .field("retargets_left", &self.retargets_left)
            .field("failures_left", &self.failures_left)
            .field("builds", &self.builds)
            .field("timers", &self.timers)
            .field("current", &Shown(self.current))
            .field("newest", &format_args!("{}", self.newest))
            .field("requests", &self.requests)
            .field("published", &Builds(self.published))
            .field("retired", &Builds(self.retired))
            .field("torn", &Builds(self.torn))
            .field("admission_left", &self.admission_left)
            .field("emptied", &Builds(self.emptied))
            .field("faults", &Flags(self.faults, &fault::NAMES))
            .field("seen", &Flags(self.seen, &seen::NAMES))
            .finish()
    }
}

impl<S: crate::subject::Subject> State<S> {
    /// The snapshot the adapter publishes after every step.
    pub fn snapshot(&self) -> Snapshot {
        let lifecycle = self.subject.lifecycle();
        Snapshot {
            lifecycle,
            binding: if lifecycle == Lifecycle::Active {
                self.current
            } else {
                None
            },
        }
    }
}

/// The bit of a build id in the `published`/`retired`/`torn`/`emptied` masks; ids past 63 share bit 63
/// (the model's bounds keep ids far below that: see `Config::validate`).
pub fn bit(id: BuildId) -> u64 {
    1u64 << id.0.min(63)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Config, Real, RouterModel};
    use stateright::Model;

    #[test]
    fn debug_names_the_members_of_the_bit_sets_and_the_outcomes() {
        let model = RouterModel::<Real>::new(Config::STANDARD);
        let mut s = model.init_states().remove(0);
        s.published = bit(BuildId(1)) | bit(BuildId(3));
        s.retired = bit(BuildId(1));
        s.emptied = bit(BuildId(1));
        s.faults = fault::STALE_DISPATCH;
        s.seen = seen::ADMISSION_FAILED | seen::REUSED;
        let on = Binding {
            build: BuildId(1),
            target: Target(0),
        };
        s.requests = vec![
            Request::done(Outcome::Failed(on)),
            Request::done(Outcome::Bypassed),
        ];
        s.builds = vec![Build {
            id: BuildId(3),
            target: Target(1),
            cancelled: true,
            retry: true,
        }];
        for text in [format!("{s:?}"), format!("{s:#?}")] {
            assert!(text.contains("#3 for B, cancelled, by a retry"), "{text}");
            assert!(text.contains("published: {#1, #3}"), "{text}");
            assert!(text.contains("retired: {#1}"), "{text}");
            assert!(text.contains("torn: {}"), "{text}");
            assert!(text.contains("emptied: {#1}"), "{text}");
            assert!(text.contains("faults: {stale-dispatch}"), "{text}");
            assert!(text.contains("seen: {reused, admission-failed}"), "{text}");
            assert!(
                text.contains("done: failed on A@#1: its admission set was empty"),
                "{text}"
            );
            assert!(text.contains("done: bypassed prefill"), "{text}");
        }
    }

    #[test]
    fn outcomes_do_not_distinguish_states() {
        // The outcome is a note: the checker must see one state, as before it was recorded.
        use std::hash::{BuildHasher, RandomState};
        let on = Binding {
            build: BuildId(1),
            target: Target(0),
        };
        let (a, b) = (
            Request::done(Outcome::Served(on)),
            Request::done(Outcome::Bypassed),
        );
        assert_eq!(a, b);
        assert_eq!(a.cmp(&b), std::cmp::Ordering::Equal);
        let hasher = RandomState::new();
        assert_eq!(hasher.hash_one(a), hasher.hash_one(b));
        assert!(Request::Idle < a);
    }
}
