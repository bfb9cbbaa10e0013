//! The booking world's steps: the actions of the model.

use std::fmt;

/// One step of the world. Requests are named by their index in [`State::requests`](super::world::State::requests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BookingStep {
    /// Frontend `frontend` admits its next request, of `work` tokens, on `worker`, and books it.
    Admit {
        /// The frontend.
        frontend: u8,
        /// The worker.
        worker: u8,
        /// Its work in tokens.
        work: u8,
    },
    /// A request reaches its worker (`start`).
    Arrive(u8),
    /// A request is cancelled or fails at its frontend, which releases it.
    Cancel(u8),
    /// A cancelled request that never reached its worker is lost for good.
    Vanish(u8),
    /// The worker ends a request: it finished, or the cancellation arrived (`finish`).
    WorkerEnds(u8),
    /// The frontend sees its request's end and releases it.
    SeeEnd(u8),
    /// The worker makes a report for the connection: on change (`report_for`), or the periodic
    /// re-send (`refresh_for`).
    Report {
        /// The worker.
        worker: u8,
        /// The frontend (connection id).
        frontend: u8,
        /// `refresh_for` rather than `report_for`.
        refresh: bool,
    },
    /// The channel delivers its `index`-th report in flight; the frontend applies it.
    Deliver {
        /// The worker.
        worker: u8,
        /// The frontend.
        frontend: u8,
        /// Which report in flight (the channel is kept sorted).
        index: u8,
    },
    /// The channel loses its `index`-th report in flight.
    Lose {
        /// The worker.
        worker: u8,
        /// The frontend.
        frontend: u8,
        /// Which report in flight.
        index: u8,
    },
    /// The connection closes (both ends drop it) and a fresh one opens.
    Close {
        /// The worker.
        worker: u8,
        /// The frontend.
        frontend: u8,
    },
}

impl fmt::Display for BookingStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            BookingStep::Admit {
                frontend,
                worker,
                work,
            } => write!(f, "f{frontend} admits {work} tokens on w{worker}"),
            BookingStep::Arrive(i) => write!(f, "request {i} arrives"),
            BookingStep::Cancel(i) => write!(f, "request {i} is cancelled"),
            BookingStep::Vanish(i) => write!(f, "cancelled request {i} never arrives"),
            BookingStep::WorkerEnds(i) => write!(f, "the worker ends request {i}"),
            BookingStep::SeeEnd(i) => write!(f, "the frontend sees request {i} end"),
            BookingStep::Report {
                worker,
                frontend,
                refresh,
            } => {
                let how = if refresh { "refreshes" } else { "reports" };
                write!(f, "w{worker} {how} to f{frontend}")
            }
            BookingStep::Deliver {
                worker,
                frontend,
                index,
            } => write!(f, "w{worker}->f{frontend} delivers report {index}"),
            BookingStep::Lose {
                worker,
                frontend,
                index,
            } => write!(f, "w{worker}->f{frontend} loses report {index}"),
            BookingStep::Close { worker, frontend } => {
                write!(f, "connection w{worker}-f{frontend} closes")
            }
        }
    }
}
