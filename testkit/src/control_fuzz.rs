//! Fuzz target `control_ops`: the machine's inputs through the thread-safe [`Control`] core,
//! single-threaded, interleaved with what requests do (admit on the current route, finish, pin
//! a snapshot and let it go). A shadow [`Machine`] fed the same inputs is the oracle.
//!
//! Checked after every operation: the effects are the machine's async-side actions; the status
//! agrees with the machine; the snapshot any reader would load now agrees with the machine
//! (lifecycle, target, binding exactly when Active and built by the held build, the bypass
//! reason, the build it is about) and carries the status's epoch, which advances exactly when
//! what requests see changes; every binding is alive exactly while the core holds it or a
//! request or pinned snapshot does (stale builds dropped at once, retired ones once released);
//! the counters and the last error match the history.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use arbitrary::{Arbitrary, Unstructured};

use crate::machine_fuzz::{PolicySeed, Step};
use crate::reference::MachineView;
use prefill_router::control::{Control, ControlStatus, Effect};
use prefill_router::lifecycle::{Action, BuildId, Input, Lifecycle, Machine, RetryPolicy};
use prefill_router::snapshot::{BypassReason, Route, Snapshot};

/// At most this many requests hold a binding at once (bounds the harness's memory).
const MAX_REQUESTS: usize = 16;

/// The bindings alive right now, by build id (a build id may have several bindings: a repeated
/// success of one build hands the core a second binding).
type Registry = Arc<Mutex<BTreeMap<BuildId, usize>>>;

/// A binding that registers itself while alive.
pub struct TestBinding {
    /// The build that produced it.
    pub build: BuildId,
    /// The target it was built for (255 for a build never started).
    pub target: u8,
    registry: Registry,
}

impl TestBinding {
    fn new(build: BuildId, target: u8, registry: &Registry) -> Self {
        *registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(build)
            .or_default() += 1;
        TestBinding {
            build,
            target,
            registry: Arc::clone(registry),
        }
    }
}

impl Drop for TestBinding {
    fn drop(&mut self) {
        let mut live = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = live.get_mut(&self.build) {
            *n -= 1;
            if *n == 0 {
                live.remove(&self.build);
            }
        }
    }
}

impl fmt::Debug for TestBinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "binding {} for {}", self.build, self.target)
    }
}

/// The snapshot type of the harness.
pub type TestSnapshot = Snapshot<u8, TestBinding>;

/// The control core's API as the harness drives it (the real core, or a mutant).
pub trait ControlApi {
    /// [`Control::set_target`].
    fn set_target(&self, target: Option<u8>) -> Vec<Effect<u8>>;
    /// [`Control::build_succeeded`].
    fn build_succeeded(&self, build: BuildId, binding: TestBinding) -> Vec<Effect<u8>>;
    /// [`Control::build_failed`].
    fn build_failed(&self, build: BuildId, error: &str) -> Vec<Effect<u8>>;
    /// [`Control::retry_elapsed`].
    fn retry_elapsed(&self, after: BuildId) -> Vec<Effect<u8>>;
    /// [`Control::shutdown`].
    fn shutdown(&self) -> Vec<Effect<u8>>;
    /// What [`Control::load`] pins, as an owned `Arc`.
    fn snapshot(&self) -> Arc<TestSnapshot>;
    /// [`Control::route`].
    fn route(&self) -> Route<TestBinding>;
    /// [`Control::status`].
    fn status(&self) -> ControlStatus<u8>;
}

impl ControlApi for Control<u8, TestBinding> {
    fn set_target(&self, target: Option<u8>) -> Vec<Effect<u8>> {
        Control::set_target(self, target).into_iter().collect()
    }
    fn build_succeeded(&self, build: BuildId, binding: TestBinding) -> Vec<Effect<u8>> {
        Control::build_succeeded(self, build, binding)
            .into_iter()
            .collect()
    }
    fn build_failed(&self, build: BuildId, error: &str) -> Vec<Effect<u8>> {
        Control::build_failed(self, build, error)
            .into_iter()
            .collect()
    }
    fn retry_elapsed(&self, after: BuildId) -> Vec<Effect<u8>> {
        Control::retry_elapsed(self, after).into_iter().collect()
    }
    fn shutdown(&self) -> Vec<Effect<u8>> {
        Control::shutdown(self).into_iter().collect()
    }
    fn snapshot(&self) -> Arc<TestSnapshot> {
        self.load().to_arc()
    }
    fn route(&self) -> Route<TestBinding> {
        Control::route(self)
    }
    fn status(&self) -> ControlStatus<u8> {
        Control::status(self)
    }
}

