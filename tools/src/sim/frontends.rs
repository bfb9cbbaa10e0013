//! Several frontends sharing the simulated workers: load reports, some lost or late, and the
//! no-leak and no-double-count oracles.
//!
//! A run with [`SimConfig::frontends`](super::SimConfig::frontends) `n > 1` gives every binding
//! `n` real dispatchers, each with its own bookings: `n` frontends that route the same
//! target over the same workers and never talk to each other (each request goes through one of
//! them, drawn from its id). The dispatchers run in KV mode, the only one with a load board
//! that load reports feed. Every simulated worker keeps a real
//! [`LoadLedger`](prefill_router::load_report::LoadLedger) with one connection per dispatcher
//! (opened when the dispatcher is built, closed once it is gone): an attempt the worker takes
//! (every one but a refused connection) `start`s its prompt tokens, and `finish`es when it
//! ends however it ends (answered, rejected, crashed, timed out, cancelled: the attempt's
//! stream dropped). After every change the worker makes `report_for` each connection, and every
//! [`REFRESH_PERIOD`] a `refresh_for`; each report goes to its connection's dispatcher
//! (`Dispatcher::apply_load_report`), while faults are on lost with [`LOSS_PERCENT`] and
//! delayed by up to [`DELAY_MAX_MS`] with [`DELAY_PERCENT`] (arriving after newer ones); a
//! report of a worker that is down or blipped is lost. Beside the ledger the simulator keeps
//! the *ghost truth*: the attempts each connection holds at each worker, from its own records
//! of the attempts (not from the ledger).
//!
//! The oracles (each check records its first violation of a run only):
//!
//! - `load_double_counted`, whenever a report is delivered and at every pick, for the
//!   frontend's connection `c` and worker `w`: the others' load the frontend counts for `w`
//!   (`Dispatcher::reported_load`) equals, in tokens and requests, what the connections other
//!   than `c` held at `w` (ghost truth) when the newest report delivered on `c` was made (zero
//!   before any). So a frontend never counts its own work from a report: only from its
//!   bookings. (The model's DC1, `docs/properties.md`; exact, no slack.)
//! - `load_leaked`, two checks:
//!   - throughout, at every pick on an *exact view* (the newest report made for `c` at `w` has
//!     been delivered, so nothing newer is lost or on its way): that report says what the
//!     other connections hold at `w` now (with the check above, so does the frontend's view).
//!     Work that ended must have made the worker report again (the model's BL2, before
//!     quiescence).
//!   - at the quiescent checkpoint that ends every run (every request ended, then delivery
//!     made reliable, every late report landed, and one refresh of every worker delivered on
//!     time): every worker's ledger total is zero, and every live frontend's combined load on
//!     every worker (`Dispatcher::combined_work`: bookings plus reported others) is zero
//!     (the model's BL1 and BL2).
//!
//! The mutants: `reports-own-work` (the worker sends its ledger's total, the receiving
//! connection's own work included) is caught by `load_double_counted`;
//! `ledger-keeps-failed-work` (an attempt that did not answer is never finished in the ledger)
//! by `load_leaked`. As in the model, the second also breaks `load_double_counted` (the
//! leaked work is in reports but no longer held).

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::config::Mutant;
use super::fate::Fate;
use super::oracle::Violation;
use super::world::{LoadSubscriber, World, WorldState};
use prefill_router::discovery::InstanceId;
use prefill_router::load_report::{Load, LoadReport};

pub use super::config::MAX_FRONTENDS;

/// Percent of load reports lost while faults are on.
pub const LOSS_PERCENT: u64 = 8;
/// Percent of load reports delayed while faults are on.
pub const DELAY_PERCENT: u64 = 12;
/// Longest delay of a delayed report.
pub const DELAY_MAX_MS: u64 = 30;
/// Period of the workers' refresh (`LoadLedger::refresh_for` to every connection).
pub const REFRESH_PERIOD: Duration = Duration::from_millis(50);

/// The key of the report-fate draws.
const STREAM_REPORT: u64 = 7;
/// The key of the frontend draws.
const STREAM_FRONTEND: u64 = 8;

/// Which of `frontends` frontends request `request` goes through.
pub(crate) fn frontend_of(world: &World, request: u64, frontends: usize) -> usize {
    if frontends <= 1 {
        return 0;
    }
    world
        .keyed(&[STREAM_FRONTEND, request])
        .below(frontends as u64) as usize
}

