//! The pure worker-health machine: one circuit breaker per instance in discovery.
//!
//! [`Machine`] decides which instances the request path may route to after connection-level
//! failures. It is written like the [lifecycle](crate::lifecycle): sans-IO, no clock, no
//! randomness source of its own (jitter is derived from a seed given at construction), no
//! logging. Facts go in as [`Input`]s; orders come out as [`Action`]s, one inline batch per
//! input ([`Actions`]). The push dispatcher's routable view (`push::RoutableView`, with the
//! `runtime` feature) drives it (docs/health.md).
//!
//! # Driving it
//!
//! ```
//! use prefill_router::health::{Action, BackoffPolicy, FailureClass, Input, Machine, ProbeId, TimerId};
//!
//! let mut m = Machine::new(BackoffPolicy::default(), 7);
//! let _ = m.handle(Input::Added("w1"));
//! assert!(m.is_routable(&"w1"));
//! // A request is refused: the breaker opens and a backoff timer is armed.
//! let out = m.handle(Input::Failed { instance: "w1", class: FailureClass::ConnectionRefused }).to_vec();
//! assert_eq!(out[0], Action::Open { instance: "w1" });
//! let Action::ArmTimer { timer, .. } = out[1] else { unreachable!() };
//! assert!(!m.is_routable(&"w1"));
//! // The timer fires: probe the instance.
//! let out = m.handle(Input::TimerFired { instance: "w1", timer }).to_vec();
//! let Action::StartProbe { probe, .. } = out[0] else { unreachable!() };
//! // The probe connects: the breaker closes.
//! let out = m.handle(Input::ProbeResult { instance: "w1", probe, ok: true }).to_vec();
//! assert_eq!(out, vec![Action::Close { instance: "w1" }]);
//! assert!(m.is_routable(&"w1"));
//! ```
//!
//! # Contract for the driver (the caller MUST)
//!
//! - feed every discovery change as [`Input::Added`] / [`Input::Removed`]: the machine routes
//!   only instances it was told are in discovery;
//! - feed [`Input::Failed`] for every failed request with its [`FailureClass`];
//! - carry out every action of a batch, in order;
//! - feed [`Input::TimerFired`] when a timer armed by [`Action::ArmTimer`] fires, unless it was
//!   cancelled by [`Action::CancelTimer`] (a late firing is ignored);
//! - report each started probe exactly once as [`Input::ProbeResult`] (a probe timeout is a
//!   failed probe); the result of a probe whose instance was removed is ignored.
//!
//! Why ids: timers and probes carry fresh, never-reused ids (one counter for both), so a late
//! firing or a late result of an earlier round, or of an instance removed and re-added, is
//! recognised as stale by value and cannot close or reopen the current breaker.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::batch::{Batch, IntoIter};
use crate::lifecycle::RetryPolicy;

/// Why a request to an instance failed, as far as the instance's health is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailureClass {
    /// The connection was refused: nothing listens at the instance's address.
    ConnectionRefused,
    /// The connection was reset or closed under an open request.
    ConnectionReset,
    /// The stream stopped without an end: the worker or the link died mid-request.
    StreamDead,
    /// The worker rejected the request as malformed or too large: the client's fault.
    Rejected,
    /// The deadline the client set passed.
    Deadline,
    /// The worker is busy (queue full, overload): alive, just loaded.
    Overloaded,
}

impl FailureClass {
    /// Every class, for tests and exhaustive drivers.
    pub const ALL: [FailureClass; 6] = [
        FailureClass::ConnectionRefused,
        FailureClass::ConnectionReset,
        FailureClass::StreamDead,
        FailureClass::Rejected,
        FailureClass::Deadline,
        FailureClass::Overloaded,
    ];

    /// Whether this failure says the instance is dead: connection refused or reset and a dead
    /// stream do; a rejected request, a client deadline and overload do not, because counting
    /// them would let a poisoned request or a load spike open every breaker and empty the pool.
    pub fn counts_against_health(self) -> bool {
        matches!(
            self,
            FailureClass::ConnectionRefused
                | FailureClass::ConnectionReset
                | FailureClass::StreamDead
        )
    }
}

