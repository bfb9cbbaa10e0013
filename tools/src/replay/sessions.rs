//! Sessions in a trace: which requests are turns of one conversation, for the closed loop
//! and for session affinity.

use std::time::Duration;

use super::trace::TraceRecord;

/// The trace's sessions for the closed loop, by first arrival: a request continues the
/// session one of whose earlier prompts is the longest prefix of its own (a later turn carries
/// its history), else it opens a session of its own.
pub(crate) fn sessions(records: &[TraceRecord]) -> Vec<Vec<usize>> {
    use std::collections::HashMap;
    let mut by_prompt: HashMap<u64, usize> = HashMap::new();
    let mut sessions: Vec<Vec<usize>> = Vec::new();
    for (index, record) in records.iter().enumerate() {
        // Chained hashes of every prefix of the prompt's ids.
        let mut h = prefill_router::rng::GAMMA;
        let prefixes: Vec<u64> = record
            .hash_ids
            .iter()
            .map(|&id| {
                h = prefill_router::rng::finalize(h ^ id);
                h
            })
            .collect();
        let continued = prefixes
            .iter()
            .rev()
            .find_map(|p| by_prompt.get(p).copied());
        let session = continued.unwrap_or_else(|| {
            sessions.push(Vec::new());
            sessions.len() - 1
        });
        sessions[session].push(index);
        if let Some(&full) = prefixes.last() {
            by_prompt.insert(full, session);
        }
    }
    sessions
}

/// Closed-loop arrivals: `users` users, each running one session's turns in order, the next
/// turn `think` after the previous one completed, then the next session from the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClosedLoop {
    /// Concurrent users.
    pub users: usize,
    /// Pause between a turn's completion and the next turn.
    pub think: Duration,
}

/// The session of `record`: its conversation. Every prompt of the Mooncake conversation trace
/// opens with the same block (id 0, a shared system prompt) and the turns of one conversation
/// share the next one, so the first two ids name it (7,373 sessions in the trace, 2,259 with
/// more than one turn).
pub(crate) fn session_key(record: &TraceRecord) -> String {
    let ids = &record.hash_ids;
    match (ids.first(), ids.get(1)) {
        (Some(a), Some(b)) => format!("conv-{a}-{b}"),
        (Some(a), None) => format!("conv-{a}"),
        _ => "conv-empty".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::trace::BLOCK_TOKENS;

    fn record(ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp: 0,
            input_length: ids.len() as u32 * BLOCK_TOKENS,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn a_turn_continues_the_session_whose_latest_prompt_prefixes_it() {
        let trace = [
            record(&[0, 1]),       // session A
            record(&[0, 2]),       // session B (shares only the system block)
            record(&[0, 1, 5]),    // A, turn 2
            record(&[0, 1, 5, 6]), // A, turn 3
            record(&[0, 1, 7]),    // A's first prompt again, then its own: continues A
            record(&[9]),          // C
        ];
        assert_eq!(sessions(&trace), vec![vec![0, 2, 3, 4], vec![1], vec![5]]);
    }
}
