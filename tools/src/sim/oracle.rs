//! What the simulator checks, and how a broken check is reported.

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use prefill_router::binding::WorkerSetTargetId;
use prefill_router::discovery::InstanceId;
use prefill_router::lifecycle::Lifecycle;

/// One property the run broke, with enough context to start debugging from the seed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Violation {
    /// A request was dispatched to a worker outside the admission set of the binding it
    /// prefilled on.
    DispatchOutsideAdmission {
        /// The request.
        request: u64,
        /// The worker it went to.
        worker: InstanceId,
        /// The binding's target.
        target: WorkerSetTargetId,
        /// The admission set at the moment of dispatch.
        admitted: BTreeSet<InstanceId>,
    },
    /// A request prefilled on a binding whose target the controller had already replaced (or
    /// cleared) before the request loaded the route.
    DispatchOnReplacedTarget {
        /// The request.
        request: u64,
        /// The binding's target.
        binding: WorkerSetTargetId,
        /// What the controller had set last.
        desired: Option<WorkerSetTargetId>,
    },
    /// A request prefilled on a binding whose build had been abandoned (cancelled, superseded
    /// or timed out): a stale build was published.
    DispatchOnAbandonedBuild {
        /// The request.
        request: u64,
        /// The binding's target.
        binding: WorkerSetTargetId,
    },
    /// A request neither answered, failed nor fell back before its deadline.
    RequestHung {
        /// The request.
        request: u64,
        /// Its deadline, from its start.
        deadline: Duration,
    },
    /// A worker reachable again (up, registered, its blip over) for longer than the probe cap
    /// was still unroutable in a live binding's view: its breaker never closed.
    RecoveredWorkerUnroutable {
        /// The worker.
        worker: InstanceId,
        /// The binding whose view keeps it out.
        binding: u64,
        /// Simulated milliseconds since the start.
        at_ms: u64,
    },
    /// A prefill failed on connection failures having tried fewer distinct workers than its
    /// retry budget allows, while an admitted worker it had not tried was reachable and
    /// routable.
    FailedWithHealthyWorker {
        /// The request.
        request: u64,
        /// The workers it tried, in order.
        tried: Vec<InstanceId>,
        /// A healthy admitted worker it could have used.
        healthy: InstanceId,
    },
    /// A request's task panicked.
    RequestPanicked {
        /// The request.
        request: u64,
    },
    /// A binding that is neither the router's current one nor held by any request is still
    /// alive: a retired binding was not released after its last request ended.
    BindingNotReleased {
        /// The binding's serial number in this run.
        binding: u64,
        /// Its target.
        target: WorkerSetTargetId,
        /// Simulated milliseconds since the start.
        at_ms: u64,
    },
    /// `set_target` returned but the router's status or route did not show the decision.
    SetTargetNotVisible {
        /// What was set.
        set: Option<WorkerSetTargetId>,
        /// What the router reported as desired right after.
        reported: Option<WorkerSetTargetId>,
    },
    /// After the faults stopped, the router did not reach the topology's target in time.
    NotConverged {
        /// The topology's target.
        expected: Option<WorkerSetTargetId>,
        /// The router's lifecycle at the deadline.
        lifecycle: Lifecycle,
        /// The router's held target at the deadline.
        held: Option<WorkerSetTargetId>,
    },
    /// After convergence, with faults off and admitted workers alive, a request did not
    /// prefill and complete.
    HealthyRequestFailed {
        /// What happened instead.
        outcome: String,
    },
    /// With no request in flight, the router still counted retired bindings as alive (its
    /// `retired_alive` metric disagrees with the bindings' actual lifetimes).
    RetiredAliveMiscounted {
        /// What the router reported.
        reported: usize,
    },
    /// A request counter of the router disagrees with what the requests saw.
    CountersDisagree {
        /// The router's counter (`RouterCounters` field).
        counter: &'static str,
        /// Its value.
        reported: u64,
        /// What the simulated requests observed.
        observed: u64,
    },
    /// Tasks of the router were still running after shutdown.
    TasksLeftAfterShutdown {
        /// How many.
        alive: usize,
    },
    /// A KV pick credited a worker, from its events, with more leading blocks than its cache
    /// held, with no batch of that worker lost or late (see `sim/kv_events.rs`).
    KvStaleCredit {
        /// The request.
        request: u64,
        /// The picked worker.
        worker: InstanceId,
        /// Leading blocks the pick credited.
        credited: usize,
        /// Leading blocks the worker's cache held.
        held: usize,
    },
    /// A frontend's view of a worker counted work that is not the other connections' (see
    /// `sim/frontends.rs`): its reported others differ from what the other connections held
    /// at the worker when the newest report it received was made, e.g. its own work counted
    /// a second time.
    LoadDoubleCounted {
        /// The frontend's connection.
        frontend: u64,
        /// The worker.
        worker: InstanceId,
        /// The others' load the frontend counts (tokens, requests).
        others: (u64, u64),
        /// What the other connections held when that report was made (tokens, requests).
        truth: (u64, u64),
        /// What the frontend's own connection held then (tokens, requests).
        own: (u64, u64),
    },
    /// Work outlived its requests in a worker's load ledger or a frontend's view of it (see
    /// `sim/frontends.rs`).
    LoadLeaked {
        /// Which check found it: `exact_view` (at a pick, throughout the run),
        /// `quiescent_ledger` or `quiescent_view` (at the end-of-run checkpoint).
        check: &'static str,
        /// The frontend's connection (`u64::MAX` for a worker's ledger).
        frontend: u64,
        /// The worker.
        worker: InstanceId,
        /// Where and what.
        detail: String,
    },
    /// A property of session affinity broke (see `sim/sessions.rs`).
    AffinityBroken {
        /// The request.
        request: u64,
        /// The property: its [`kind`](Violation::kind).
        property: &'static str,
        /// What happened.
        detail: String,
    },
    /// A property of conditional disaggregation broke (see `sim/conditional.rs`).
    ConditionalBroken {
        /// The request (`u64::MAX` for the end-of-run counter check).
        request: u64,
        /// The property: its [`kind`](Violation::kind).
        property: &'static str,
        /// What happened.
        detail: String,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::DispatchOutsideAdmission {
                request,
                worker,
                target,
                admitted,
            } => write!(
                f,
                "request {request} dispatched to worker {worker}, outside the admission set \
                 {admitted:?} of binding {target}"
            ),
            Violation::DispatchOnReplacedTarget {
                request,
                binding,
                desired,
            } => write!(
                f,
                "request {request} prefilled on binding {binding} after the target was set to \
                 {desired:?}"
            ),
            Violation::DispatchOnAbandonedBuild { request, binding } => write!(
                f,
                "request {request} prefilled on binding {binding} from an abandoned build"
            ),
            Violation::RequestHung { request, deadline } => {
                write!(
                    f,
                    "request {request} still running after its deadline {deadline:?}"
                )
            }
            Violation::RequestPanicked { request } => write!(f, "request {request} panicked"),
            Violation::RecoveredWorkerUnroutable {
                worker,
                binding,
                at_ms,
            } => write!(
                f,
                "worker {worker} reachable for longer than the probe cap is still unroutable in binding {binding} at {at_ms} ms"
            ),
            Violation::FailedWithHealthyWorker {
                request,
                tried,
                healthy,
            } => write!(
                f,
                "request {request} failed after trying {tried:?} while worker {healthy} was admitted, reachable and routable"
            ),
            Violation::BindingNotReleased {
                binding,
                target,
                at_ms,
            } => write!(
                f,
                "binding #{binding} for {target} alive at {at_ms} ms with no request on it and \
                 not the router's binding"
            ),
            Violation::SetTargetNotVisible { set, reported } => write!(
                f,
                "set_target({set:?}) returned but the router reports desired {reported:?}"
            ),
            Violation::NotConverged {
                expected,
                lifecycle,
                held,
            } => write!(
                f,
                "after faults stopped the router did not converge to {expected:?} \
                 (lifecycle {lifecycle}, held {held:?})"
            ),
            Violation::HealthyRequestFailed { outcome } => {
                write!(
                    f,
                    "a request after convergence did not prefill and complete: {outcome}"
                )
            }
            Violation::RetiredAliveMiscounted { reported } => write!(
                f,
                "no request in flight, yet the router reports {reported} retired bindings alive"
            ),
            Violation::CountersDisagree {
                counter,
                reported,
                observed,
            } => write!(
                f,
                "router counter {counter} = {reported}, but the requests observed {observed}"
            ),
            Violation::TasksLeftAfterShutdown { alive } => {
                write!(f, "{alive} router tasks still running after shutdown")
            }
            Violation::KvStaleCredit {
                request,
                worker,
                credited,
                held,
            } => write!(
                f,
                "request {request}: worker {worker} credited with {credited} leading blocks from its events, its cache held {held}, no batch of it lost or late"
            ),
            Violation::LoadDoubleCounted {
                frontend,
                worker,
                others,
                truth,
                own,
            } => write!(
                f,
                "frontend connection {frontend} counts others' load {others:?} (tokens, requests) on worker {worker}, but the other connections held {truth:?} when its newest report was made (its own {own:?})"
            ),
            Violation::LoadLeaked {
                check,
                frontend,
                worker,
                detail,
            } => write!(
                f,
                "{check}: worker {worker}, frontend connection {frontend}: {detail}"
            ),
            Violation::ConditionalBroken {
                request,
                property,
                detail,
            }
            | Violation::AffinityBroken {
                request,
                property,
                detail,
            } => write!(f, "{property}: request {request}: {detail}"),
        }
    }
}

