//! Load reports: how several frontends that never talk to each other see one worker's load.
//!
//! Each frontend books the prefill work it sends (`push`'s load board) and so knows its own
//! work on a worker at once, but not the work other frontends sent there. The worker knows
//! all of it. So the worker reports, on each frontend connection, **the work it holds minus
//! that connection's own requests** ([`LoadLedger::report_for`]), and the frontend counts
//!
//! ```text
//! load(worker) = own bookings (local, instant) + others (the last report, authoritative)
//! ```
//!
//! - *Never counted twice*: a report never holds the receiving connection's own requests, and
//!   the frontend's own work is only ever counted from its bookings.
//! - *Never forgotten before the worker has seen it*: a booking counts from the pick until
//!   its release, whether or not the worker has reported it yet.
//! - *Late, lost or reordered reports*: a report is absolute (not a delta) and carries a
//!   sequence number per connection; [`ReportedLoad::apply`] keeps the newest, so a late one
//!   is ignored and a lost one is superseded by the next. A worker re-sends its current report
//!   now and then ([`LoadLedger::refresh_for`]) so that a lost last report cannot leave a
//!   stale value forever.
//! - *A worker that reports nothing* leaves `others` at zero: the frontend counts its own
//!   bookings only, as before load reports existed (mixed pools work).
//!
//! Per connection rather than per frontend: a frontend that holds two connections to one
//! worker (a retired binding still draining beside its successor) books on two separate
//! boards, and each board is right to see the other connection's work as someone else's.
//!
//! Both halves are pure (no I/O, no clock, no locks): the transport drives them, and the
//! stateright model in `model/` drives the same code with reports late, lost or reordered.

use std::collections::HashMap;

use thiserror::Error;

/// Work held by a worker: the prefill tokens it still has to compute, and the requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Load {
    /// Prefill tokens queued or running (the unit of the frontends' bookings).
    pub tokens: u64,
    /// Requests in flight.
    pub requests: u64,
}

impl Load {
    /// No work.
    pub const ZERO: Load = Load {
        tokens: 0,
        requests: 0,
    };

    fn add(&mut self, tokens: u64) {
        self.tokens = self.tokens.saturating_add(tokens);
        self.requests = self.requests.saturating_add(1);
    }

    fn sub(&mut self, tokens: u64) {
        self.tokens = self.tokens.saturating_sub(tokens);
        self.requests = self.requests.saturating_sub(1);
    }

    fn minus(self, other: Load) -> Load {
        Load {
            tokens: self.tokens.saturating_sub(other.tokens),
            requests: self.requests.saturating_sub(other.requests),
        }
    }
}

/// One report: the worker's load without the receiving connection's own requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LoadReport {
    /// Position in this connection's reports (1, 2, ...); a larger one is newer.
    pub seq: u64,
    /// The work of every other connection.
    pub others: Load,
}

/// Encoded size of a [`LoadReport`]: three little-endian `u64`.
pub const LOAD_REPORT_BYTES: usize = 24;

impl LoadReport {
    /// The fixed 24-byte encoding (seq, tokens, requests).
    pub fn encode(&self) -> [u8; LOAD_REPORT_BYTES] {
        let mut out = [0u8; LOAD_REPORT_BYTES];
        out[..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..16].copy_from_slice(&self.others.tokens.to_le_bytes());
        out[16..].copy_from_slice(&self.others.requests.to_le_bytes());
        out
    }

    /// Decode [`encode`](Self::encode)'s bytes; any other length is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<LoadReport, LoadReportError> {
        let bytes: &[u8; LOAD_REPORT_BYTES] = bytes
            .try_into()
            .map_err(|_| LoadReportError::Length(bytes.len()))?;
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        Ok(LoadReport {
            seq: word(0),
            others: Load {
                tokens: word(1),
                requests: word(2),
            },
        })
    }
}

/// Why a load report or a ledger input was refused.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum LoadReportError {
    /// An encoded report of the wrong length.
    #[error("load report of {0} bytes, expected {LOAD_REPORT_BYTES}")]
    Length(usize),
    /// A request id already in flight on the connection.
    #[error("request {request} is already in flight on connection {conn}")]
    DuplicateRequest {
        /// The connection.
        conn: u64,
        /// The request id.
        request: u64,
    },
}