impl FailureClass {
    /// Whether a request that failed this way, before the worker produced any output, may be
    /// tried again on a different worker: yes when the worker or the link is gone, or the
    /// worker is busy (another may not be); no when the request is at fault (a malformed or
    /// too large request fails everywhere) or its deadline passed (a retry could only end
    /// later than the caller allowed).
    pub fn retry_elsewhere(self) -> bool {
        matches!(
            self,
            FailureClass::ConnectionRefused
                | FailureClass::ConnectionReset
                | FailureClass::StreamDead
                | FailureClass::Overloaded
        )
    }

    /// Whether a request that failed this way provably never reached the worker: the
    /// connection was refused (or its TLS handshake failed), so nothing was sent. Every other
    /// class may have reached it, which is what matters for a single-use handle
    /// ([`crate::handoff`]): only an unsent attempt gives the handle back for another worker.
    pub fn request_unsent(self) -> bool {
        self == FailureClass::ConnectionRefused
    }

    /// A short, stable, lower-case label (metrics and logs).
    pub fn as_str(self) -> &'static str {
        match self {
            FailureClass::ConnectionRefused => "connection_refused",
            FailureClass::ConnectionReset => "connection_reset",
            FailureClass::StreamDead => "stream_dead",
            FailureClass::Rejected => "rejected",
            FailureClass::Deadline => "deadline",
            FailureClass::Overloaded => "overloaded",
        }
    }
}

impl fmt::Display for FailureClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FailureClass::ConnectionRefused => "connection refused",
            FailureClass::ConnectionReset => "connection reset",
            FailureClass::StreamDead => "dead stream",
            FailureClass::Rejected => "rejected request",
            FailureClass::Deadline => "client deadline",
            FailureClass::Overloaded => "overloaded",
        })
    }
}

/// Identity of one armed backoff timer. Fresh per arm, never reused (shared counter with
/// [`ProbeId`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TimerId(pub u64);

/// Identity of one started probe. Fresh per probe, never reused (shared counter with
/// [`TimerId`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProbeId(pub u64);

impl fmt::Display for TimerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "timer #{}", self.0)
    }
}

impl fmt::Display for ProbeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "probe #{}", self.0)
    }
}

/// Delay before probing an open instance: exponential in the consecutive failures, capped,
/// with "equal jitter" (a delay drawn in `[base / 2, base]`), so the jitter spreads probes of
/// instances that failed together but can only shorten the capped delay, never lengthen it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackoffPolicy {
    /// Base delay after the first failure.
    pub initial: Duration,
    /// Upper bound on every delay, jitter included.
    pub max: Duration,
}

impl Default for BackoffPolicy {
    /// 250 ms, doubling, up to 10 s.
    fn default() -> Self {
        BackoffPolicy {
            initial: Duration::from_millis(250),
            max: Duration::from_secs(10),
        }
    }
}

impl BackoffPolicy {
    /// The base delay for consecutive failure number `attempt` (1-based):
    /// `min(initial * 2^(attempt-1), max)`.
    pub fn base(&self, attempt: u32) -> Duration {
        // The lifecycle's rebuild backoff is the same capped doubling; only the jitter differs.
        RetryPolicy {
            initial: self.initial,
            max: self.max,
        }
        .delay(attempt)
    }

    /// The jittered delay for failure number `attempt`: `base - base * (jitter mod 2^32) / 2^33`,
    /// so in `[base / 2, base]` and never above [`BackoffPolicy::max`].
    pub fn delay(&self, attempt: u32, jitter: u64) -> Duration {
        let base = self.base(attempt).as_nanos();
        let off = (base * u128::from(jitter & 0xffff_ffff)) >> 33;
        nanos_to_duration(base - off)
    }
}

/// `nanos` is at most a `Duration`'s nanoseconds, so it converts back without loss.
fn nanos_to_duration(nanos: u128) -> Duration {
    Duration::new(
        (nanos / 1_000_000_000) as u64,
        (nanos % 1_000_000_000) as u32,
    )
}

/// One SplitMix64 step: a fixed bijection spreading a seed and an id into a jitter value
/// (deterministic, so a driver replaying the same inputs sees the same delays).
fn mix(z: u64) -> u64 {
    crate::rng::finalize(z.wrapping_add(crate::rng::GAMMA))
}

