//! A picture of replay reports as hand-written SVG text (no plotting dependency): the TTFT
//! CDF per policy (log time axis) and the hit rate per tenth of the trace against the ceiling.

use std::fmt::Write;

use super::report::ReplayReport;

const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];
const W: f64 = 420.0;
const H: f64 = 260.0;
const PAD: f64 = 50.0;

/// Both panels side by side, one line per report, titled `title`.
pub fn svg(title: &str, reports: &[ReplayReport]) -> String {
    let mut out = String::new();
    let width = 2.0 * (W + PAD) + PAD;
    let height = H + 2.0 * PAD + 20.0 * reports.len() as f64;
    let _ = writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{height:.0}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" \
         fill=\"white\"/>\n<text x=\"{PAD}\" y=\"20\" font-size=\"14\">{}</text>",
        escape(title)
    );
    cdf_panel(&mut out, PAD, reports);
    hit_panel(&mut out, 2.0 * PAD + W, reports);
    for (i, r) in reports.iter().enumerate() {
        let y = H + 2.0 * PAD + 20.0 * i as f64;
        let _ = writeln!(
            out,
            "<rect x=\"{PAD}\" y=\"{:.0}\" width=\"12\" height=\"12\" fill=\"{}\"/><text \
             x=\"{:.0}\" y=\"{:.0}\">{}: hit rate {:.2}% of blocks (ceiling {:.2}%), TTFT p50 \
             {:.0} ms, p99 {:.0} ms, work max/mean {:.3}</text>",
            y - 10.0,
            COLORS[i % COLORS.len()],
            PAD + 18.0,
            y,
            escape(&r.label()),
            r.prefix_hit_rate * 100.0,
            r.ceiling * 100.0,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.work_imbalance
        );
    }
    out.push_str("</svg>\n");
    out
}

fn frame(out: &mut String, x0: f64, label: &str, x_label: &str, y_label: &str) {
    let _ = writeln!(
        out,
        "<rect x=\"{x0}\" y=\"{PAD}\" width=\"{W}\" height=\"{H}\" fill=\"none\" \
         stroke=\"#888\"/>\n<text x=\"{x0}\" y=\"{:.0}\">{label}</text>\n<text x=\"{:.0}\" \
         y=\"{:.0}\" text-anchor=\"middle\">{x_label}</text>\n<text x=\"{:.0}\" y=\"{:.0}\" \
         transform=\"rotate(-90 {:.0} {:.0})\" text-anchor=\"middle\">{y_label}</text>",
        PAD - 8.0,
        x0 + W / 2.0,
        PAD + H + 32.0,
        x0 - 34.0,
        PAD + H / 2.0,
        x0 - 34.0,
        PAD + H / 2.0
    );
}

fn cdf_panel(out: &mut String, x0: f64, reports: &[ReplayReport]) {
    frame(
        out,
        x0,
        "TTFT CDF",
        "TTFT (ms, log scale)",
        "fraction of requests",
    );
    let max = reports
        .iter()
        .filter_map(|r| r.ttft_cdf_ms.last().copied())
        .fold(10.0_f64, f64::max);
    let (lo, hi) = (1.0_f64, max.log10().ceil().max(1.0));
    let x = |ms: f64| x0 + (ms.max(10f64.powf(lo)).log10() - lo) / (hi - lo) * W;
    let y = |q: f64| PAD + H - q * H;
    // Decades on the time axis, quarters on the fraction axis.
    #[allow(clippy::cast_possible_truncation)] // a handful of decades
    for d in (lo as i32)..=(hi as i32) {
        let ms = 10f64.powi(d);
        decade_line(out, x(ms), ms);
    }
    axis_fractions(out, (x0, W), &y, 1.0);
    for (i, r) in reports.iter().enumerate() {
        let points: Vec<String> = r
            .ttft_cdf_ms
            .iter()
            .enumerate()
            .map(|(k, &ms)| format!("{:.1},{:.1}", x(ms), y((k + 1) as f64 / 100.0)))
            .collect();
        polyline(out, &points, COLORS[i % COLORS.len()], "");
    }
}

fn hit_panel(out: &mut String, x0: f64, reports: &[ReplayReport]) {
    frame(
        out,
        x0,
        "Prefix hit rate per tenth of the trace (dashed: ceiling)",
        "tenth of the requests, in arrival order",
        "hit rate",
    );
    let top = reports
        .iter()
        .flat_map(|r| r.hit_rate_by_decile.iter().copied().chain([r.ceiling]))
        .fold(0.1_f64, f64::max)
        .min(1.0)
        * 1.1;
    let y = |rate: f64| PAD + H - rate / top * H;
    axis_fractions(out, (x0, W), &y, top);
    for (i, r) in reports.iter().enumerate() {
        let n = r.hit_rate_by_decile.len().max(2) - 1;
        let points: Vec<String> = r
            .hit_rate_by_decile
            .iter()
            .enumerate()
            .map(|(k, &h)| format!("{:.1},{:.1}", x0 + k as f64 / n as f64 * W, y(h)))
            .collect();
        polyline(out, &points, COLORS[i % COLORS.len()], "");
    }
    if let Some(c) = reports.first().map(|r| r.ceiling) {
        let points = [
            format!("{x0:.1},{:.1}", y(c)),
            format!("{:.1},{:.1}", x0 + W, y(c)),
        ];
        polyline(out, &points, "#000", " stroke-dasharray=\"6 4\"");
    }
}

/// A vertical grid line at `x`, labelled `label` under the plot (a decade of a log axis).
fn decade_line(out: &mut String, x: f64, label: impl std::fmt::Display) {
    let _ = writeln!(
        out,
        "<line x1=\"{x:.1}\" y1=\"{PAD}\" x2=\"{x:.1}\" y2=\"{:.0}\" stroke=\"#ddd\"/><text \
         x=\"{x:.1}\" y=\"{:.0}\" text-anchor=\"middle\">{label}</text>",
        PAD + H,
        PAD + H + 14.0
    );
}