/// One operation of a `control_ops` script.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ControlStep {
    /// A machine input, through the matching `Control` method.
    Input(Step),
    /// A request takes the current route; if it prefills, it holds the binding.
    Admit,
    /// A request holding a binding finishes (index modulo the requests held).
    Finish(u8),
    /// A reader pins the current snapshot (replacing the one it pinned).
    Pin,
    /// The reader lets its snapshot go.
    Unpin,
}

/// A whole `control_ops` input.
#[derive(Arbitrary, Clone, Debug, PartialEq, Eq)]
pub struct ControlScript {
    /// The retry policy.
    pub policy: PolicySeed,
    /// The operations.
    pub steps: Vec<ControlStep>,
}

/// The async-side part of a machine action, written independently of `Control`'s own mapping.
fn effect_of(action: &Action<u8>) -> Option<Effect<u8>> {
    match action {
        Action::StartBuild { build, target } => Some(Effect::StartBuild {
            build: *build,
            target: *target,
        }),
        Action::CancelBuild { build } => Some(Effect::CancelBuild { build: *build }),
        Action::ScheduleRetry {
            after,
            delay,
            attempt,
        } => Some(Effect::ScheduleRetry {
            after: *after,
            delay: *delay,
            attempt: *attempt,
        }),
        Action::CancelRetry { after } => Some(Effect::CancelRetry { after: *after }),
        Action::Publish { .. } | Action::Retire { .. } | Action::Discard { .. } => None,
    }
}

/// What requests see of a snapshot, epoch aside.
type Seen = (Lifecycle, Option<BypassReason>, Option<u8>, Option<BuildId>);

fn seen(s: &TestSnapshot) -> Seen {
    (s.lifecycle(), s.bypass(), s.target().copied(), s.build())
}

/// The bypass reason and build a snapshot must show for machine state `m`.
fn expected_route(m: &MachineView<u8>) -> (Option<BypassReason>, Option<BuildId>) {
    match m.lifecycle {
        Lifecycle::Active => (None, m.held.map(|(b, _)| b)),
        Lifecycle::Unavailable if m.shut_down => (Some(BypassReason::ShutDown), None),
        Lifecycle::Unavailable => (Some(BypassReason::NoTarget), None),
        Lifecycle::Pending if !m.targeted => (Some(BypassReason::NotYetTargeted), None),
        Lifecycle::Pending => match (m.in_flight, m.retry_armed) {
            (_, Some(after)) => (Some(BypassReason::RetryingAfterFailure), Some(after)),
            (in_flight, None) => (Some(BypassReason::Building), in_flight.map(|(b, _)| b)),
        },
    }
}

/// Counters expected from the history.
#[derive(Default)]
struct Expected {
    published: u64,
    discarded: u64,
    retired: u64,
    retired_builds: BTreeSet<BuildId>,
    last_error: Option<String>,
}

/// What one script exercised (to judge a corpus).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControlStats {
    /// Requests admitted on a binding.
    pub admitted: usize,
    /// Operations after which a retired binding was still alive (held by a request or a pin).
    pub retired_still_alive: usize,
    /// Stale successes whose binding the core dropped.
    pub discarded: u64,
    /// Publications of a new snapshot.
    pub epochs: u64,
}

impl ControlStats {
    /// Add another script's counts.
    pub fn add(&mut self, o: ControlStats) {
        self.admitted += o.admitted;
        self.retired_still_alive += o.retired_still_alive;
        self.discarded += o.discarded;
        self.epochs += o.epochs;
    }
}