/// A fact about the world, fed to [`Machine::handle`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Input<I> {
    /// Discovery lists the instance (new, or back after a removal): it starts healthy.
    Added(I),
    /// Discovery no longer lists the instance: forget it.
    Removed(I),
    /// A request to the instance failed this way.
    Failed {
        /// The instance the request went to.
        instance: I,
        /// Why it failed.
        class: FailureClass,
    },
    /// The timer armed by [`Action::ArmTimer`] fired.
    TimerFired {
        /// The instance it was armed for.
        instance: I,
        /// Its id.
        timer: TimerId,
    },
    /// The probe started by [`Action::StartProbe`] finished (a timeout is `ok: false`).
    ProbeResult {
        /// The probed instance.
        instance: I,
        /// Its id.
        probe: ProbeId,
        /// Whether the instance answered.
        ok: bool,
    },
}

/// An order to the world, returned by [`Machine::handle`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action<I> {
    /// The instance's breaker opened: stop routing to it (and log it).
    Open {
        /// The instance.
        instance: I,
    },
    /// The instance's breaker closed: it is routable again (and log it).
    Close {
        /// The instance.
        instance: I,
    },
    /// Arm a timer; when it fires, feed [`Input::TimerFired`] with this id.
    ArmTimer {
        /// The instance it is for.
        instance: I,
        /// The id the firing must carry.
        timer: TimerId,
        /// How long to wait; never above [`BackoffPolicy::max`].
        delay: Duration,
        /// Consecutive failures so far (1-based): the breaker's opening plus failed probes.
        attempt: u32,
    },
    /// Disarm the timer.
    CancelTimer {
        /// The instance it was armed for.
        instance: I,
        /// Its id.
        timer: TimerId,
    },
    /// Probe the instance (connect, or a cheap ping); report with [`Input::ProbeResult`].
    StartProbe {
        /// The instance to probe.
        instance: I,
        /// The id the result must carry.
        probe: ProbeId,
    },
}

impl<I: fmt::Debug> fmt::Display for Action<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Open { instance } => write!(f, "open breaker of {instance:?}"),
            Action::Close { instance } => write!(f, "close breaker of {instance:?}"),
            Action::ArmTimer {
                instance,
                timer,
                delay,
                attempt,
            } => write!(
                f,
                "arm {timer} for {instance:?} in {delay:?} (attempt {attempt})"
            ),
            Action::CancelTimer { instance, timer } => {
                write!(f, "cancel {timer} for {instance:?}")
            }
            Action::StartProbe { instance, probe } => write!(f, "start {probe} of {instance:?}"),
        }
    }
}

/// The actions produced by one input, in the order the driver must carry them out. At most two
/// (an open and its timer), so the shared inline batch fits.
pub type Actions<I> = Batch<Action<I>>;

/// Owning iterator over an [`Actions`] batch.
pub type ActionsIntoIter<I> = IntoIter<Action<I>>;

/// One instance's breaker, as the accessors report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Breaker {
    /// Routable.
    Closed,
    /// Not routable; waiting for the backoff timer.
    Open {
        /// Consecutive failures (the opening plus failed probes).
        failures: u32,
        /// The armed timer.
        timer: TimerId,
    },
    /// Not routable; a probe is under way (half-open).
    Probing {
        /// Consecutive failures so far.
        failures: u32,
        /// The probe in flight.
        probe: ProbeId,
    },
}

impl fmt::Display for Breaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Breaker::Closed => "healthy",
            Breaker::Open { .. } => "open",
            Breaker::Probing { .. } => "probing",
        })
    }
}

/// The worker-health machine over instance ids `I`. See the [module docs](self) for the driving
/// contract.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Machine<I> {
    policy: BackoffPolicy,
    seed: u64,
    /// Exactly the instances in discovery; nothing else is kept (bounded memory).
    instances: BTreeMap<I, Breaker>,
    /// Breakers not closed, kept so the metric is O(1).
    open: usize,
    next_id: u64,
}

