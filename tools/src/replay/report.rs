//! What a replay measured.

use std::fmt;

use serde::Serialize;

/// Summary statistics of a set of durations, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest value.
    pub max: f64,
}

/// The 1%, 2%, ..., 100% quantiles of `values` (nearest rank), in ms.
pub(crate) fn quantiles(mut values: Vec<f64>) -> Vec<f64> {
    if values.is_empty() {
        return Vec::new();
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    (1..=100)
        .map(|q| values[(q * n).div_ceil(100).clamp(1, n) - 1])
        .collect()
}

impl Percentiles {
    /// Of `values` (nearest-rank percentiles; all zero when empty).
    pub fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Percentiles::default();
        }
        values.sort_by(f64::total_cmp);
        let rank = |q: f64| {
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss
            )] // a rank within the vector's length
            let i = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1;
            values[i]
        };
        #[allow(clippy::cast_precision_loss)] // request counts far below 2^52
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        Percentiles {
            mean,
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: values[values.len() - 1],
        }
    }
}

/// Requests arriving in a window of trace time, and how they fared.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Window {
    /// Requests that arrived in the window.
    pub requests: u64,
    /// Of those, requests that did not complete.
    pub lost: u64,
    /// Their prefix hit rate, 0..1.
    pub prefix_hit_rate: f64,
    /// Their time to first token.
    pub ttft_ms: Percentiles,
}

/// Routing around a pool event (`--retarget-at`, `--flap-at`, `--flap-rebuild-at`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EventReport {
    /// `retarget`, `flap` (binding reused) or `flap-rebuild` (new binding).
    pub kind: String,
    /// Trace time of the event, in seconds.
    pub at_s: f64,
    /// The 60 s of arrivals before it.
    pub before: Window,
    /// The 60 s of arrivals from it on.
    pub after: Window,
}

/// How far a late-joining frontend's hit rate may stay below the long-running frontends' and
/// still count as having reached it: 1 point.
pub const MATCH_POINTS: f64 = 0.01;

/// A window of a late-joining frontend's requests, by their number since it joined, next to
/// the long-running frontends' requests over the same trace time.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JoinWindow {
    /// The window's first request since the join (1-based).
    pub first: u64,
    /// Its last request since the join (inclusive).
    pub last: u64,
    /// Trace time of the first request's arrival, in seconds.
    pub from_s: f64,
    /// Trace time of the last request's arrival, in seconds.
    pub to_s: f64,
    /// The joined frontend's prefix hit rate over the window's requests, 0..1.
    pub joined_hit_rate: f64,
    /// Requests the long-running frontends received from `from_s` to `to_s` (inclusive).
    pub long_running_requests: u64,
    /// Their prefix hit rate, 0..1.
    pub long_running_hit_rate: f64,
}

/// A late-joining frontend (`--join-at`): its hit rate since the join against the
/// long-running frontends'. Hit rates are [`ReplayReport::prefix_hit_rate`]'s: cached over
/// prompt blocks of the requests prefilled (block-weighted, leading hits in the serving
/// worker's cache).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JoinReport {
    /// The joined frontend (the last one, numbered from 0).
    pub frontend: usize,
    /// Trace time of the join, in seconds.
    pub at_s: f64,
    /// Whether it joined with the workers' KV snapshots (false: cold, live events only).
    pub snapshot: bool,
    /// Requests it received.
    pub requests: u64,
    /// Its requests in windows since the join: 1-25, 26-50, 51-100, then doubling (the last
    /// window ends with its last request).
    pub windows: Vec<JoinWindow>,
    /// The joined frontend's requests until it is within [`MATCH_POINTS`] of the long-running
    /// frontends: the last request of the first window from which every window's hit rate is
    /// at least theirs minus 1 point. `None`: its last window is still further below.
    pub requests_to_match: Option<u64>,
}