/// Frontends per binding in this run (1: the mode is off).
pub(crate) fn frontends(world: &World) -> u32 {
    world.with(|s| s.reports.frontends.max(1))
}

/// A new connection id for a dispatcher about to be built (`None`: the mode is off).
pub(crate) fn new_conn(world: &World) -> Option<u64> {
    world.with(|s| {
        (s.reports.frontends > 1).then(|| {
            s.reports.next_conn += 1;
            s.reports.next_conn
        })
    })
}

/// The dispatcher of connection `conn` is built: every worker opens the connection and makes
/// its first report.
pub(crate) fn connect(world: &Arc<World>, conn: u64, dispatcher: Weak<dyn LoadSubscriber>) {
    let plans = world.with(|s| {
        s.reports.conns.insert(conn, dispatcher);
        let workers: Vec<InstanceId> = s.workers.keys().copied().collect();
        workers
            .into_iter()
            .filter_map(|w| {
                s.reports.ledgers.entry(w).or_default().open(conn);
                make(world, s, w, conn, false)
            })
            .collect::<Vec<_>>()
    });
    deliver(world, plans);
}

/// One report made, with the ghost truth at its making.
#[derive(Clone, Copy)]
struct Plan {
    worker: InstanceId,
    conn: u64,
    report: LoadReport,
    /// What the other connections held when it was made.
    truth: Load,
    /// What the receiving connection held.
    own: Load,
    fate: Fate,
}

/// Make a report for `conn` at `worker` (on change, or a refresh) and draw its fate.
fn make(
    world: &World,
    s: &mut WorldState,
    worker: InstanceId,
    conn: u64,
    refresh: bool,
) -> Option<Plan> {
    let ledger = s.reports.ledgers.get_mut(&worker)?;
    let mut report = if refresh {
        ledger.refresh_for(conn)?
    } else {
        ledger.report_for(conn)?
    };
    if world.mutant == Some(Mutant::ReportsOwnWork) {
        report.others = ledger.total();
    }
    let (truth, own) = s.reports.truth(worker, conn);
    s.reports.streams.entry((conn, worker)).or_default().made = report.seq;
    s.reports.published += 1;
    s.stats.load_reports += 1;
    let mut rng = world.keyed(&[STREAM_REPORT, s.reports.published]);
    let fate = if s.reports.quiet {
        Fate::Now
    } else if !World::reachable(s, worker) {
        Fate::Lost
    } else if s.faults {
        Fate::draw(&mut rng, LOSS_PERCENT, DELAY_PERCENT, DELAY_MAX_MS)
    } else {
        Fate::Now
    };
    match fate {
        Fate::Lost => s.stats.load_reports_lost += 1,
        Fate::Late(_) => s.stats.load_reports_late += 1,
        Fate::Now => {}
    }
    Some(Plan {
        worker,
        conn,
        report,
        truth,
        own,
        fate,
    })
}

/// The reports `worker` makes after its ledger changed: one per connection whose report
/// changed.
fn changed(world: &World, s: &mut WorldState, worker: InstanceId) -> Vec<Plan> {
    let conns: Vec<u64> = s.reports.conns.keys().copied().collect();
    conns
        .into_iter()
        .filter_map(|c| make(world, s, worker, c, false))
        .collect()
}

/// Carry out the reports' fates.
fn deliver(world: &Arc<World>, plans: Vec<Plan>) {
    for plan in plans {
        match plan.fate {
            Fate::Lost => {}
            Fate::Now => deliver_one(world, &plan),
            Fate::Late(delay) => {
                // A worker's last attempts may end while the runtime shuts down: nothing is
                // delivered after the run anyway.
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    let world = Arc::clone(world);
                    runtime.spawn(async move {
                        tokio::time::sleep(delay).await;
                        deliver_one(&world, &plan);
                    });
                }
            }
        }
    }
}

