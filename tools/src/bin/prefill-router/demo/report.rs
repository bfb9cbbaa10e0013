//! The summary table.

use std::time::Duration;

use super::traffic::Sample;

/// One row of the summary.
pub struct Row {
    /// What was measured.
    pub label: String,
    /// The phase's samples.
    pub samples: Vec<Sample>,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

impl Row {
    /// TTFT p50 and p99.
    pub fn ttft(&self) -> (Duration, Duration) {
        let mut ttfts: Vec<Duration> = self.samples.iter().map(|s| s.ttft).collect();
        ttfts.sort();
        (percentile(&ttfts, 0.50), percentile(&ttfts, 0.99))
    }

    /// Cached over whole prompt blocks, for requests that went through prefill.
    pub fn hit_rate(&self) -> Option<f64> {
        let (cached, total) = self
            .samples
            .iter()
            .filter(|s| s.prefill_worker.is_some())
            .fold((0u64, 0u64), |(c, t), s| {
                (
                    c + u64::from(s.cached_blocks),
                    t + u64::from(s.prompt_blocks),
                )
            });
        #[allow(clippy::cast_precision_loss)]
        (total > 0).then(|| cached as f64 / total as f64)
    }
}

/// Print the table.
pub fn print(rows: &[Row]) {
    println!();
    println!(
        "{:<34} {:>8} {:>8} {:>8} {:>11} {:>11} {:>10}",
        "phase", "requests", "prefill", "bypass", "TTFT p50", "TTFT p99", "prefix hit"
    );
    println!("{}", "-".repeat(96));
    for row in rows {
        let (p50, p99) = row.ttft();
        let prefill = row
            .samples
            .iter()
            .filter(|s| s.prefill_worker.is_some())
            .count();
        let hit = row
            .hit_rate()
            .map_or_else(|| "-".to_owned(), |r| format!("{:.1}%", r * 100.0));
        println!(
            "{:<34} {:>8} {:>8} {:>8} {:>11} {:>11} {:>10}",
            row.label,
            row.samples.len(),
            prefill,
            row.samples.len() - prefill,
            ms(p50),
            ms(p99),
            hit
        );
    }
}
