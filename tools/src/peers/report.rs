//! The head-to-head's results: one row per router, workload and loop, as a line while it runs,
//! a markdown table and a JSON line per row at the end, and an SVG of TTFT p99.

use std::fmt::Write as _;
use std::time::Duration;

use super::client::Outcome;
use super::routers::RouterSpec;

/// One router's figures on one workload and loop.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// `router/policy`.
    pub router: String,
    /// The workload's name.
    pub workload: String,
    /// The loop's name.
    pub mode: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub failed: usize,
    /// Time to first token, p50 and p99 (successful requests).
    pub ttft_p50: Option<Duration>,
    /// See `ttft_p50`.
    pub ttft_p99: Option<Duration>,
    /// End to end, p99.
    pub e2e_p99: Option<Duration>,
    /// Successful requests per second over the run.
    pub throughput: f64,
    /// The prefill engines' prefix-cache hit rate over the run (tokens), as they report it.
    pub hit_rate: Option<f64>,
    /// The router's CPU seconds over the run (its whole process tree).
    pub cpu_seconds: f64,
    /// The router's peak resident memory (whole tree), bytes.
    pub peak_rss_bytes: u64,
    /// Requests whose text equals the first router's (`None`: this is the first).
    pub same_output: Option<usize>,
    /// What went wrong or differs, if anything.
    pub notes: Vec<String>,
}

/// The `q` quantile of sorted `values` (nearest rank).
pub fn quantile(sorted: &[Duration], q: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(
        || "-".into(),
        |d| format!("{:.0}", d.as_secs_f64() * 1000.0),
    )
}

impl Row {
    /// An empty row for `spec` on `workload` under `mode`.
    pub fn new(spec: RouterSpec, workload: &str, mode: &str) -> Self {
        Row {
            router: spec.label(),
            workload: workload.to_owned(),
            mode: mode.to_owned(),
            requests: 0,
            failed: 0,
            ttft_p50: None,
            ttft_p99: None,
            e2e_p99: None,
            throughput: 0.0,
            hit_rate: None,
            cpu_seconds: 0.0,
            peak_rss_bytes: 0,
            same_output: None,
            notes: Vec::new(),
        }
    }

    /// Fill the latency and throughput figures from what the requests saw over `wall`.
    pub fn fill(&mut self, outcomes: &[Outcome], wall: Duration) {
        self.requests = outcomes.len();
        self.failed = outcomes.iter().filter(|o| !o.ok()).count();
        let mut ttft: Vec<Duration> = outcomes
            .iter()
            .filter(|o| o.ok())
            .filter_map(|o| o.ttft)
            .collect();
        let mut e2e: Vec<Duration> = outcomes.iter().filter(|o| o.ok()).map(|o| o.e2e).collect();
        ttft.sort();
        e2e.sort();
        self.ttft_p50 = quantile(&ttft, 0.5);
        self.ttft_p99 = quantile(&ttft, 0.99);
        self.e2e_p99 = quantile(&e2e, 0.99);
        #[allow(clippy::cast_precision_loss)]
        {
            self.throughput = (self.requests - self.failed) as f64 / wall.as_secs_f64().max(1e-9);
        }
        if let Some(first) = outcomes.iter().find_map(|o| o.error.clone()) {
            self.notes.push(format!("first failure: {first}"));
        }
    }

    /// CPU milliseconds per request sent.
    pub fn cpu_ms_per_request(&self) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let n = self.requests.max(1) as f64;
        self.cpu_seconds * 1000.0 / n
    }

    /// One line for the run's progress.
    pub fn line(&self) -> String {
        format!(
            "{} {} [{}]: ttft p50 {} ms p99 {} ms, e2e p99 {} ms, {:.2} req/s, hit {}, failed {}/{}, cpu {:.2} ms/req, rss {:.0} MB",
            self.workload,
            self.router,
            self.mode,
            ms(self.ttft_p50),
            ms(self.ttft_p99),
            ms(self.e2e_p99),
            self.throughput,
            self.hit_rate.map_or_else(|| "-".into(), |h| format!("{h:.3}")),
            self.failed,
            self.requests,
            self.cpu_ms_per_request(),
            self.peak_rss_bytes as f64 / 1e6,
        )
    }

    /// The row as one JSON object.
    pub fn json(&self) -> serde_json::Value {
        let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1000.0);
        serde_json::json!({
            "router": self.router, "workload": self.workload, "mode": self.mode,
            "requests": self.requests, "failed": self.failed,
            "ttft_p50_ms": ms(self.ttft_p50), "ttft_p99_ms": ms(self.ttft_p99),
            "e2e_p99_ms": ms(self.e2e_p99), "throughput": self.throughput,
            "hit_rate": self.hit_rate, "cpu_seconds": self.cpu_seconds,
            "cpu_ms_per_request": self.cpu_ms_per_request(),
            "peak_rss_bytes": self.peak_rss_bytes, "same_output": self.same_output,
            "notes": self.notes,
        })
    }
}