/// Apply one report to its connection's dispatcher, if it is still alive, then judge the
/// dispatcher's view.
fn deliver_one(world: &World, plan: &Plan) {
    let Some(dispatcher) = world.with(|s| s.reports.conns.get(&plan.conn).and_then(Weak::upgrade))
    else {
        return;
    };
    // Outside the world's lock: the dispatcher takes its own.
    dispatcher.apply_report(plan.worker, plan.report);
    world.with(|s| {
        let stream = s
            .reports
            .streams
            .entry((plan.conn, plan.worker))
            .or_default();
        if stream
            .delivered
            .is_none_or(|(seq, _, _)| plan.report.seq > seq)
        {
            stream.delivered = Some((plan.report.seq, plan.truth, plan.own));
        }
    });
    check_view(world, &*dispatcher, plan.conn, plan.worker, false);
}

/// Record the violation unless one of the same check was recorded already.
fn flag(world: &World, check: &'static str, violation: Violation) {
    let first = world.with(|s| s.reports.flagged.insert(check));
    if first {
        world.violate(violation);
    }
}

fn pair(load: Load) -> (u64, u64) {
    (load.tokens, load.requests)
}

/// The oracles over the view of `worker` of the frontend on `conn` (see the module's doc);
/// `at_pick`: the frontend just picked `worker`.
fn check_view(
    world: &World,
    dispatcher: &dyn LoadSubscriber,
    conn: u64,
    worker: InstanceId,
    at_pick: bool,
) {
    let others = dispatcher.others(worker);
    let (stream, (now, _)) = world.with(|s| {
        let stream = s
            .reports
            .streams
            .get(&(conn, worker))
            .copied()
            .unwrap_or_default();
        (stream, s.reports.truth(worker, conn))
    });
    let (truth, own) = stream
        .delivered
        .map_or((Load::ZERO, Load::ZERO), |(_, t, o)| (t, o));
    if others != truth {
        flag(
            world,
            "double_count",
            Violation::LoadDoubleCounted {
                frontend: conn,
                worker,
                others: pair(others),
                truth: pair(truth),
                own: pair(own),
            },
        );
    }
    if !at_pick {
        return;
    }
    let exact = stream
        .delivered
        .is_some_and(|(seq, _, _)| seq == stream.made);
    world.with(|s| {
        s.stats.picks_with_others += u64::from(others.requests > 0);
        s.stats.picks_on_exact_view += u64::from(exact);
    });
    // With the view checked against its report above, what remains is whether that report
    // is still true: work that ended since must have made the worker report again.
    if exact && truth != now {
        flag(
            world,
            "exact_view",
            Violation::LoadLeaked {
                check: "exact_view",
                frontend: conn,
                worker,
                detail: format!(
                    "at a pick on an exact view (the newest report made for the connection \
                     delivered) the report says the other connections hold {:?} (tokens, \
                     requests), they hold {:?} now",
                    pair(truth),
                    pair(now)
                ),
            },
        );
    }
}

/// Oracle at a pick: the frontend on `conn` picked `worker`.
pub(crate) fn picked(
    world: &World,
    dispatcher: &dyn LoadSubscriber,
    conn: u64,
    worker: InstanceId,
) {
    check_view(world, dispatcher, conn, worker, true);
}

/// The work of one attempt a worker took, finished in its ledger when dropped (the attempt
/// ended: answered, failed, timed out or cancelled).
pub(crate) struct HeldWork {
    world: Arc<World>,
    worker: InstanceId,
    conn: u64,
    key: u64,
    /// The worker answered (the `ledger-keeps-failed-work` mutant finishes only these).
    pub(crate) answered: bool,
}

/// Worker `worker` takes attempt `key` of `tokens` prompt tokens on connection `conn`.
pub(crate) fn admit(
    world: &Arc<World>,
    worker: InstanceId,
    conn: u64,
    key: u64,
    tokens: u64,
) -> Option<HeldWork> {
    let plans = world.with(|s| {
        let ledger = s.reports.ledgers.entry(worker).or_default();
        ledger.start(conn, key, tokens).ok()?;
        s.reports
            .held
            .entry(worker)
            .or_default()
            .entry(conn)
            .or_default()
            .insert(key, tokens);
        Some(changed(world, s, worker))
    })?;
    deliver(world, plans);
    Some(HeldWork {
        world: Arc::clone(world),
        worker,
        conn,
        key,
        answered: false,
    })
}

