//! A stateright model of the **booking rule** (issue 29, item 5): several frontends admit
//! prefill work on shared workers by `own bookings + others (the newest load report) + work <=
//! busy threshold`, while each worker's real [`LoadLedger`] reports to each connection the work
//! of every other connection, over channels that deliver late, lose and reorder.
//!
//! The code under check is the real `prefill_router::load_report` ([`LoadLedger`] on the worker,
//! [`ReportedLoad`] on the frontend); the world around it is the model's:
//!
//! - **Actors**: one frontend per entry of `requests`, `workers` workers. Frontend `f` has one connection per
//!   worker, whose id at the worker is `f`; it keeps its own bookings per worker (the push load
//!   board) and one [`ReportedLoad`] per worker.
//! - **Actions**: a frontend admits a request of 1..=`max_work` tokens on a worker when the rule
//!   allows (and books it); the request arrives at the worker later (`start`), or is cancelled
//!   or fails first (the frontend releases it; it may still arrive, or vanish); the worker ends
//!   it (`finish`) and the frontend releases it when it sees the end; a request cancelled at the
//!   frontend is ended at the worker when the cancellation arrives; a connection closes (the
//!   worker `close`s it, the frontend drops its requests, bookings and report, and a fresh
//!   connection opens); the worker makes a report (`report_for`, or `refresh_for`, the periodic
//!   re-send) into the connection's channel; the channel delivers any report (reordering) or
//!   loses it; the frontend applies what is delivered.
//! - **Bounds** ([`BookingConfig`]): `requests` per frontend (each slot used once), `reports`
//!   made per connection (seq ≤ `reports`; a close starts a new connection at seq 0), at most
//!   `channel` reports in flight per connection, `closes` connection closes in all. Every
//!   action spends a budget or moves a request forward, so the state space is finite.
//!
//! The properties (ids BL1, BL2, DC1, S1, S2, vacuity witnesses BV1..BV7) are in
//! [`properties`] and docs/properties.md ("Booking rule", with the checked configurations,
//! their state counts and run times); the deliberately broken drivers that each break one are
//! in [`mutants`].
//! The stated slack: each frontend books at most the threshold on a worker, so booked work
//! (sent or held, not released) on a worker is at most `frontends × threshold` (S1); with an
//! exact view an admission never takes the true load past the threshold (S2); work a frontend
//! has cancelled but the worker still holds comes on top of both, since the frontend no longer
//! books it and its own connection's report leaves it out (BV6 shows it exceeds
//! `frontends × threshold`).

pub mod mutants;
pub mod properties;
pub mod step;
pub mod world;

pub use self::step::BookingStep;

use std::fmt;
use std::marker::PhantomData;

use prefill_router::load_report::{Applied, Load, LoadLedger, LoadReport, ReportedLoad};
use stateright::{Model, Property};

use self::world::{fault, ledger, Link, Request, Stage, State, Wire};

/// The driver of the booking rule under check: the real code, or a mutant that wraps it and
/// alters its inputs or outputs (`src/load_report.rs` carries no hooks). Every method defaults
/// to the real behaviour.
pub trait Booking: Send + Sync + 'static {
    /// A short name, used in reports.
    const NAME: &'static str;

    /// Whether the worker's driver tells the ledger that a cancelled request ended.
    const FINISH_ON_CANCEL: bool = true;

    /// Whether the frontend forgets its own bookings on a worker when it applies a newer report.
    const DROP_OWN_ON_REPORT: bool = false;

    /// Whether the frontend starts a fresh [`ReportedLoad`] for a new connection (a new
    /// connection's reports start again at seq 1).
    const FRESH_VIEW_ON_RECONNECT: bool = true;

    /// What the worker puts on the wire for `report`, made by the real ledger for a connection
    /// that holds `own` work itself.
    fn send(report: LoadReport, own: Load) -> LoadReport {
        let _ = own;
        report
    }

    /// The frontend applying a delivered report.
    fn apply(seen: &mut ReportedLoad, report: LoadReport) -> Applied {
        seen.apply(report)
    }
}

/// The real booking rule: `LoadLedger` and `ReportedLoad` as they are.
#[derive(Clone, Copy, Debug)]
pub struct RealBooking;

impl Booking for RealBooking {
    const NAME: &'static str = "real";
}

/// The bounds of one configuration (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BookingConfig {
    /// Workers (1..=2).
    pub workers: u8,
    /// Requests each frontend may admit over the run, one entry per frontend (2..=3 entries in
    /// the checked configurations): the number of frontends is its length.
    pub requests: &'static [u8],
    /// A request's work is 1..=`max_work` tokens.
    pub max_work: u8,
    /// The busy threshold in tokens.
    pub threshold: u8,
    /// Reports a worker may make per connection (the largest seq).
    pub reports: u8,
    /// Reports in flight per connection at most.
    pub channel: u8,
    /// Connection closes in the whole run.
    pub closes: u8,
}

