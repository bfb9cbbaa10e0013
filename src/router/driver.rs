//! The driver loop: turns the control core's effects into build tasks and one retry timer.
//!
//! It decides nothing. The machine (through [`Control`](crate::control::Control)) says what to
//! build, what to cancel and when to retry; the driver only carries that out and reports
//! results back. Effects reach it over one channel from several threads (`set_target`
//! callers, build tasks), so two batches can arrive in the opposite order of the control calls
//! that produced them. Build and retry ids are fresh and increasing, which makes reordering
//! harmless with two floors:
//! - a `StartBuild` whose id is not above every build id already seen (started or cancelled)
//!   is stale: a later build exists, so this one was finished or cancelled in the machine
//!   before it was even started here; it is skipped;
//! - a `CancelBuild` for a build not started yet raises the floor, so the start is skipped;
//! - the same two rules apply to `ScheduleRetry` / `CancelRetry` by the failed build's id.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::shared::{Msg, Shared};
use super::status::bump;
use crate::binding::{BindingFactory, BuildError, WorkerSetTarget};
use crate::control::{Effect, Effects};
use crate::lifecycle::BuildId;

/// Builds started and not yet finished or cancelled: normally zero or one, briefly two while
/// a cancellation is on its way.
type Running = Vec<(BuildId, CancellationToken)>;

pub(crate) struct Driver<F: BindingFactory> {
    shared: Arc<Shared<F>>,
    rx: mpsc::UnboundedReceiver<Msg>,
    running: Running,
    /// Highest build id started or cancelled.
    build_floor: u64,
    /// The armed retry: the failed build it follows and when it fires.
    retry: Option<(BuildId, Instant)>,
    /// Highest failed-build id scheduled or cancelled.
    retry_floor: u64,
    rng: SplitMix,
}

impl<F: BindingFactory> Driver<F> {
    pub(crate) fn new(shared: Arc<Shared<F>>, rx: mpsc::UnboundedReceiver<Msg>) -> Self {
        let jitter_rng = match shared.config.jitter_seed {
            Some(seed) => SplitMix::new(seed),
            None => from_entropy(),
        };
        Driver {
            shared,
            rx,
            running: Vec::new(),
            build_floor: 0,
            retry: None,
            retry_floor: 0,
            rng: jitter_rng,
        }
    }

    /// Run until the router's root token is cancelled (shutdown or Drop).
    pub(crate) async fn run(mut self) {
        let cancel = self.shared.cancel.clone();
        loop {
            let deadline = self.retry.map(|(_, at)| at);
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                msg = self.rx.recv() => match msg {
                    Some(Msg::Effects(effects)) => self.carry_out(effects),
                    Some(Msg::Finished(build, effects)) => {
                        // Finished, not cancelled: its token must live on with its binding.
                        self.running.retain(|(id, _)| *id != build);
                        self.shared.seam.build_finished(|| self.shared.control.route());
                        self.carry_out(effects);
                    }
                    // Shared holds the sender and we hold Shared: unreachable, but ending is
                    // the only sensible answer.
                    None => break,
                },
                _ = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                    if let Some((after, _)) = self.retry.take() {
                        let effects = self.shared.control.retry_elapsed(after);
                        self.shared.announce();
                        self.carry_out(effects);
                    }
                }
            }
        }
        // The root token cancels every build's child token already; drop ours explicitly so a
        // reader of this code sees nothing is left behind.
        for (_, token) in self.running.drain(..) {
            token.cancel();
        }
        tracing::debug!(router = %self.shared.config.name, "prefill router driver ended");
    }

    fn carry_out(&mut self, effects: Effects<WorkerSetTarget>) {
        for effect in effects {
            match effect {
                Effect::StartBuild { build, target } => {
                    if build.0 <= self.build_floor {
                        tracing::trace!(%build, "stale start skipped");
                        continue;
                    }
                    self.build_floor = build.0;
                    self.start(build, target);
                }
                Effect::CancelBuild { build } => {
                    self.build_floor = self.build_floor.max(build.0);
                    self.running.retain(|(id, token)| {
                        if *id == build {
                            token.cancel();
                            false
                        } else {
                            true
                        }
                    });
                }
                Effect::ScheduleRetry {
                    after,
                    delay,
                    attempt,
                } => {
                    if after.0 <= self.retry_floor {
                        continue;
                    }
                    self.retry_floor = after.0;
                    let delay =
                        jittered(delay, self.shared.config.jitter_fraction(), &mut self.rng);
                    tracing::debug!(%after, ?delay, attempt, "prefill build retry armed");
                    self.retry = Some((after, deadline_after(delay)));
                }
                Effect::CancelRetry { after } => {
                    self.retry_floor = self.retry_floor.max(after.0);
                    if self.retry.is_some_and(|(id, _)| id == after) {
                        self.retry = None;
                    }
                }
            }
        }
    }

    fn start(&mut self, build: BuildId, target: WorkerSetTarget) {
        let token = self.shared.cancel.child_token();
        bump(&self.shared.tally.builds_started);
        let span = tracing::info_span!(
            "prefill_build",
            router = %self.shared.config.name,
            %build,
            target = %target.id,
            endpoint = %target.endpoint,
        );
        let task = build_task(Arc::clone(&self.shared), build, target, token.clone());
        self.shared.tracker.spawn(task.instrument(span));
        self.running.push((build, token));
    }
}