impl Drop for HeldWork {
    fn drop(&mut self) {
        let keep = self.world.mutant == Some(Mutant::LedgerKeepsFailedWork) && !self.answered;
        let plans = self.world.with(|s| {
            if let Some(work) = s
                .reports
                .held
                .get_mut(&self.worker)
                .and_then(|h| h.get_mut(&self.conn))
            {
                work.remove(&self.key);
            }
            if !keep {
                if let Some(ledger) = s.reports.ledgers.get_mut(&self.worker) {
                    ledger.finish(self.conn, self.key);
                }
            }
            changed(&self.world, s, self.worker)
        });
        deliver(&self.world, plans);
    }
}

/// Close the connections of dispatchers that are gone, at every worker.
fn prune(world: &Arc<World>) {
    let plans = world.with(|s| {
        let dead: Vec<u64> = s
            .reports
            .conns
            .iter()
            .filter(|(_, d)| d.strong_count() == 0)
            .map(|(c, _)| *c)
            .collect();
        if dead.is_empty() {
            return Vec::new();
        }
        for conn in &dead {
            s.reports.conns.remove(conn);
            s.reports.streams.retain(|(c, _), _| c != conn);
            for ledger in s.reports.ledgers.values_mut() {
                ledger.close(*conn);
            }
            for held in s.reports.held.values_mut() {
                held.remove(conn);
            }
        }
        let workers: Vec<InstanceId> = s.reports.ledgers.keys().copied().collect();
        workers
            .into_iter()
            .flat_map(|w| changed(world, s, w))
            .collect()
    });
    deliver(world, plans);
}

/// Every worker re-sends its current report on every connection.
fn refresh(world: &Arc<World>) {
    prune(world);
    let plans = world.with(|s| {
        let conns: Vec<u64> = s.reports.conns.keys().copied().collect();
        let workers: Vec<InstanceId> = s.reports.ledgers.keys().copied().collect();
        let mut plans = Vec::new();
        for w in workers {
            for &c in &conns {
                plans.extend(make(world, s, w, c, true));
            }
        }
        plans
    });
    deliver(world, plans);
}

/// The workers' periodic refresh, until `stop`.
pub(crate) async fn refresh_loop(world: Arc<World>, stop: CancellationToken) {
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(REFRESH_PERIOD) => refresh(&world),
        }
    }
}

/// A live frontend's connection and dispatcher.
type LiveFrontend = (u64, Arc<dyn LoadSubscriber>);

/// The quiescent checkpoint, with every request ended: delivery turns reliable, every late
/// report lands, one refresh of every worker is delivered on time; then no ledger holds work
/// and no live frontend counts any load on any worker.
pub(crate) async fn check_quiescent(world: &Arc<World>) {
    if frontends(world) <= 1 {
        return;
    }
    world.with(|s| s.reports.quiet = true);
    tokio::time::sleep(Duration::from_millis(DELAY_MAX_MS + 1)).await;
    refresh(world);
    let (totals, live): (Vec<(InstanceId, Load)>, Vec<LiveFrontend>) = world.with(|s| {
        let totals = s
            .reports
            .ledgers
            .iter()
            .map(|(w, l)| (*w, l.total()))
            .collect();
        let live = s
            .reports
            .conns
            .iter()
            .filter_map(|(c, d)| Some((*c, d.upgrade()?)))
            .collect();
        (totals, live)
    });
    for (worker, total) in &totals {
        if *total != Load::ZERO {
            flag(
                world,
                "quiescent_ledger",
                Violation::LoadLeaked {
                    check: "quiescent_ledger",
                    frontend: u64::MAX,
                    worker: *worker,
                    detail: format!(
                        "with every request ended the worker's ledger still holds {:?} \
                         (tokens, requests)",
                        pair(*total)
                    ),
                },
            );
        }
    }
    for (conn, dispatcher) in &live {
        for (worker, _) in &totals {
            let combined = dispatcher.combined(*worker);
            world.with(|s| s.stats.quiescent_views_checked += 1);
            if combined != 0 {
                flag(
                    world,
                    "quiescent_view",
                    Violation::LoadLeaked {
                        check: "quiescent_view",
                        frontend: *conn,
                        worker: *worker,
                        detail: format!(
                            "with every request ended and a fresh report delivered the frontend \
                             counts load {combined} (booked {}, reported others {:?})",
                            dispatcher.booked(*worker),
                            pair(dispatcher.others(*worker))
                        ),
                    },
                );
            }
        }
    }
    drop(live);
}