/// The rows as a markdown table.
pub fn markdown(rows: &[Row]) -> String {
    let mut out = String::from(
        "| workload | loop | router | TTFT p50 ms | TTFT p99 ms | e2e p99 ms | req/s | hit rate | failed | CPU s / 1k req | peak RSS MB | same output |\n\
         |---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {:.2} | {} | {}/{} | {:.2} | {:.0} | {} |",
            r.workload,
            r.mode,
            r.router,
            ms(r.ttft_p50),
            ms(r.ttft_p99),
            ms(r.e2e_p99),
            r.throughput,
            r.hit_rate.map_or_else(|| "-".into(), |h| format!("{h:.3}")),
            r.failed,
            r.requests,
            r.cpu_ms_per_request(),
            r.peak_rss_bytes as f64 / 1e6,
            r.same_output
                .map_or_else(|| "(reference)".into(), |n| format!("{n}/{}", r.requests)),
        );
    }
    out
}

/// Grouped bars of TTFT p99 per workload and loop, one bar per router, as an SVG document.
pub fn svg(rows: &[Row], title: &str) -> String {
    const COLORS: [&str; 7] = [
        "#1b7837", "#7fbf7b", "#2166ac", "#92c5de", "#b2182b", "#f4a582", "#d6604d",
    ];
    let mut groups: Vec<(String, Vec<&Row>)> = Vec::new();
    for row in rows {
        let key = format!("{} ({})", row.workload, row.mode);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(row),
            None => groups.push((key, vec![row])),
        }
    }
    let mut routers: Vec<&str> = Vec::new();
    for row in rows {
        if !routers.contains(&row.router.as_str()) {
            routers.push(&row.router);
        }
    }
    let max = rows
        .iter()
        .filter_map(|r| r.ttft_p99)
        .map(|d| d.as_secs_f64() * 1000.0)
        .fold(1.0_f64, f64::max);
    let (bar, gap, left, top, height) = (14.0, 26.0, 60.0, 40.0, 260.0);
    #[allow(clippy::cast_precision_loss)]
    let group_width = routers.len() as f64 * bar + gap;
    #[allow(clippy::cast_precision_loss)]
    let width = left + groups.len() as f64 * group_width + 200.0;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{:.0}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <text x=\"{left}\" y=\"20\" font-size=\"14\">{title}</text>\n\
         <text x=\"12\" y=\"{:.0}\" transform=\"rotate(-90 12 {:.0})\">TTFT p99 (ms)</text>\n",
        top + height + 70.0,
        top + height / 2.0,
        top + height / 2.0
    );
    for tick in 0..=4 {
        let value = max * f64::from(tick) / 4.0;
        let y = top + height - height * f64::from(tick) / 4.0;
        let _ = writeln!(
            out,
            "<line x1=\"{left}\" y1=\"{y:.1}\" x2=\"{:.0}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{:.0}\" y=\"{:.1}\" text-anchor=\"end\">{value:.0}</text>",
            width - 200.0,
            left - 4.0,
            y + 4.0
        );
    }
    for (g, (key, members)) in groups.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let x0 = left + gap / 2.0 + g as f64 * group_width;
        for row in members {
            let Some(k) = routers.iter().position(|r| *r == row.router) else {
                continue;
            };
            let Some(p99) = row.ttft_p99 else { continue };
            let h = height * p99.as_secs_f64() * 1000.0 / max;
            #[allow(clippy::cast_precision_loss)]
            let x = x0 + k as f64 * bar;
            let _ = writeln!(
                out,
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"{}\"><title>{} {key}: {:.0} ms</title></rect>",
                top + height - h,
                bar - 2.0,
                COLORS[k % COLORS.len()],
                row.router,
                p99.as_secs_f64() * 1000.0
            );
        }
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.0}\" text-anchor=\"end\" transform=\"rotate(-30 {:.1} {:.0})\">{key}</text>",
            x0 + group_width / 2.0,
            top + height + 16.0,
            x0 + group_width / 2.0,
            top + height + 16.0
        );
    }
    for (k, router) in routers.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let y = top + 14.0 * k as f64;
        let x = width - 190.0;
        let _ = writeln!(
            out,
            "<rect x=\"{x:.0}\" y=\"{y:.0}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{:.0}\" y=\"{:.0}\">{router}</text>",
            COLORS[k % COLORS.len()],
            x + 14.0,
            y + 9.0
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(ttft_ms: u64, ok: bool) -> Outcome {
        Outcome {
            ttft: Some(Duration::from_millis(ttft_ms)),
            e2e: Duration::from_millis(ttft_ms * 2),
            text: "x".into(),
            error: (!ok).then(|| "HTTP 500".to_owned()),
        }
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let sorted: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(quantile(&sorted, 0.5), Some(Duration::from_millis(50)));
        assert_eq!(quantile(&sorted, 0.99), Some(Duration::from_millis(99)));
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn failed_requests_are_counted_and_left_out_of_the_latencies() {
        let spec = RouterSpec::ALL[0];
        let mut row = Row::new(spec, "w", "open");
        row.fill(
            &[outcome(10, true), outcome(20, true), outcome(9000, false)],
            Duration::from_secs(2),
        );
        assert_eq!((row.requests, row.failed), (3, 1));
        assert_eq!(row.ttft_p99, Some(Duration::from_millis(20)));
        assert!((row.throughput - 1.0).abs() < 1e-9);
        assert!(row.notes[0].contains("HTTP 500"));
        let table = markdown(&[row.clone()]);
        assert!(table.contains("| w | open | prefill-router/kv | 10 | 20 | 40 |"));
        let picture = svg(&[row], "t");
        assert!(picture.starts_with("<svg") && picture.contains("20 ms"));
    }
}
