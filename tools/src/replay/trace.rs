//! The trace format: one JSON object per line (Mooncake's `conversation_trace.jsonl`).

use std::collections::HashSet;
use std::io::BufRead;
use std::path::Path;

use serde::Deserialize;

/// Tokens per `hash_ids` block (Mooncake's traces use 512).
pub const BLOCK_TOKENS: u32 = 512;

/// One request of the trace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TraceRecord {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Generated tokens.
    pub output_length: u32,
    /// The prompt's blocks of [`BLOCK_TOKENS`] tokens (the last one may be partial); equal
    /// leading ids mean a shareable KV prefix.
    pub hash_ids: Vec<u64>,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("cannot read the trace: {0}")]
    Io(#[from] std::io::Error),
    /// A line is not a trace record.
    #[error("trace line {line}: {source}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// What the JSON parser said.
        source: serde_json::Error,
    },
    /// A line parses but makes no sense (e.g. `hash_ids` disagree with `input_length`).
    #[error("trace line {line}: {why}")]
    Invalid {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        why: String,
    },
}

/// Read a trace file (see [`parse_trace`]).
pub fn read_trace(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
    let file = std::fs::File::open(path)?;
    parse_trace(std::io::BufReader::new(file))
}

/// Parse a trace: one record per non-empty line, sorted by arrival (stable, so equal
/// timestamps keep the file's order). Each record must have one hash id per started block
/// of its prompt, and ids below 2^32 (the replay writes them into token ids).
pub fn parse_trace(reader: impl BufRead) -> Result<Vec<TraceRecord>, TraceError> {
    let mut records = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line_no = i + 1;
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let record: TraceRecord =
            serde_json::from_str(&line).map_err(|source| TraceError::Parse {
                line: line_no,
                source,
            })?;
        let blocks = record.input_length.div_ceil(BLOCK_TOKENS) as usize;
        if record.hash_ids.len() != blocks {
            return Err(TraceError::Invalid {
                line: line_no,
                why: format!(
                    "{} hash_ids for input_length {} (expected {blocks} blocks of {BLOCK_TOKENS})",
                    record.hash_ids.len(),
                    record.input_length
                ),
            });
        }
        if let Some(big) = record.hash_ids.iter().find(|&&h| h > u64::from(u32::MAX)) {
            return Err(TraceError::Invalid {
                line: line_no,
                why: format!("hash id {big} does not fit 32 bits"),
            });
        }
        records.push(record);
    }
    records.sort_by_key(|r| r.timestamp);
    Ok(records)
}

/// The best prefix hit rate any routing can reach on `trace`: the fraction of prompt blocks
/// found cached by one infinite cache shared by every worker (a block counts when it and every
/// block before it in its prompt were seen before). 0 for an empty trace.
pub fn ceiling(trace: &[TraceRecord]) -> f64 {
    ceiling_of(trace.iter().map(|r| &r.hash_ids[..]))
}

/// [`ceiling`] over the prompts' block keys (the replay's chained hashes at its block size).
pub(crate) fn ceiling_of<'a>(prompts: impl IntoIterator<Item = &'a [u64]>) -> f64 {
    let mut seen = HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for blocks in prompts {
        hits += blocks.iter().take_while(|h| seen.contains(*h)).count() as u64;
        total += blocks.len() as u64;
        seen.extend(blocks.iter().copied());
    }
    ratio(hits, total)
}

/// `a / b`, 0 when `b` is 0.
pub(crate) fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        return 0.0;
    }
    #[allow(clippy::cast_precision_loss)] // counters far below 2^52
    let r = a as f64 / b as f64;
    r
}

/// The prompt of `record` as token ids: entry *i* of its `hash_ids` is `unit` copies of that
/// id, so the push router's chained block hashes, at any block size, agree exactly when the
/// trace's leading ids do (up to the block holding the first difference). The same tokens at
/// every block size: only which of them a block covers changes.
pub(crate) fn tokens(record: &TraceRecord, unit: u32) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(record.hash_ids.len() * unit as usize);
    for &h in &record.hash_ids {
        // parse_trace guarantees ids below 2^32.
        let token = u32::try_from(h).unwrap_or(u32::MAX);
        tokens.extend(std::iter::repeat_n(token, unit as usize));
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_line() {
        let text = "{\"timestamp\":0,\"input_length\":10,\"output_length\":1,\"hash_ids\":[0]}\n\
                    {\"timestamp\":1,\"input_length\":10}\n";
        let err = parse_trace(text.as_bytes()).unwrap_err();
        assert!(matches!(err, TraceError::Parse { line: 2, .. }), "{err}");
        let text = "\n{\"timestamp\":0,\"input_length\":600,\"output_length\":1,\"hash_ids\":[0]}";
        let err = parse_trace(text.as_bytes()).unwrap_err();
        assert!(matches!(err, TraceError::Invalid { line: 2, .. }), "{err}");
    }

    #[test]
    fn ceiling_counts_leading_repeats_only() {
        let r = |ids: &[u64]| TraceRecord {
            timestamp: 0,
            input_length: 512 * ids.len() as u32,
            output_length: 1,
            hash_ids: ids.to_vec(),
        };
        // 0,1 | 0(hit),1(hit),2 | 3,1(not a prefix) -> 2 hits of 7.
        let trace = [r(&[0, 1]), r(&[0, 1, 2]), r(&[3, 1])];
        assert!((ceiling(&trace) - 2.0 / 7.0).abs() < 1e-12);
    }
}
