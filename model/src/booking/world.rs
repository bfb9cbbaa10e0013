//! The booking model's state: the frontends' requests and boards, each worker's ledger, and the
//! report channels between them, with the ghost facts the properties need.
//!
//! Neither [`LoadLedger`] nor [`ReportedLoad`] is `Hash` (nor the ledger `Clone`), and stateright
//! stores states by hash; so the state keeps what was *given* to them (the requests the ledger
//! was told about, the reports it made, the report a frontend applied) and [`ledger`] and
//! [`Link::reported_load`] rebuild the real values from that through their public API whenever a
//! step or a property needs them. [`ledger`] is exact: the rebuilt ledger answers every call as
//! the one the steps drove would (same work per connection, same last report and seq), and the
//! model checks after each ledger step that the driven ledger and the rebuilt one agree
//! (`booking::agree`), so `finish` and `close` are exercised, not only `start`.

use std::fmt;

use prefill_router::load_report::{Load, LoadLedger, LoadReport, ReportedLoad};

/// Where one request is. A frontend *books* a request from its admission until it releases it
/// (on seeing its end, or at once on a cancellation or failure).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Not admitted yet (a slot of the frontend's request budget).
    Idle,
    /// Booked; on its way to the worker.
    Sent,
    /// Booked; the worker holds it (`LoadLedger::start`).
    Running,
    /// The worker finished it (`LoadLedger::finish`); the frontend has not seen the end yet and
    /// still books it.
    Finished,
    /// Cancelled or failed while on its way: released by the frontend; it may still arrive.
    Orphan,
    /// Cancelled or failed while the worker holds it: released by the frontend; the
    /// cancellation is on its way to the worker.
    Cancelled,
    /// Over: neither the frontend nor the worker holds it.
    Done,
}

impl Stage {
    /// Whether the request is anywhere but idle or over (the world is quiescent when none is).
    pub fn in_flight(self) -> bool {
        !matches!(self, Stage::Idle | Stage::Done)
    }

    /// Whether its frontend books it.
    pub fn booked(self) -> bool {
        matches!(self, Stage::Sent | Stage::Running | Stage::Finished)
    }

    /// Whether the worker holds it (it arrived and the worker has not ended it).
    pub fn held(self) -> bool {
        matches!(self, Stage::Running | Stage::Cancelled)
    }

    /// Whether it is or will be work at the worker: held, or on its way.
    pub fn at_worker(self) -> bool {
        matches!(
            self,
            Stage::Sent | Stage::Running | Stage::Orphan | Stage::Cancelled
        )
    }
}

/// One request of one frontend. Its id on the connection is its slot within the frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Request {
    /// The frontend that admitted it (also its connection id at every worker).
    pub frontend: u8,
    /// Its slot in the frontend's budget: the request id on the connection.
    pub id: u8,
    /// The worker it was admitted on (0 while idle).
    pub worker: u8,
    /// Its prefill work in tokens (0 while idle).
    pub work: u8,
    /// Where it is.
    pub stage: Stage,
}

/// What one worker's ledger was told about one connection (the connection id is the frontend's
/// index). Connections are always open: a close is followed at once by a fresh connection.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Conn {
    /// Requests started on the connection and not finished since, as `(id, tokens)`, sorted.
    pub held: Vec<(u8, u8)>,
    /// The seq of the last report made for the connection (0: none yet).
    pub seq: u8,
    /// What that report said (the ledger's own record, before any alteration on the wire).
    pub reported: Option<Load>,
}

/// A report on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Wire {
    /// The report as sent.
    pub report: LoadReport,
}

impl Wire {
    fn key(&self) -> [u64; 3] {
        let r = self.report;
        [r.seq, r.others.tokens, r.others.requests]
    }
}

// `Load` and `LoadReport` are not `Ord`; the channel is kept sorted (a canonical multiset) by
// this key.
impl PartialOrd for Wire {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Wire {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key().cmp(&other.key())
    }
}

/// One frontend's connection to one worker: the worker's record of it, the reports in flight,
/// and the frontend's board and newest report.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Link {
    /// The worker's side.
    pub conn: Conn,
    /// Reports made and not yet delivered or lost: a multiset (kept sorted), delivered in any
    /// order.
    pub channel: Vec<Wire>,
    /// The frontend's own bookings on the worker (the push load board's count).
    pub own: Load,
    /// The report the frontend's [`ReportedLoad`] last applied (`None`: none yet).
    pub applied: Option<LoadReport>,
    /// Ghost: the last report made on this connection has been delivered.
    pub last_delivered: bool,
}

