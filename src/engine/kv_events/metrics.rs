//! The engines' KV event feeds as Prometheus metrics, read from the [`EngineKvBoard`] at
//! scrape time (prefix `prefill_router_`, label `engine` = the instance id):
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `engine_kv_batches_total` | counter | event batches applied (live or replayed) |
//! | `engine_kv_events_total` | counter | events applied |
//! | `engine_kv_received_total` | counter | live batches received |
//! | `engine_kv_dropped_total` | counter | batches or messages that could not be decoded |
//! | `engine_kv_replayed_total` | counter | batches applied from the engine's replay endpoint |
//! | `engine_kv_rebuilds_total` | counter | gaps no replay could fill: entries dropped and rebuilt |
//! | `engine_kv_restarts_total` | counter | engine restarts noticed |
//! | `engine_kv_skipped_events_total` | counter | events not indexed (other groups, LoRA, unknown, invalid) |
//! | `engine_kv_block_size_mismatches_total` | counter | stored chains refused: a block size other than the card's |
//! | `engine_kv_disconnects_total` | counter | times the live stream was lost |
//! | `engine_kv_stale_restarts_total` | counter | times a batch owed after a prefill never came: entries dropped, feed restarted |
//! | `engine_kv_exact` | gauge | 1 when the index holds exactly the engine's cache, 0 when partial or unknown |
//! | `engine_kv_last_event_age_ms` | gauge | since the last live batch (-1: none yet) |
//! | `engine_load_requests` | gauge | requests the engine runs and queues, as last scraped (-1: unknown, stale, or not scraped) |
//! | `engine_load_stale` | gauge | 1 while the engine's `/metrics` stopped answering (scored as saturated) |

use std::fmt;
use std::sync::Arc;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::board::{EngineKvBoard, EngineKvStatus};
use crate::engine::load::LoadReading;
use crate::kv_events::Picture;

type Counter = fn(&EngineKvStatus) -> u64;
type Gauge = fn(&EngineKvStatus, tokio::time::Instant) -> i64;

const COUNTERS: [(&str, &str, Counter); 11] = [
    (
        "engine_kv_batches",
        "Engine KV event batches applied",
        |s| s.counts.batches,
    ),
    ("engine_kv_events", "Engine KV events applied", |s| {
        s.counts.events
    }),
    (
        "engine_kv_received",
        "Engine KV event batches received live",
        |s| s.received,
    ),
    (
        "engine_kv_dropped",
        "Engine KV event batches that could not be decoded",
        |s| s.undecodable,
    ),
    (
        "engine_kv_replayed",
        "Engine KV event batches applied from a replay",
        |s| s.counts.replayed,
    ),
    (
        "engine_kv_rebuilds",
        "Gaps no replay could fill: the engine's entries rebuilt",
        |s| s.counts.rebuilds,
    ),
    (
        "engine_kv_restarts",
        "Engine restarts noticed in its event stream",
        |s| s.counts.restarts,
    ),
    (
        "engine_kv_skipped_events",
        "Engine KV events not indexed",
        |s| s.counts.skipped_events,
    ),
    (
        "engine_kv_block_size_mismatches",
        "Stored chains refused for a block size other than the card's",
        |s| s.counts.block_size_mismatches,
    ),
    (
        "engine_kv_disconnects",
        "Times an engine's KV event stream was lost",
        |s| s.disconnects,
    ),
    (
        "engine_kv_stale_restarts",
        "Times an engine's events went stale after a prefill: entries dropped, feed restarted",
        |s| s.stale_restarts,
    ),
];

/// Encode every engine's families.
pub(crate) fn encode(board: &Arc<EngineKvBoard>, encoder: &mut DescriptorEncoder) -> fmt::Result {
    let statuses = board.statuses();
    let ids: Vec<String> = statuses.keys().map(ToString::to_string).collect();
    let kind = ConstCounter::new(0u64).metric_type();
    for (name, help, value) in COUNTERS {
        let mut family = encoder.encode_descriptor(name, help, None, kind)?;
        for (id, status) in ids.iter().zip(statuses.values()) {
            let labels = [("engine", id.as_str())];
            let e = family.encode_family(&labels)?;
            ConstCounter::new(value(status)).encode(e)?;
        }
    }
    let kind = ConstGauge::new(0i64).metric_type();
    let now = tokio::time::Instant::now();
    let gauges: [(&str, &str, Gauge); 4] = [
        (
            "engine_kv_exact",
            "Whether the index holds exactly the engine's cache (1) or not (0)",
            |s, _| i64::from(s.picture == Picture::Exact),
        ),
        (
            "engine_kv_last_event_age_ms",
            "Milliseconds since the engine's last live KV event batch (-1: none yet)",
            |s, now| {
                s.last_event.map_or(-1, |t| {
                    i64::try_from(now.saturating_duration_since(t).as_millis()).unwrap_or(i64::MAX)
                })
            },
        ),
        (
            "engine_load_requests",
            "Requests the engine runs and queues, per its /metrics (-1: unknown, stale or not read)",
            |s, _| match &s.load.reading {
                Some(LoadReading::Known(load)) => i64::try_from(load.requests()).unwrap_or(i64::MAX),
                _ => -1,
            },
        ),
        (
            "engine_load_stale",
            "Whether the engine's /metrics stopped answering (1: scored as saturated)",
            |s, _| i64::from(s.load.reading == Some(LoadReading::Stale)),
        ),
    ];
    for (name, help, value) in gauges {
        let mut family = encoder.encode_descriptor(name, help, None, kind)?;
        for (id, status) in ids.iter().zip(statuses.values()) {
            let labels = [("engine", id.as_str())];
            let e = family.encode_family(&labels)?;
            ConstGauge::new(value(status, now)).encode(e)?;
        }
    }
    Ok(())
}