/// The result of one replay (one policy over one trace).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The routing policy (`kv`, `round-robin`, `random`, `dynamo`).
    pub policy: String,
    /// Prefill workers.
    pub workers: usize,
    /// Independent frontends routing over the pool (1: one router).
    pub frontends: usize,
    /// How requests were spread over the frontends (`round-robin` or `session`).
    pub spread: String,
    /// KV blocks of 512 tokens per worker (`None`: unbounded).
    pub cache_blocks: Option<usize>,
    /// Tokens per KV block of the router and the workers.
    pub block_tokens: u32,
    /// Closed-loop arrivals as `(users, think ms)` (`None`: the trace's timestamps).
    pub closed_loop: Option<(usize, u64)>,
    /// Requests replayed.
    pub requests: u64,
    /// Requests that did not complete (prefill or decode failed, or the hop rejected them),
    /// shed requests not included.
    pub lost: u64,
    /// Requests that failed with the typed overload error (every worker over the busy
    /// threshold for the whole overload wait): refused with a reason, not lost.
    pub shed: u64,
    /// Prompt blocks (`hash_ids`) of the prefilled requests.
    pub prompt_blocks: u64,
    /// Of those, blocks found in the serving worker's cache (leading hits).
    pub cached_blocks: u64,
    /// `cached_blocks / prompt_blocks`, 0..1.
    pub prefix_hit_rate: f64,
    /// The trace's ceiling: the hit rate of one infinite cache shared by all workers, 0..1.
    pub ceiling: f64,
    /// `prefix_hit_rate / ceiling`.
    pub of_ceiling: f64,
    /// Time to first token: arrival to the first token, in ms of virtual time.
    pub ttft_ms: Percentiles,
    /// Queueing delay: arrival at the prefill worker to the start of its prefill, in ms
    /// (requests prefilled on the prefill pool only).
    pub queue_ms: Percentiles,
    /// The conditional disaggregation policy (`short<N`, `busy>M`), if any.
    pub conditional: Option<String>,
    /// Requests the conditional policy sent to decode whole (prefilled on the decode pool;
    /// their blocks count in `prompt_blocks` with no hits).
    pub skipped: u64,
    /// `skipped / requests`.
    pub skipped_share: f64,
    /// Session affinity's outcomes, if the replay ran with it.
    pub affinity: Option<AffinityReport>,
    /// Uncached prompt tokens each worker prefilled, by worker id.
    pub prefill_tokens: Vec<u64>,
    /// Max over mean of `prefill_tokens` (1 = perfectly balanced).
    pub work_imbalance: f64,
    /// Each worker's share of the prefill work (`prefill_tokens` over their sum, 0..1; all 0
    /// when nothing was prefilled), in worker order.
    pub work_share: Vec<f64>,
    /// The TTFT distribution: entry *i* is the `(i + 1)`% quantile in ms (100 entries; empty
    /// when nothing completed). What the SVG's CDF is drawn from.
    pub ttft_cdf_ms: Vec<f64>,
    /// Hit rate per tenth of the requests (in arrival order): how it evolves over the trace.
    pub hit_rate_by_decile: Vec<f64>,
    /// Routing around the pool event, if the replay had one.
    pub event: Option<EventReport>,
    /// The late-joining frontend, if the replay had one.
    pub join: Option<JoinReport>,
    /// Bindings the router had built by the end (1 without events).
    pub bindings_built: u64,
    /// Selections (policy `kv-events`) where the index credited the picked worker with more
    /// leading blocks than its cache held at that moment: stale credit, which lost or delayed
    /// event batches can cause and fault-free delivery never does.
    pub stale_credit: u64,
    /// Virtual time the replay covered, in seconds.
    pub virtual_s: f64,
    /// Wall-clock time the replay took, in seconds.
    pub wall_s: f64,
    /// Requests replayed per wall-clock second.
    pub requests_per_s: f64,
}

impl ReplayReport {
    /// The run's name: the policy, with its conditional policy and affinity TTL if any
    /// (`round-robin, affinity 600 s`).
    pub fn label(&self) -> String {
        let conditional = self
            .conditional
            .as_ref()
            .map(|c| format!(", conditional {c}"))
            .unwrap_or_default();
        let affinity = self
            .affinity
            .as_ref()
            .map(|a| format!(", affinity {:.0} s", a.ttl_s))
            .unwrap_or_default();
        let frontends = if self.frontends > 1 {
            format!(", {} frontends ({})", self.frontends, self.spread)
        } else {
            String::new()
        };
        let join = self
            .join
            .as_ref()
            .map(|j| {
                format!(
                    ", last joins at {:.0} s {}",
                    j.at_s,
                    if j.snapshot { "with snapshot" } else { "cold" }
                )
            })
            .unwrap_or_default();
        format!("{}{conditional}{affinity}{frontends}{join}", self.policy)
    }
}