impl BookingConfig {
    /// The number of frontends.
    pub fn frontends(&self) -> u8 {
        u8::try_from(self.requests.len()).unwrap_or(u8::MAX)
    }

    /// The standard configuration: 2 frontends on 1 worker with 2 and 1 requests of 1 token, a
    /// threshold of 1, 2 reports per connection, 2 in flight (so reports reorder), 1 close.
    pub const STANDARD: BookingConfig = BookingConfig {
        workers: 1,
        requests: &[2, 1],
        max_work: 1,
        threshold: 1,
        reports: 2,
        channel: 2,
        closes: 1,
    };

    /// Work sizes: 2 frontends on 1 worker, 1 request each of 1 or 2 tokens, a threshold of 2,
    /// 2 reports per connection, 2 in flight, no close.
    pub const WORK_SIZES: BookingConfig = BookingConfig {
        workers: 1,
        requests: &[1, 1],
        max_work: 2,
        threshold: 2,
        reports: 2,
        channel: 2,
        closes: 0,
    };

    /// Three frontends on one worker, one request of 1 token each, a threshold of 1, one report
    /// per connection (so none is stale), no close.
    pub const THREE_FRONTENDS: BookingConfig = BookingConfig {
        workers: 1,
        requests: &[1, 1, 1],
        max_work: 1,
        threshold: 1,
        reports: 1,
        channel: 1,
        closes: 0,
    };

    /// Two frontends on two workers, one request of 1 token each, a threshold of 1, one report
    /// per connection, no close.
    pub const TWO_WORKERS: BookingConfig = BookingConfig {
        workers: 2,
        requests: &[1, 1],
        max_work: 1,
        threshold: 1,
        reports: 1,
        channel: 1,
        closes: 0,
    };
}

/// The model, generic over the booking driver under check.
pub struct BookingModel<B> {
    /// The bounds.
    pub config: BookingConfig,
    _booking: PhantomData<fn() -> B>,
}

impl<B> Clone for BookingModel<B> {
    fn clone(&self) -> Self {
        BookingModel::new(self.config)
    }
}

impl<B> fmt::Debug for BookingModel<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BookingModel")
            .field("config", &self.config)
            .finish()
    }
}

impl<B> BookingModel<B> {
    /// A model with the given bounds.
    pub fn new(config: BookingConfig) -> Self {
        BookingModel {
            config,
            _booking: PhantomData,
        }
    }
}

/// Whether the frontend of `link` may admit `work` tokens on its worker: the rule under check,
/// computed by the real [`ReportedLoad::combined`].
pub fn admits(link: &Link, work: u8, threshold: u8) -> bool {
    let load = link.reported_load().combined(link.own);
    load.tokens + u64::from(work) <= u64::from(threshold)
}

fn book(own: &mut Load, work: u8) {
    own.tokens += u64::from(work);
    own.requests += 1;
}

fn release(own: &mut Load, work: u8) {
    // Saturating like the push board: a mutant that forgot bookings must not wrap.
    own.tokens = own.tokens.saturating_sub(u64::from(work));
    own.requests = own.requests.saturating_sub(1);
}

/// Asserts that the ledger the step drove answers as the one rebuilt from the recorded inputs
/// (same total, same change report and re-sent report for every connection): the real
/// `finish` and `close` did what their documentation says, and the rebuild is exact.
fn agree(mut driven: LoadLedger, links: &[Link]) {
    let mut rebuilt = ledger(links);
    assert_eq!(driven.total(), rebuilt.total(), "ledger totals disagree");
    for c in 0..links.len() as u64 {
        // `report_for` first: it compares with the last report made (the change rule).
        assert_eq!(
            driven.report_for(c),
            rebuilt.report_for(c),
            "ledger change reports for connection {c} disagree"
        );
        assert_eq!(
            driven.refresh_for(c),
            rebuilt.refresh_for(c),
            "ledger reports for connection {c} disagree"
        );
    }
}

