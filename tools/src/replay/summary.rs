//! A replay's report from what it served: hit rates, TTFT percentiles, windows around pool
//! events.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::config::{PoolEvent, ReplayConfig, EVENT_WINDOW};
use super::link::Served;
use super::link::Shared;
use super::report::{
    quantiles, AffinityReport, EventReport, JoinReport, JoinWindow, Percentiles, ReplayReport,
    Window, MATCH_POINTS,
};
use super::trace::{ceiling_of, ratio, TraceRecord};
use prefill_router::router::ConditionalPolicy;

/// The report's name for a conditional policy: `short<N` and `busy>M`, joined by `,`.
fn conditional_label(policy: &ConditionalPolicy) -> String {
    let short = policy.min_uncached_tokens.map(|n| format!("short<{n}"));
    let busy = policy
        .max_pool_tokens_per_worker
        .map(|n| format!("busy>{n}"));
    let parts: Vec<String> = short.into_iter().chain(busy).collect();
    if parts.is_empty() {
        "none".to_owned()
    } else {
        parts.join(",")
    }
}

/// Prompt blocks and cached blocks over `served`.
fn tally<'a>(served: impl Iterator<Item = &'a Served>) -> (u64, u64) {
    served.fold((0, 0), |(b, h), s| {
        (b + u64::from(s.blocks), h + u64::from(s.hits))
    })
}

/// The joined frontend's windows: requests 1-25, 26-50, 51-100, then doubling, the last
/// ending with its last request.
fn join_windows(requests: usize) -> Vec<(usize, usize)> {
    let mut windows = Vec::new();
    let (mut first, mut size) = (1, 25);
    while first <= requests {
        let last = (first + size - 1).min(requests);
        windows.push((first, last));
        first = last + 1;
        if first > 50 {
            size = first - 1;
        }
    }
    windows
}

/// The late joiner's report: its requests (by `assigned`, the frontend of each request) in
/// windows since the join, each next to the other frontends' requests over the same trace time.
fn join_report(
    config: &ReplayConfig,
    records: &[TraceRecord],
    served: &[Option<Served>],
    assigned: &[usize],
) -> Option<JoinReport> {
    let join = config.join?;
    let frontend = config.frontends.max(1) - 1;
    let mine: Vec<usize> = (0..records.len())
        .filter(|&i| assigned.get(i) == Some(&frontend))
        .collect();
    let secs = |i: usize| Duration::from_millis(records[i].timestamp).as_secs_f64();
    let windows: Vec<JoinWindow> = join_windows(mine.len())
        .into_iter()
        .map(|(first, last)| {
            let own = &mine[first - 1..last];
            let (from, to) = (
                records[own[0]].timestamp,
                records[own[own.len() - 1]].timestamp,
            );
            let (b, h) = tally(own.iter().filter_map(|&i| served[i].as_ref()));
            let others: Vec<usize> = (0..records.len())
                .filter(|&i| {
                    assigned.get(i).is_some_and(|&f| f != frontend)
                        && (from..=to).contains(&records[i].timestamp)
                })
                .collect();
            let (ob, oh) = tally(others.iter().filter_map(|&i| served[i].as_ref()));
            JoinWindow {
                first: first as u64,
                last: last as u64,
                from_s: secs(own[0]),
                to_s: secs(own[own.len() - 1]),
                joined_hit_rate: ratio(h, b),
                long_running_requests: others.len() as u64,
                long_running_hit_rate: ratio(oh, ob),
            }
        })
        .collect();
    // The first window from which none falls more than a point below.
    let close = |w: &JoinWindow| w.joined_hit_rate >= w.long_running_hit_rate - MATCH_POINTS;
    let settled = windows.iter().rposition(|w| !close(w)).map_or(0, |k| k + 1);
    Some(JoinReport {
        frontend,
        at_s: join.at.as_secs_f64(),
        snapshot: join.snapshot,
        requests: mine.len() as u64,
        requests_to_match: windows.get(settled).map(|w| w.last),
        windows,
    })
}