/// Five percent grid lines and labels from 0 to `top`, over the plot that starts at `x0` and is
/// `width` wide.
fn axis_fractions(out: &mut String, (x0, width): (f64, f64), y: &dyn Fn(f64) -> f64, top: f64) {
    for k in 0..=4 {
        let v = top * f64::from(k) / 4.0;
        let _ = writeln!(
            out,
            "<line x1=\"{x0}\" y1=\"{0:.1}\" x2=\"{1:.0}\" y2=\"{0:.1}\" stroke=\"#eee\"/><text \
             x=\"{2:.0}\" y=\"{3:.1}\" text-anchor=\"end\">{4:.0}%</text>",
            y(v),
            x0 + width,
            x0 - 4.0,
            y(v) + 4.0,
            v * 100.0
        );
    }
}

fn polyline(out: &mut String, points: &[String], color: &str, extra: &str) {
    let _ = writeln!(
        out,
        "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"{extra} points=\"{}\"/>",
        points.join(" ")
    );
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A picture of late joins (`--join-at`): per report, the joined frontend's hit rate per
/// window of its requests since the join (solid steps, log request axis) and the long-running
/// frontends' over the same trace time (dashed, same colour), titled `title`. Reports without
/// a join are left out.
pub fn join_svg(title: &str, reports: &[ReplayReport]) -> String {
    let joins: Vec<(&ReplayReport, &super::report::JoinReport)> = reports
        .iter()
        .filter_map(|r| Some((r, r.join.as_ref()?)))
        .collect();
    let mut out = String::new();
    let width = W * 2.0 + 2.0 * PAD;
    let height = H + 2.0 * PAD + 20.0 * joins.len() as f64 + 10.0;
    let _ = writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{height:.0}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" \
         fill=\"white\"/>\n<text x=\"{PAD}\" y=\"20\" font-size=\"14\">{}</text>",
        escape(title)
    );
    let plot_w = W * 2.0;
    let _ = writeln!(
        out,
        "<rect x=\"{PAD}\" y=\"{PAD}\" width=\"{plot_w}\" height=\"{H}\" fill=\"none\" \
         stroke=\"#888\"/>\n<text x=\"{PAD}\" y=\"{:.0}\">Prefix hit rate per window of the \
         joined frontend's requests (solid) and the long-running frontends' over the same \
         trace time (dashed)</text>\n<text x=\"{:.0}\" y=\"{:.0}\" \
         text-anchor=\"middle\">requests since the join (log scale)</text>\n<text x=\"{:.0}\" \
         y=\"{:.0}\" transform=\"rotate(-90 {:.0} {:.0})\" text-anchor=\"middle\">hit \
         rate</text>",
        PAD - 8.0,
        PAD + plot_w / 2.0,
        PAD + H + 32.0,
        PAD - 34.0,
        PAD + H / 2.0,
        PAD - 34.0,
        PAD + H / 2.0
    );
    let most = joins
        .iter()
        .filter_map(|(_, j)| j.windows.last().map(|w| w.last + 1))
        .max()
        .unwrap_or(2)
        .max(2);
    #[allow(clippy::cast_precision_loss)] // request counts far below 2^52
    let hi = (most as f64).log10();
    #[allow(clippy::cast_precision_loss)]
    let x = |n: u64| PAD + (n.max(1) as f64).log10() / hi * plot_w;
    let top = joins
        .iter()
        .flat_map(|(_, j)| {
            j.windows
                .iter()
                .flat_map(|w| [w.joined_hit_rate, w.long_running_hit_rate])
        })
        .fold(0.1_f64, f64::max)
        .min(1.0)
        * 1.1;
    let y = |rate: f64| PAD + H - rate / top * H;
    let mut tick = 1u64;
    while tick < most {
        decade_line(&mut out, x(tick), tick);
        tick *= 10;
    }
    axis_fractions(&mut out, (PAD, plot_w), &y, top);
    for (i, (r, j)) in joins.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        // Steps: each window's rate from its first request to past its last.
        let steps = |rate: &dyn Fn(&super::report::JoinWindow) -> f64| -> Vec<String> {
            j.windows
                .iter()
                .flat_map(|w| {
                    [
                        format!("{:.1},{:.1}", x(w.first), y(rate(w))),
                        format!("{:.1},{:.1}", x(w.last + 1), y(rate(w))),
                    ]
                })
                .collect()
        };
        polyline(&mut out, &steps(&|w| w.joined_hit_rate), color, "");
        polyline(
            &mut out,
            &steps(&|w| w.long_running_hit_rate),
            color,
            " stroke-dasharray=\"6 4\" stroke-opacity=\"0.6\"",
        );
        let reached = j.requests_to_match.map_or(String::new(), |n| {
            format!("; within 1 point by request {n}")
        });
        let first = j.windows.first();
        let ly = H + 2.0 * PAD + 20.0 * i as f64;
        let _ = writeln!(
            out,
            "<rect x=\"{PAD}\" y=\"{:.0}\" width=\"12\" height=\"12\" fill=\"{color}\"/><text \
             x=\"{:.0}\" y=\"{ly:.0}\">{}: first 25 requests {:.1}% (long-running {:.1}%)\
             {reached}</text>",
            ly - 10.0,
            PAD + 18.0,
            escape(&r.label()),
            first.map_or(0.0, |w| w.joined_hit_rate * 100.0),
            first.map_or(0.0, |w| w.long_running_hit_rate * 100.0),
        );
    }
    out.push_str("</svg>\n");
    out
}