impl<B: Booking> BookingModel<B> {
    /// Applies one step; `None` when it changes nothing (a `report_for` with nothing new).
    pub fn apply(&self, s: &State, step: BookingStep) -> Option<State> {
        let mut n = s.clone();
        match step {
            BookingStep::Admit {
                frontend,
                worker,
                work,
            } => {
                let i = s
                    .requests
                    .iter()
                    .position(|r| r.frontend == frontend && r.stage == Stage::Idle)?;
                let link = &s.links[usize::from(worker)][usize::from(frontend)];
                if !admits(link, work, self.config.threshold) {
                    return None;
                }
                let exact = link.reported_load().others() == s.truth(worker, frontend)
                    && s.requests.iter().all(|r| {
                        r.worker != worker
                            || if r.frontend == frontend {
                                !matches!(r.stage, Stage::Orphan | Stage::Cancelled)
                            } else {
                                !matches!(r.stage, Stage::Sent | Stage::Orphan)
                            }
                    });
                n.requests[i] = Request {
                    frontend,
                    id: s.requests[i].id,
                    worker,
                    work,
                    stage: Stage::Sent,
                };
                book(
                    &mut n.links[usize::from(worker)][usize::from(frontend)].own,
                    work,
                );
                let load = n.work(worker, None, Stage::at_worker).tokens;
                if exact && load > u64::from(self.config.threshold) {
                    n.faults |= fault::FRESH_OVERSHOOT;
                }
            }
            BookingStep::Arrive(i) => {
                let r = s.requests[usize::from(i)];
                let next = match r.stage {
                    Stage::Sent => Stage::Running,
                    Stage::Orphan => Stage::Cancelled,
                    _ => return None,
                };
                let links = &mut n.links[usize::from(r.worker)];
                let mut driven = ledger(links);
                world::start(
                    &mut driven,
                    u64::from(r.frontend),
                    u64::from(r.id),
                    u64::from(r.work),
                );
                let held = &mut links[usize::from(r.frontend)].conn.held;
                held.push((r.id, r.work));
                held.sort_unstable();
                agree(driven, links);
                n.requests[usize::from(i)].stage = next;
            }
            BookingStep::Cancel(i) => {
                let r = s.requests[usize::from(i)];
                let next = match r.stage {
                    Stage::Sent => Stage::Orphan,
                    Stage::Running => Stage::Cancelled,
                    _ => return None,
                };
                release(
                    &mut n.links[usize::from(r.worker)][usize::from(r.frontend)].own,
                    r.work,
                );
                n.requests[usize::from(i)].stage = next;
            }
            BookingStep::Vanish(i) => {
                if s.requests[usize::from(i)].stage != Stage::Orphan {
                    return None;
                }
                n.requests[usize::from(i)].stage = Stage::Done;
            }
            BookingStep::WorkerEnds(i) => {
                let r = s.requests[usize::from(i)];
                let (next, tell) = match r.stage {
                    Stage::Running => (Stage::Finished, true),
                    Stage::Cancelled => (Stage::Done, B::FINISH_ON_CANCEL),
                    _ => return None,
                };
                if tell {
                    let links = &mut n.links[usize::from(r.worker)];
                    let mut driven = ledger(links);
                    driven.finish(u64::from(r.frontend), u64::from(r.id));
                    links[usize::from(r.frontend)]
                        .conn
                        .held
                        .retain(|&(id, _)| id != r.id);
                    agree(driven, links);
                }
                n.requests[usize::from(i)].stage = next;
            }
            BookingStep::SeeEnd(i) => {
                let r = s.requests[usize::from(i)];
                if r.stage != Stage::Finished {
                    return None;
                }
                release(
                    &mut n.links[usize::from(r.worker)][usize::from(r.frontend)].own,
                    r.work,
                );
                n.requests[usize::from(i)].stage = Stage::Done;
            }
            BookingStep::Report {
                worker,
                frontend,
                refresh,
            } => {
                let links = &s.links[usize::from(worker)];
                let mut driven = ledger(links);
                let conn = u64::from(frontend);
                let report = if refresh {
                    driven.refresh_for(conn)
                } else {
                    driven.report_for(conn)
                }?;
                let total = driven.total();
                let own = Load {
                    tokens: total.tokens - report.others.tokens,
                    requests: total.requests - report.others.requests,
                };
                let link = &mut n.links[usize::from(worker)][usize::from(frontend)];
                link.conn.seq = u8::try_from(report.seq).expect("seq is bounded by the config");
                link.conn.reported = Some(report.others);
                let sent = B::send(report, own);
                if sent.others != s.truth(worker, frontend) {
                    n.faults |= fault::WRONG_OTHERS;
                }
                link.channel.push(Wire { report: sent });
                link.channel.sort_unstable();
                link.last_delivered = false;
            }
            BookingStep::Deliver {
                worker,
                frontend,
                index,
            } => {
                let link = &mut n.links[usize::from(worker)][usize::from(frontend)];
                let wire = link.channel.remove(usize::from(index));
                let mut view = link.reported_load();
                if B::apply(&mut view, wire.report) == Applied::Newer {
                    link.applied = Some(wire.report);
                    if B::DROP_OWN_ON_REPORT {
                        link.own = Load::ZERO;
                    }
                }
                if wire.report.seq == u64::from(link.conn.seq) {
                    link.last_delivered = true;
                }
            }
            BookingStep::Lose {
                worker,
                frontend,
                index,
            } => {
                n.links[usize::from(worker)][usize::from(frontend)]
                    .channel
                    .remove(usize::from(index));
            }
            BookingStep::Close { worker, frontend } => {
                let links = &mut n.links[usize::from(worker)];
                let mut driven = ledger(links);
                driven.close(u64::from(frontend));
                driven.open(u64::from(frontend));
                // Both ends drop the connection: the worker its work, the frontend its
                // requests on it, its bookings, its report and the reports in flight.
                let kept = links[usize::from(frontend)].applied;
                links[usize::from(frontend)] = Link::default();
                if !B::FRESH_VIEW_ON_RECONNECT {
                    links[usize::from(frontend)].applied = kept;
                }
                agree(driven, links);
                for r in &mut n.requests {
                    if r.frontend == frontend && r.worker == worker && r.stage.in_flight() {
                        r.stage = Stage::Done;
                    }
                }
                n.closes_left -= 1;
            }
        }
        Some(n)
    }
}