impl<I: Ord + Clone> Machine<I> {
    /// A machine tracking no instance; `seed` fixes the jitter of every delay.
    pub fn new(policy: BackoffPolicy, seed: u64) -> Self {
        Machine {
            policy,
            seed,
            instances: BTreeMap::new(),
            open: 0,
            next_id: 1,
        }
    }

    /// Apply one input; returns the actions the driver must carry out, in order.
    pub fn handle(&mut self, input: Input<I>) -> Actions<I> {
        let mut out = Actions::default();
        match input {
            Input::Added(instance) => {
                // A repeated Added (a lease refresh, a re-listed record) keeps the breaker: only
                // a removal forgets what the machine learned about the instance.
                self.instances.entry(instance).or_insert(Breaker::Closed);
            }
            Input::Removed(instance) => match self.instances.remove(&instance) {
                Some(Breaker::Closed) | None => {}
                Some(Breaker::Open { timer, .. }) => {
                    self.open -= 1;
                    out.push(Action::CancelTimer { instance, timer });
                }
                // The probe's result will find no instance (or a newer probe id) and be ignored.
                Some(Breaker::Probing { .. }) => self.open -= 1,
            },
            Input::Failed { instance, class } => {
                // Only a closed breaker opens: failures of requests routed before the opening
                // say nothing new and must not lengthen the backoff.
                if class.counts_against_health()
                    && self.instances.get(&instance) == Some(&Breaker::Closed)
                {
                    self.open += 1;
                    out.push(Action::Open {
                        instance: instance.clone(),
                    });
                    self.arm(instance, 1, &mut out);
                }
            }
            Input::TimerFired { instance, timer } => {
                if let Some(breaker) = self.instances.get_mut(&instance) {
                    if let Breaker::Open { failures, timer: t } = *breaker {
                        if t == timer {
                            let probe = ProbeId(self.next_id);
                            self.next_id += 1;
                            *breaker = Breaker::Probing { failures, probe };
                            out.push(Action::StartProbe { instance, probe });
                        }
                    }
                }
            }
            Input::ProbeResult {
                instance,
                probe,
                ok,
            } => {
                if let Some(&Breaker::Probing { failures, probe: p }) =
                    self.instances.get(&instance)
                {
                    if p == probe {
                        if ok {
                            self.instances.insert(instance.clone(), Breaker::Closed);
                            self.open -= 1;
                            out.push(Action::Close { instance });
                        } else {
                            self.arm(instance, failures.saturating_add(1), &mut out);
                        }
                    }
                }
            }
        }
        out
    }

    /// Open (or keep open) `instance` with a fresh timer for failure number `failures`.
    fn arm(&mut self, instance: I, failures: u32, out: &mut Actions<I>) {
        let timer = TimerId(self.next_id);
        self.next_id += 1;
        let delay = self.policy.delay(failures, mix(self.seed ^ timer.0));
        self.instances
            .insert(instance.clone(), Breaker::Open { failures, timer });
        out.push(Action::ArmTimer {
            instance,
            timer,
            delay,
            attempt: failures,
        });
    }

    /// Whether the request path may route to `instance`: it is in discovery and its breaker is
    /// closed. O(log n).
    pub fn is_routable(&self, instance: &I) -> bool {
        self.instances.get(instance) == Some(&Breaker::Closed)
    }

    /// The instance's breaker; `None` when it is not in discovery.
    pub fn breaker(&self, instance: &I) -> Option<Breaker> {
        self.instances.get(instance).copied()
    }

    /// Every tracked instance (exactly those in discovery) with its breaker, in id order.
    pub fn instances(&self) -> impl Iterator<Item = (&I, Breaker)> + '_ {
        self.instances.iter().map(|(i, b)| (i, *b))
    }

    /// Number of tracked instances.
    pub fn len(&self) -> usize {
        self.instances.len()
    }

    /// Whether no instance is tracked.
    pub fn is_empty(&self) -> bool {
        self.instances.is_empty()
    }

    /// Number of breakers not closed (open or probing). O(1).
    pub fn open_count(&self) -> usize {
        self.open
    }

    /// The backoff policy.
    pub fn policy(&self) -> BackoffPolicy {
        self.policy
    }

    /// The id the next timer or probe will carry.
    pub fn next_id(&self) -> u64 {
        self.next_id
    }
}

#[cfg(test)]
mod tests;