#[derive(Debug, Default)]
struct ConnLoad {
    own: Load,
    /// Work per request in flight on this connection.
    requests: HashMap<u64, u64>,
    /// Reports made for this connection.
    seq: u64,
    /// What the last report said (`None`: none yet).
    reported: Option<Load>,
}

/// The worker's half: the work in flight per connection, and each connection's report.
///
/// Memory is one entry per open connection and per request in flight, both bounded by the
/// server's connection and in-flight limits.
#[derive(Debug, Default)]
pub struct LoadLedger {
    conns: HashMap<u64, ConnLoad>,
    total: Load,
}

impl LoadLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// The work in flight over every connection.
    pub fn total(&self) -> Load {
        self.total
    }

    /// Connection `conn` opened (idempotent; [`start`](Self::start) also opens it).
    pub fn open(&mut self, conn: u64) {
        self.conns.entry(conn).or_default();
    }

    /// Request `request` with `tokens` of prefill work arrived on `conn`.
    pub fn start(&mut self, conn: u64, request: u64, tokens: u64) -> Result<(), LoadReportError> {
        let entry = self.conns.entry(conn).or_default();
        if entry.requests.contains_key(&request) {
            return Err(LoadReportError::DuplicateRequest { conn, request });
        }
        entry.requests.insert(request, tokens);
        entry.own.add(tokens);
        self.total.add(tokens);
        Ok(())
    }

    /// Request `request` on `conn` no longer holds prefill work (its prefill finished, it
    /// failed or was cancelled). Unknown requests are ignored, so the caller may finish a
    /// request at each of those points.
    pub fn finish(&mut self, conn: u64, request: u64) {
        let Some(entry) = self.conns.get_mut(&conn) else {
            return;
        };
        if let Some(tokens) = entry.requests.remove(&request) {
            entry.own.sub(tokens);
            self.total.sub(tokens);
        }
    }

    /// Connection `conn` closed: its requests hold no more work for anyone's report.
    pub fn close(&mut self, conn: u64) {
        if let Some(entry) = self.conns.remove(&conn) {
            self.total = self.total.minus(entry.own);
        }
    }

    /// The report for `conn` if what it would say changed since the last one (`None` when
    /// unchanged or `conn` is not open). The first report of a connection is always made, so
    /// a frontend learns at once that the worker reports at all.
    pub fn report_for(&mut self, conn: u64) -> Option<LoadReport> {
        let total = self.total;
        let entry = self.conns.get_mut(&conn)?;
        let others = total.minus(entry.own);
        if entry.reported == Some(others) {
            return None;
        }
        Some(Self::make(entry, others))
    }

    /// The report for `conn` even if unchanged (the periodic re-send that heals a lost one);
    /// `None` if `conn` is not open.
    pub fn refresh_for(&mut self, conn: u64) -> Option<LoadReport> {
        let total = self.total;
        let entry = self.conns.get_mut(&conn)?;
        let others = total.minus(entry.own);
        Some(Self::make(entry, others))
    }

    fn make(entry: &mut ConnLoad, others: Load) -> LoadReport {
        entry.seq += 1;
        entry.reported = Some(others);
        LoadReport {
            seq: entry.seq,
            others,
        }
    }

    /// Open connections.
    pub fn connections(&self) -> impl Iterator<Item = u64> + '_ {
        self.conns.keys().copied()
    }
}

/// What [`ReportedLoad::apply`] did with a report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Newer than any applied: `others` is now the report's.
    Newer,
    /// Not newer than the last applied (late or repeated): ignored.
    Stale,
}

/// The frontend's half for one worker connection: the other connections' work, from the
/// newest report applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReportedLoad {
    seq: u64,
    others: Load,
}

impl ReportedLoad {
    /// Nothing reported yet: others' work is zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Apply `report` if it is newer than every report applied so far.
    pub fn apply(&mut self, report: LoadReport) -> Applied {
        if report.seq <= self.seq {
            return Applied::Stale;
        }
        self.seq = report.seq;
        self.others = report.others;
        Applied::Newer
    }

    /// The other connections' work per the newest report (zero before any).
    pub fn others(&self) -> Load {
        self.others
    }

    /// Whether any report was applied (the worker publishes reports).
    pub fn reporting(&self) -> bool {
        self.seq > 0
    }