/// One build: the factory's future under the build timeout, reported back through `Control`.
async fn build_task<F: BindingFactory>(
    shared: Arc<Shared<F>>,
    build: BuildId,
    target: WorkerSetTarget,
    token: CancellationToken,
) {
    let timeout = shared.config.build_timeout;
    // A panicking factory is a bug, but it must not leave the machine waiting forever for a
    // result that never comes: a panic counts as a failed build (and is retried).
    let future = std::panic::catch_unwind(AssertUnwindSafe(|| {
        shared.factory.build(target, token.clone())
    }));
    let result = match future {
        Ok(future) => tokio::select! {
            biased;
            // Cancelled (superseded, or shutdown): drop the build future, report nothing; the
            // machine already forgot this build.
            _ = token.cancelled() => return,
            result = tokio::time::timeout(timeout, AssertUnwindSafe(future).catch_unwind()) => {
                result.map(|caught| caught.unwrap_or_else(|_| Err(panicked())))
            }
        },
        Err(_) => Ok(Err(panicked())),
    };
    let effects = match result {
        Ok(Ok(binding)) => {
            tracing::info!("prefill binding built");
            shared.control.build_succeeded(build, binding)
        }
        Ok(Err(error)) => {
            bump(&shared.tally.build_failures);
            // No binding exists: end whatever the factory left running under this token.
            token.cancel();
            shared.control.build_failed(build, error)
        }
        Err(_elapsed) => {
            bump(&shared.tally.build_failures);
            bump(&shared.tally.build_timeouts);
            token.cancel();
            shared
                .control
                .build_failed(build, BuildError::TimedOut { after: timeout })
        }
    };
    shared.dispatch(Msg::Finished(build, effects));
}

fn panicked() -> BuildError {
    BuildError::new("the binding factory panicked")
}

/// `now + delay`, saturating at a year away (`Instant + Duration` panics on overflow, and a
/// configured policy may say `Duration::MAX`).
pub(crate) fn deadline_after(delay: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(delay.min(FAR)).unwrap_or(now)
}

/// `delay` plus a uniform extra of up to `fraction * delay`.
pub(crate) fn jittered(delay: Duration, fraction: f64, rng: &mut SplitMix) -> Duration {
    // No shortcut for a zero fraction or delay: the extra is exactly zero then anyway, and a
    // redundant branch would only breed equivalent mutations.
    let extra = delay.as_secs_f64() * fraction * rng.unit();
    // `extra` is finite and non-negative for a configured fraction (clamped to [0, 1], unit in
    // [0, 1)); anything else adds nothing. A delay so large that adding overflows keeps the
    // machine's delay.
    delay
        .checked_add(Duration::try_from_secs_f64(extra).unwrap_or(Duration::ZERO))
        .unwrap_or(delay)
}

/// Jitter's generator, seeded per frontend (quality is irrelevant; independence between
/// frontends is not).
pub(crate) type SplitMix = crate::rng::SplitMix64;

/// Seeded from the process's random hasher keys, so frontends do not jitter in lockstep.
pub(crate) fn from_entropy() -> SplitMix {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(crate::rng::GAMMA);
    SplitMix::new(hasher.finish())
}
