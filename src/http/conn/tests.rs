//! The connection watchdog's phases and deadlines.

use super::*;

const LIMITS: Limits = Limits {
    header: Duration::from_secs(2),
    idle: Duration::from_secs(60),
    request: Duration::from_secs(30),
};

#[tokio::test(start_paused = true)]
async fn each_phase_has_its_deadline() {
    let state = ConnState::new();
    let accepted = Instant::now();
    // A new connection: its headers are due a header timeout after the accept.
    assert_eq!(
        state.deadline(LIMITS),
        (accepted + LIMITS.header, DropReason::HeaderTimeout)
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    state.on_read();
    let first_byte = Instant::now();
    assert_eq!(
        state.deadline(LIMITS),
        (first_byte + LIMITS.header, DropReason::HeaderTimeout)
    );
    tokio::time::advance(Duration::from_millis(500)).await;
    // The request's deadline runs from its first byte, not from its headers.
    let (ticket, start) = state.begin();
    assert_eq!(start, first_byte);
    assert_eq!(
        state.deadline(LIMITS),
        (
            first_byte + LIMITS.request + DEADLINE_GRACE,
            DropReason::RequestTimeout
        )
    );
    // A stale ticket ends nothing.
    state.end(ticket + 1);
    assert_eq!(state.deadline(LIMITS).1, DropReason::RequestTimeout);
    state.end(ticket);
    let idle_since = Instant::now();
    assert_eq!(
        state.deadline(LIMITS),
        (idle_since + LIMITS.idle, DropReason::IdleTimeout)
    );
    // The next request's first byte starts its header timer.
    tokio::time::advance(Duration::from_secs(5)).await;
    state.on_read();
    assert_eq!(
        state.deadline(LIMITS),
        (Instant::now() + LIMITS.header, DropReason::HeaderTimeout)
    );
}