impl<B: Booking> Model for BookingModel<B> {
    type State = State;
    type Action = BookingStep;

    fn init_states(&self) -> Vec<State> {
        let c = self.config;
        let requests = (0..c.frontends())
            .zip(c.requests)
            .flat_map(|(frontend, &budget)| {
                (0..budget).map(move |id| Request {
                    frontend,
                    id,
                    worker: 0,
                    work: 0,
                    stage: Stage::Idle,
                })
            })
            .collect();
        vec![State {
            requests,
            links: vec![vec![Link::default(); usize::from(c.frontends())]; usize::from(c.workers)],
            closes_left: c.closes,
            faults: 0,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<BookingStep>) {
        // Deterministic order: stateright stores paths as action indices.
        let c = self.config;
        for frontend in 0..c.frontends() {
            // A frontend's idle slots are interchangeable: only the first is admitted.
            if !s
                .requests
                .iter()
                .any(|r| r.frontend == frontend && r.stage == Stage::Idle)
            {
                continue;
            }
            for worker in 0..c.workers {
                let link = &s.links[usize::from(worker)][usize::from(frontend)];
                for work in 1..=c.max_work {
                    if admits(link, work, c.threshold) {
                        out.push(BookingStep::Admit {
                            frontend,
                            worker,
                            work,
                        });
                    }
                }
            }
        }
        for (i, r) in s.requests.iter().enumerate() {
            let i = i as u8;
            match r.stage {
                Stage::Sent => out.extend([BookingStep::Arrive(i), BookingStep::Cancel(i)]),
                Stage::Running => out.extend([BookingStep::WorkerEnds(i), BookingStep::Cancel(i)]),
                Stage::Orphan => out.extend([BookingStep::Arrive(i), BookingStep::Vanish(i)]),
                Stage::Cancelled => out.push(BookingStep::WorkerEnds(i)),
                Stage::Finished => out.push(BookingStep::SeeEnd(i)),
                Stage::Idle | Stage::Done => {}
            }
        }
        for worker in 0..c.workers {
            for frontend in 0..c.frontends() {
                let link = &s.links[usize::from(worker)][usize::from(frontend)];
                if link.conn.seq < c.reports && link.channel.len() < usize::from(c.channel) {
                    for refresh in [false, true] {
                        out.push(BookingStep::Report {
                            worker,
                            frontend,
                            refresh,
                        });
                    }
                }
                for (index, wire) in link.channel.iter().enumerate() {
                    // Equal reports in flight are interchangeable: step only the first.
                    if index > 0 && link.channel[index - 1] == *wire {
                        continue;
                    }
                    let index = index as u8;
                    out.push(BookingStep::Deliver {
                        worker,
                        frontend,
                        index,
                    });
                    out.push(BookingStep::Lose {
                        worker,
                        frontend,
                        index,
                    });
                }
                if s.closes_left > 0 {
                    out.push(BookingStep::Close { worker, frontend });
                }
            }
        }
    }

    fn next_state(&self, s: &State, step: BookingStep) -> Option<State> {
        self.apply(s, step)
    }

    fn format_action(&self, step: &BookingStep) -> String {
        step.to_string()
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties::all::<B>()
    }
}