impl Violation {
    /// A short stable name of the broken property (for tests and summaries).
    pub fn kind(&self) -> &'static str {
        match self {
            Violation::DispatchOutsideAdmission { .. } => "dispatch_outside_admission",
            Violation::DispatchOnReplacedTarget { .. } => "dispatch_on_replaced_target",
            Violation::DispatchOnAbandonedBuild { .. } => "dispatch_on_abandoned_build",
            Violation::RequestHung { .. } => "request_hung",
            Violation::RequestPanicked { .. } => "request_panicked",
            Violation::RecoveredWorkerUnroutable { .. } => "recovered_worker_unroutable",
            Violation::FailedWithHealthyWorker { .. } => "failed_with_healthy_worker",
            Violation::BindingNotReleased { .. } => "binding_not_released",
            Violation::SetTargetNotVisible { .. } => "set_target_not_visible",
            Violation::NotConverged { .. } => "not_converged",
            Violation::HealthyRequestFailed { .. } => "healthy_request_failed",
            Violation::RetiredAliveMiscounted { .. } => "retired_alive_miscounted",
            Violation::CountersDisagree { .. } => "counters_disagree",
            Violation::TasksLeftAfterShutdown { .. } => "tasks_left_after_shutdown",
            Violation::KvStaleCredit { .. } => "kv_stale_credit",
            Violation::LoadDoubleCounted { .. } => "load_double_counted",
            Violation::LoadLeaked { .. } => "load_leaked",
            Violation::ConditionalBroken { property, .. }
            | Violation::AffinityBroken { property, .. } => property,
        }
    }
}