/// Run `script` through the core `make` builds; returns what it exercised, or what broke.
pub fn run_control_script<C: ControlApi>(
    script: &ControlScript,
    make: impl FnOnce(RetryPolicy) -> C,
) -> Result<ControlStats, String> {
    let mut stats = ControlStats::default();
    let policy = script.policy.policy();
    let registry: Registry = Arc::default();
    let control = make(policy);
    let mut shadow: Machine<u8> = Machine::new(policy);
    let mut started: BTreeMap<BuildId, u8> = BTreeMap::new();
    let mut requests: Vec<Route<TestBinding>> = Vec::new();
    let mut pinned: Option<Arc<TestSnapshot>> = None;
    let mut expected = Expected::default();
    // What the last check saw, not the snapshot itself: holding it would keep its binding alive.
    let initial = control.snapshot();
    if initial.epoch() != 0 || initial.lifecycle() != Lifecycle::Pending {
        return Err(format!("initial snapshot {initial:?}"));
    }
    let mut last = (seen(&initial), initial.epoch());
    drop(initial);
    for (index, step) in script.steps.iter().enumerate() {
        let fail = |what: String| format!("step {index} ({step:?}): {what}");
        match *step {
            ControlStep::Input(step) => {
                let input = step.resolve(&MachineView::of(&shadow));
                let actions: Vec<Action<u8>> = shadow.handle(input.clone()).into_iter().collect();
                let error = format!("build failed at step {index}");
                let effects = match input {
                    Input::SetTarget(t) => control.set_target(t),
                    Input::BuildSucceeded(b) => {
                        let target = started.get(&b).copied().unwrap_or(u8::MAX);
                        control.build_succeeded(b, TestBinding::new(b, target, &registry))
                    }
                    Input::BuildFailed(b) => control.build_failed(b, &error),
                    Input::RetryElapsed(b) => control.retry_elapsed(b),
                    Input::Shutdown => control.shutdown(),
                };
                let want: Vec<Effect<u8>> = actions.iter().filter_map(effect_of).collect();
                if effects != want {
                    return Err(fail(format!(
                        "{input:?}: effects {effects:?}, machine says {want:?}"
                    )));
                }
                for action in &actions {
                    match action {
                        Action::StartBuild { build, target } => {
                            started.insert(*build, *target);
                        }
                        Action::Publish { .. } => {
                            expected.published += 1;
                            expected.last_error = None;
                        }
                        Action::Discard { .. } => expected.discarded += 1,
                        Action::Retire { build } => {
                            expected.retired += 1;
                            expected.retired_builds.insert(*build);
                        }
                        Action::ScheduleRetry { .. } => expected.last_error = Some(error.clone()),
                        Action::CancelBuild { .. } | Action::CancelRetry { .. } => {}
                    }
                }
            }
            ControlStep::Admit => {
                let route = control.route();
                if let Route::Prefill(b) = &route {
                    let held = shadow.held().map(|(id, t)| (id, *t));
                    if shadow.lifecycle() != Lifecycle::Active || held != Some((b.build, b.target))
                    {
                        return Err(fail(format!(
                            "admitted on {b:?} while the machine is {} holding {held:?}",
                            shadow.lifecycle()
                        )));
                    }
                    stats.admitted += 1;
                    if requests.len() < MAX_REQUESTS {
                        requests.push(route);
                    }
                } else if shadow.lifecycle() == Lifecycle::Active {
                    return Err(fail(format!("Active machine, route {route:?}")));
                }
            }
            ControlStep::Finish(n) => {
                if !requests.is_empty() {
                    let i = usize::from(n) % requests.len();
                    requests.swap_remove(i);
                }
            }
            ControlStep::Pin => pinned = Some(control.snapshot()),
            ControlStep::Unpin => pinned = None,
        }
        last = check_state(
            &control, &shadow, &last, &expected, &registry, &requests, &pinned,
        )
        .map_err(fail)?;
        if control.status().counters.retired_alive > 0 {
            stats.retired_still_alive += 1;
        }
    }
    stats.discarded = expected.discarded;
    stats.epochs = last.1;
    Ok(stats)
}