impl Link {
    /// The frontend's real [`ReportedLoad`], rebuilt by applying the one report it last applied
    /// (a fresh one holds only the newest report's seq and load).
    pub fn reported_load(&self) -> ReportedLoad {
        let mut seen = ReportedLoad::new();
        if let Some(report) = self.applied {
            seen.apply(report);
        }
        seen
    }
}

/// Connection id of the scaffold [`ledger`] uses to replay a connection's last report.
const SCAFFOLD: u64 = u64::MAX;

/// The real ledger of one worker, rebuilt from its links (indexed by frontend = connection id).
///
/// For each connection that has reported, a scaffold connection is given exactly the work that
/// report said, the report is re-made `seq` times (`refresh_for`), and the scaffold is closed:
/// so the connection's seq and last report are the recorded ones. Then every held request is
/// started on its connection.
pub fn ledger(links: &[Link]) -> LoadLedger {
    let mut ledger = LoadLedger::new();
    for (c, link) in links.iter().enumerate() {
        let conn = c as u64;
        ledger.open(conn);
        if let Some(said) = link.conn.reported {
            // The scaffold carries the tokens on its first request and none on the rest, so
            // that both the tokens and the request count match what was said.
            for r in 0..said.requests {
                let tokens = if r == 0 { said.tokens } else { 0 };
                start(&mut ledger, SCAFFOLD, r, tokens);
            }
            for _ in 0..link.conn.seq {
                ledger.refresh_for(conn);
            }
            ledger.close(SCAFFOLD);
        }
    }
    for (c, link) in links.iter().enumerate() {
        for &(id, tokens) in &link.conn.held {
            start(&mut ledger, c as u64, u64::from(id), u64::from(tokens));
        }
    }
    ledger
}

/// `LoadLedger::start` of a request the model knows is not on the connection yet.
pub(crate) fn start(ledger: &mut LoadLedger, conn: u64, request: u64, tokens: u64) {
    if let Err(e) = ledger.start(conn, request, tokens) {
        // Request ids are slots used once per connection: a refusal is a bug of the model.
        panic!("the model started a request twice: {e}");
    }
}

/// The state: requests, one link per (worker, frontend), budgets and ghost bits.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct State {
    /// Every frontend's requests, frontend by frontend, slot by slot.
    pub requests: Vec<Request>,
    /// `links[w][f]`: frontend `f`'s connection to worker `w`.
    pub links: Vec<Vec<Link>>,
    /// Connection closes the world may still make.
    pub closes_left: u8,
    /// Violations seen on a step (bits of [`fault`]).
    pub faults: u8,
}

/// Fault bits: violations only visible on a step.
pub mod fault {
    /// An admission made on an exact view took the worker's true load past the threshold.
    pub const FRESH_OVERSHOOT: u8 = 1;
    /// A report was sent whose `others` differs from the other frontends' work held at the
    /// worker when it was made.
    pub const WRONG_OTHERS: u8 = 2;
}

impl State {
    /// Whether no request is in flight anywhere.
    pub fn quiescent(&self) -> bool {
        self.requests.iter().all(|r| !r.stage.in_flight())
    }

    /// The work (tokens, requests) of worker `w`'s requests in a stage matching `pick`, skipping
    /// frontend `except`.
    pub fn work(&self, w: u8, except: Option<u8>, pick: fn(Stage) -> bool) -> Load {
        let mut load = Load::ZERO;
        for r in &self.requests {
            if r.worker == w && Some(r.frontend) != except && pick(r.stage) {
                load.tokens += u64::from(r.work);
                load.requests += 1;
            }
        }
        load
    }

    /// The work the other frontends' requests hold at worker `w` now: what a report for `f`
    /// should say.
    pub fn truth(&self, w: u8, f: u8) -> Load {
        self.work(w, Some(f), Stage::held)
    }
}

impl fmt::Debug for State {
    // Shown by counterexample traces: one line per request and per link.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for r in &self.requests {
            if r.stage != Stage::Idle {
                writeln!(
                    f,
                    "request f{}#{} on w{} ({} tokens): {:?}",
                    r.frontend, r.id, r.worker, r.work, r.stage
                )?;
            }
        }
        for (w, links) in self.links.iter().enumerate() {
            for (fe, l) in links.iter().enumerate() {
                writeln!(
                    f,
                    "w{w}->f{fe}: ledger holds {:?}, seq {}, said {:?}; wire {:?}; own {}; applied {:?}",
                    l.conn.held,
                    l.conn.seq,
                    l.conn.reported.map(|r| r.tokens),
                    l.channel
                        .iter()
                        .map(|x| (x.report.seq, x.report.others.tokens))
                        .collect::<Vec<_>>(),
                    l.own.tokens,
                    l.applied.map(|r| (r.seq, r.others.tokens)),
                )?;
            }
        }
        write!(f, "faults {:#x}", self.faults)
    }
}