impl fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<11} requests {:>6} lost {} shed {} | hit rate {:.2}% (ceiling {:.2}%, {:.1}% of it) | \
             TTFT ms p50 {:.0} p90 {:.0} p99 {:.0} | queue ms p50 {:.0} p99 {:.0} | \
             imbalance {:.3} (work % {}) | {:.2} s wall, {:.0} req/s",
            self.policy,
            self.requests,
            self.lost,
            self.shed,
            self.prefix_hit_rate * 100.0,
            self.ceiling * 100.0,
            self.of_ceiling * 100.0,
            self.ttft_ms.p50,
            self.ttft_ms.p90,
            self.ttft_ms.p99,
            self.queue_ms.p50,
            self.queue_ms.p99,
            self.work_imbalance,
            self.work_share
                .iter()
                .map(|s| format!("{:.1}", s * 100.0))
                .collect::<Vec<_>>()
                .join("/"),
            self.wall_s,
            self.requests_per_s,
        )?;
        if self.frontends > 1 {
            write!(
                f,
                "\n            {} frontends, requests spread {}",
                self.frontends, self.spread
            )?;
        }
        if let Some(c) = &self.conditional {
            write!(
                f,
                "\n            conditional {c}: {} skipped to decode ({:.1}%)",
                self.skipped,
                self.skipped_share * 100.0
            )?;
        }
        if let Some(a) = &self.affinity {
            write!(
                f,
                "\n            affinity ttl {:.0} s: {} hits, {} misses, {} re-picks, {} evictions",
                a.ttl_s, a.hits, a.misses, a.repicks, a.evictions
            )?;
        }
        if let Some(j) = &self.join {
            write!(
                f,
                "\n            frontend {} joined at {:.0} s ({}): {} requests; hit rate since the \
                 join vs the long-running frontends over the same trace time:",
                j.frontend,
                j.at_s,
                if j.snapshot { "KV snapshot" } else { "cold" },
                j.requests
            )?;
            for w in &j.windows {
                write!(
                    f,
                    "\n              requests {:>4}-{:<4} ({:>4.0}-{:>4.0} s): joined {:>6.2}%, \
                     long-running {:>6.2}% ({} requests)",
                    w.first,
                    w.last,
                    w.from_s,
                    w.to_s,
                    w.joined_hit_rate * 100.0,
                    w.long_running_hit_rate * 100.0,
                    w.long_running_requests
                )?;
            }
            match j.requests_to_match {
                Some(n) => write!(
                    f,
                    "\n              within {:.0} point of the long-running frontends by its request \
                     {n} (and in every window after it)",
                    MATCH_POINTS * 100.0
                )?,
                None => write!(
                    f,
                    "\n              never within {:.0} point of the long-running frontends for \
                     good (its last window is further below)",
                    MATCH_POINTS * 100.0
                )?,
            }
        }
        if let Some(e) = &self.event {
            write!(
                f,
                "\n            {} at {:.0} s ({} bindings built): 60 s before: hit rate {:.2}%, \
                 TTFT p50 {:.0} p99 {:.0} ms; 60 s after: hit rate {:.2}%, TTFT p50 {:.0} p99 \
                 {:.0} ms, lost {}",
                e.kind,
                e.at_s,
                self.bindings_built,
                e.before.prefix_hit_rate * 100.0,
                e.before.ttft_ms.p50,
                e.before.ttft_ms.p99,
                e.after.prefix_hit_rate * 100.0,
                e.after.ttft_ms.p50,
                e.after.ttft_ms.p99,
                e.after.lost,
            )?;
        }
        Ok(())
    }
}

/// Session affinity over one replay (all bindings together).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AffinityReport {
    /// The TTL of a session's entry, in seconds.
    pub ttl_s: f64,
    /// Requests sent to their session's remembered worker.
    pub hits: u64,
    /// Requests whose session had no live entry (new, or expired): picked by the policy.
    pub misses: u64,
    /// Requests whose remembered worker was no longer routable: picked again, entry moved.
    pub repicks: u64,
    /// Entries evicted by the table's capacity.
    pub evictions: u64,
}