/// Everything checked after one operation; returns what the published snapshot shows now.
fn check_state<C: ControlApi>(
    control: &C,
    shadow: &Machine<u8>,
    last: &(Seen, u64),
    expected: &Expected,
    registry: &Registry,
    requests: &[Route<TestBinding>],
    pinned: &Option<Arc<TestSnapshot>>,
) -> Result<(Seen, u64), String> {
    let m = MachineView::of(shadow);
    let status = control.status();
    let got = (
        status.lifecycle,
        status.targeted,
        status.desired,
        status.held,
        status.in_flight,
        status.retry_armed,
        status.failures,
        status.shut_down,
    );
    let want = (
        m.lifecycle,
        m.targeted,
        m.desired,
        m.held,
        m.in_flight,
        m.retry_armed,
        m.failures,
        m.shut_down,
    );
    if got != want {
        return Err(format!("status {got:?}, machine {want:?}"));
    }
    if status.last_error != expected.last_error {
        return Err(format!(
            "last error {:?}, expected {:?}",
            status.last_error, expected.last_error
        ));
    }

    // The snapshot a reader loads now.
    let snap = control.snapshot();
    let (bypass, build) = expected_route(&m);
    let want_seen = (m.lifecycle, bypass, m.desired, build);
    if seen(&snap) != want_seen {
        return Err(format!(
            "snapshot shows {:?}, machine calls for {want_seen:?}",
            seen(&snap)
        ));
    }
    match (snap.binding(), m.held) {
        (Some(b), Some((id, t))) if m.lifecycle == Lifecycle::Active => {
            if (b.build, b.target) != (id, t) {
                return Err(format!(
                    "snapshot binding {b:?}, machine holds {id} for {t}"
                ));
            }
        }
        (None, _) if m.lifecycle != Lifecycle::Active => {}
        (b, _) => {
            return Err(format!(
                "snapshot binding {b:?} with lifecycle {}",
                m.lifecycle
            ))
        }
    }
    let route = control.route();
    let same_route = match (&route, snap.route_ref()) {
        (Route::Prefill(a), Route::Prefill(b)) => Arc::ptr_eq(a, b),
        (Route::Bypass(a), Route::Bypass(b)) => a == b,
        _ => false,
    };
    if !same_route {
        return Err(format!("route {route:?}, snapshot {:?}", snap.route_ref()));
    }
    drop(route);

    // Epochs: the status and the cell agree; a new one exactly when what requests see changed.
    let changed = seen(&snap) != last.0;
    let want_epoch = last.1 + u64::from(changed);
    if snap.epoch() != want_epoch || status.epoch != snap.epoch() {
        return Err(format!(
            "epoch {} (status {}), expected {want_epoch} (view changed: {changed})",
            snap.epoch(),
            status.epoch
        ));
    }

    // Bindings: alive exactly while the core, a request or the pinned snapshot holds them.
    let mut holders: BTreeSet<BuildId> = m.held.map(|(b, _)| b).into_iter().collect();
    holders.extend(requests.iter().filter_map(|r| r.binding().map(|b| b.build)));
    holders.extend(pinned.as_ref().and_then(|s| s.binding()).map(|b| b.build));
    let live: BTreeSet<BuildId> = registry
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .keys()
        .copied()
        .collect();
    if live != holders {
        return Err(format!("bindings alive {live:?}, held by {holders:?}"));
    }

    let c = status.counters;
    let retired_alive = expected.retired_builds.intersection(&live).count();
    let got = (
        c.published,
        c.discarded,
        c.retired,
        c.retired_alive,
        c.retired_untracked,
    );
    let want = (
        expected.published,
        expected.discarded,
        expected.retired,
        retired_alive,
        0,
    );
    if got != want || c.snapshots != snap.epoch() {
        return Err(format!(
            "counters {c:?}; expected (published, discarded, retired, retired_alive, untracked) {want:?}, snapshots {}",
            snap.epoch()
        ));
    }
    Ok((seen(&snap), snap.epoch()))
}

/// Decode raw fuzz bytes the way libfuzzer-sys does for a typed target.
pub fn decode(bytes: &[u8]) -> Option<ControlScript> {
    ControlScript::arbitrary_take_rest(Unstructured::new(bytes)).ok()
}

/// Run one decoded script through the real core; panics when a check fails.
pub fn check_control_script(script: &ControlScript) {
    if let Err(e) = run_control_script(script, Control::new) {
        panic!("control_ops: {e}\npolicy: {:?}", script.policy);
    }
}

/// The `control_ops` harness.
pub fn control_ops(bytes: &[u8]) {
    if let Some(script) = decode(bytes) {
        check_control_script(&script);
    }
}