    /// The load the frontend counts for the worker: its own bookings plus the others'.
    pub fn combined(&self, own: Load) -> Load {
        Load {
            tokens: own.tokens.saturating_add(self.others.tokens),
            requests: own.requests.saturating_add(self.others.requests),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_never_holds_the_receiving_connections_own_work() {
        let mut ledger = LoadLedger::new();
        ledger.start(1, 10, 100).unwrap();
        ledger.start(2, 10, 30).unwrap();
        ledger.start(2, 11, 5).unwrap();
        let to_one = ledger.report_for(1).unwrap();
        let to_two = ledger.report_for(2).unwrap();
        assert_eq!(
            to_one.others,
            Load {
                tokens: 35,
                requests: 2
            }
        );
        assert_eq!(
            to_two.others,
            Load {
                tokens: 100,
                requests: 1
            }
        );
        assert_eq!(
            ledger.total(),
            Load {
                tokens: 135,
                requests: 3
            }
        );
    }

    #[test]
    fn an_unchanged_load_makes_no_report_but_a_refresh_does() {
        let mut ledger = LoadLedger::new();
        ledger.open(1);
        let first = ledger.report_for(1).unwrap();
        assert_eq!(first.others, Load::ZERO);
        assert_eq!(ledger.report_for(1), None);
        // Work on the connection itself does not change what it is told.
        ledger.start(1, 1, 50).unwrap();
        assert_eq!(ledger.report_for(1), None);
        let again = ledger.refresh_for(1).unwrap();
        assert_eq!((again.seq, again.others), (2, Load::ZERO));
    }

    #[test]
    fn finishing_or_closing_returns_the_load_to_zero() {
        let mut ledger = LoadLedger::new();
        ledger.start(1, 1, 7).unwrap();
        ledger.start(2, 1, 9).unwrap();
        ledger.finish(1, 1);
        ledger.finish(1, 1);
        ledger.finish(3, 1);
        assert_eq!(
            ledger.total(),
            Load {
                tokens: 9,
                requests: 1
            }
        );
        ledger.close(2);
        assert_eq!(ledger.total(), Load::ZERO);
        assert_eq!(ledger.refresh_for(2), None);
    }

    #[test]
    fn the_ledger_lists_exactly_its_open_connections() {
        let mut ledger = LoadLedger::new();
        ledger.open(3);
        ledger.start(5, 1, 2).unwrap();
        let mut open: Vec<u64> = ledger.connections().collect();
        open.sort_unstable();
        assert_eq!(open, vec![3, 5]);
        ledger.close(3);
        assert_eq!(ledger.connections().collect::<Vec<_>>(), vec![5]);
    }

    #[test]
    fn a_duplicate_request_id_is_refused_and_counts_once() {
        let mut ledger = LoadLedger::new();
        ledger.start(1, 4, 7).unwrap();
        assert_eq!(
            ledger.start(1, 4, 7),
            Err(LoadReportError::DuplicateRequest {
                conn: 1,
                request: 4
            })
        );
        assert_eq!(
            ledger.total(),
            Load {
                tokens: 7,
                requests: 1
            }
        );
    }

    #[test]
    fn a_late_report_is_ignored_and_a_newer_one_supersedes() {
        let report = |seq, tokens| LoadReport {
            seq,
            others: Load {
                tokens,
                requests: 1,
            },
        };
        let mut seen = ReportedLoad::new();
        assert!(!seen.reporting());
        assert_eq!(seen.apply(report(2, 20)), Applied::Newer);
        assert_eq!(seen.apply(report(1, 10)), Applied::Stale);
        assert_eq!(seen.apply(report(2, 99)), Applied::Stale);
        assert_eq!(seen.others().tokens, 20);
        assert_eq!(seen.apply(report(5, 0)), Applied::Newer);
        let own = Load {
            tokens: 3,
            requests: 1,
        };
        assert_eq!(
            seen.combined(own),
            Load {
                tokens: 3,
                requests: 2
            }
        );
    }

    #[test]
    fn the_encoding_round_trips_and_refuses_other_lengths() {
        let report = LoadReport {
            seq: u64::MAX,
            others: Load {
                tokens: 1 << 40,
                requests: 3,
            },
        };
        assert_eq!(LoadReport::decode(&report.encode()), Ok(report));
        assert_eq!(
            LoadReport::decode(&[0; 23]),
            Err(LoadReportError::Length(23))
        );
        assert_eq!(
            LoadReport::decode(&[0; 25]),
            Err(LoadReportError::Length(25))
        );
    }
}