pub(crate) fn summarize(
    config: &ReplayConfig,
    records: &[TraceRecord],
    shared: &Shared,
    ttft: &[Option<Duration>],
    shed: &[bool],
    assigned: &[usize],
    virtual_s: f64,
) -> ReplayReport {
    let served = shared.served.lock();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (mut blocks, mut hits) = (0u64, 0u64);
    let mut deciles = Vec::new();
    let tenth = records.len().div_ceil(10).max(1);
    for chunk in served.chunks(tenth) {
        let (b, h) = tally(chunk.iter().flatten());
        blocks += b;
        hits += h;
        deciles.push(ratio(h, b));
    }
    // Lost: no first token, or no prefill on record, and not refused as overloaded.
    let is_lost = |i: usize| (ttft[i].is_none() || served[i].is_none()) && !shed[i];
    let lost = (0..records.len()).filter(|&i| is_lost(i)).count() as u64;
    let skipped = served.iter().flatten().filter(|s| s.local).count() as u64;
    let prefill_tokens: Vec<u64> = shared
        .workers
        .lock()
        .values()
        .map(|w| w.prefill_tokens.load(Ordering::Relaxed))
        .collect();
    let max = prefill_tokens.iter().copied().max().unwrap_or(0);
    let total: u64 = prefill_tokens.iter().sum();
    #[allow(clippy::cast_precision_loss)] // token counts far below 2^52
    let work_imbalance = if total == 0 {
        1.0
    } else {
        max as f64 * prefill_tokens.len() as f64 / total as f64
    };
    let prefix_hit_rate = ratio(hits, blocks);
    // At the run's block size: a block is cached whole or not at all.
    let ceiling = ceiling_of(shared.keys.iter().map(Vec::as_slice));
    let event = config.event.map(|event| {
        let at = event.at();
        let window = |from: Duration, to: Duration| {
            let inside: Vec<usize> = (0..records.len())
                .filter(|&i| {
                    let t = Duration::from_millis(records[i].timestamp);
                    t >= from && t < to
                })
                .collect();
            let (b, h) = tally(inside.iter().filter_map(|&i| served[i].as_ref()));
            Window {
                requests: inside.len() as u64,
                lost: inside.iter().filter(|&&i| is_lost(i)).count() as u64,
                prefix_hit_rate: ratio(h, b),
                ttft_ms: Percentiles::of(inside.iter().filter_map(|&i| ttft[i]).map(ms).collect()),
            }
        };
        EventReport {
            kind: match event {
                PoolEvent::Retarget { .. } => "retarget",
                PoolEvent::Flap { rebuild: false, .. } => "flap",
                PoolEvent::Flap { rebuild: true, .. } => "flap-rebuild",
            }
            .to_owned(),
            at_s: at.as_secs_f64(),
            before: window(at.saturating_sub(EVENT_WINDOW), at),
            after: window(at, at + EVENT_WINDOW),
        }
    });
    ReplayReport {
        policy: config.policy_name(),
        workers: config.workers,
        frontends: config.frontends.max(1),
        spread: config.spread.name().to_owned(),
        cache_blocks: config.cache_blocks,
        block_tokens: config.block_tokens,
        closed_loop: config.closed_loop.map(|c| {
            let think = u64::try_from(c.think.as_millis()).unwrap_or(u64::MAX);
            (c.users, think)
        }),
        requests: records.len() as u64,
        lost,
        shed: shed.iter().filter(|&&s| s).count() as u64,
        prompt_blocks: blocks,
        cached_blocks: hits,
        prefix_hit_rate,
        ceiling,
        of_ceiling: if ceiling > 0.0 {
            prefix_hit_rate / ceiling
        } else {
            0.0
        },
        ttft_ms: Percentiles::of(ttft.iter().flatten().map(|&d| ms(d)).collect()),
        ttft_cdf_ms: quantiles(ttft.iter().flatten().map(|&d| ms(d)).collect()),
        queue_ms: Percentiles::of(
            served
                .iter()
                .flatten()
                .filter(|s| !s.local)
                .map(|s| ms(s.queue))
                .collect(),
        ),
        conditional: config.conditional.map(|c| conditional_label(&c)),
        affinity: config.session_affinity.map(|ttl| {
            let stats = shared.affinity.snapshot();
            AffinityReport {
                ttl_s: ttl.as_secs_f64(),
                hits: stats.hits,
                misses: stats.misses,
                repicks: stats.repicks,
                evictions: stats.evictions,
            }
        }),
        skipped,
        skipped_share: ratio(skipped, records.len() as u64),
        work_share: prefill_tokens.iter().map(|&t| ratio(t, total)).collect(),
        prefill_tokens,
        work_imbalance,
        hit_rate_by_decile: deciles,
        event,
        join: join_report(config, records, &served, assigned),
        bindings_built: shared.builds.load(Ordering::Relaxed),
        stale_credit: shared.stale_credit.load(Ordering::Relaxed),
        virtual_s,
        wall_s: 0.0,
        requests_per_s: 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::join_windows;

    #[test]
    fn join_windows_are_25_25_50_then_doubling_and_end_with_the_last_request() {
        assert_eq!(
            join_windows(1_000),
            vec![
                (1, 25),
                (26, 50),
                (51, 100),
                (101, 200),
                (201, 400),
                (401, 800),
                (801, 1_000)
            ]
        );
        assert_eq!(join_windows(30), vec![(1, 25), (26, 30)]);
        assert!(join_windows(0).is_empty());
    }
}
