//! # A small SVG line chart, for loss curves
//!
//! Two panels sharing the step axis. `converge`'s: the curves themselves, and below them each
//! curve's distance from the first one on a log scale, where a parallel run that matches the
//! single-rank run shows up as a line near the bottom. `train --plot`'s: the training loss and
//! the held-out loss, and below them the learning rate. Steps are numbered from 1 here, as the
//! progress line counts them (step 1 is the first step done; the metrics file's `step` field and
//! the CSV count from 0, so that resume and `converge` read them unchanged).

use std::fmt::Write;

const BAND: &str = "#9be39b";
const COLORS: [&str; 8] = ["#222222", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b"];
// the canvas's least width, its height, the panels' left and right edges, the top of the first
// panel, a panel's height, the gap between panels; the legend is right of the panels
const W: f64 = 900.0;
const H: f64 = 660.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 650.0;
const TOP: f64 = 50.0;
const PANEL: f64 = 250.0;
const GAP: f64 = 70.0;
const LEGEND: f64 = RIGHT + 20.0;

/// The opening of a chart: as wide as its title and legend need (each measured by `text_width`),
/// and as tall as its legend, a line a curve.
fn canvas(title: &str, names: &[(&str, &str)]) -> String {
    let legend = names.iter().map(|(n, _)| LEGEND + 26.0 + text_width(n, 12.0)).fold(0.0, f64::max);
    let width = W.max(LEFT + text_width(title, 14.0)).max(legend) + 10.0;
    let height = H.max(TOP + 16.0 * names.len() as f64 + 20.0);
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{LEFT}\" y=\"20\" font-size=\"14\">{}</text>\n",
        escape(title)
    )
}

/// `curves[0]` is the reference; all curves are indexed by step. `allowed` is what passes at each
/// step (`converge`'s criterion: the tolerance, or the band a harmless change opened), drawn in
/// the lower panel as the shaded region a curve must stay in, with the tolerance as a dotted line.
pub fn loss_chart(title: &str, curves: &[(String, Vec<f32>)], (allowed, tol): (&[f32], f32)) -> String {
    let mut names: Vec<(&str, &str)> =
        curves.iter().enumerate().map(|(i, (name, _))| (name.as_str(), COLORS[i % COLORS.len()])).collect();
    names.push(("allowed |Δloss| (shaded)", BAND));
    names.push(("tolerance (dotted)", "#888888"));
    let mut svg = canvas(title, &names);
    let steps = curves.iter().map(|c| c.1.len()).max().unwrap_or(1).max(2);
    let all = curves.iter().flat_map(|c| c.1.iter().copied()).filter(|v| v.is_finite());
    let (lo, hi) = all.fold((f32::MAX, f32::MIN), |(a, b), v| (a.min(v), b.max(v)));
    let (lo, hi) = if lo < hi { (lo as f64, hi as f64) } else { (0.0, 1.0) };
    panel(&mut svg, TOP, "loss", steps, (lo, hi), &fmt_loss);
    for (i, (_, c)) in curves.iter().enumerate() {
        let pts: Vec<(usize, f64)> = c.iter().enumerate().map(|(s, &v)| (s, v as f64)).collect();
        polyline(&mut svg, TOP, steps, (lo, hi), &pts, COLORS[i % COLORS.len()], i == 0);
    }
    // |Δ| against the reference, log10, clamped at 1e-9
    let top2 = TOP + PANEL + GAP;
    let range = (-9.0, 0.0);
    let log = |d: f64| d.max(1e-9).log10().min(0.0);
    panel(&mut svg, top2, "|loss − reference| (log10)", steps, range, &|v| format!("1e{v:.0}"));
    // the region that passes: under the allowed line, down to the panel's floor
    let mut region: Vec<(usize, f64)> = allowed.iter().enumerate().map(|(s, &a)| (s, log(a as f64))).collect();
    if let (Some(&(first, _)), Some(&(last, _))) = (region.first(), region.last()) {
        region.extend([(last, range.0), (first, range.0)]);
        let points = coords(top2, steps, range, &region);
        let _ = writeln!(svg, "<polygon fill=\"{BAND}\" fill-opacity=\"0.35\" stroke=\"none\" points=\"{points}\"/>");
    }
    let y = top2 + PANEL * (1.0 - (log(tol as f64) - range.0) / (range.1 - range.0));
    let _ = writeln!(
        svg,
        "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{RIGHT}\" y2=\"{y:.1}\" stroke=\"#888888\" stroke-dasharray=\"2 3\"/>"
    );
    for (i, (_, c)) in curves.iter().enumerate().skip(1) {
        let pts: Vec<(usize, f64)> =
            c.iter().zip(&curves[0].1).enumerate().map(|(s, (&a, &b))| (s, log((a - b).abs() as f64))).collect();
        polyline(&mut svg, top2, steps, range, &pts, COLORS[i % COLORS.len()], false);
    }
    legend(&mut svg, &names);
    svg.push_str("</svg>\n");
    svg
}

/// A run's picture (`train --plot`): the training loss of steps `first..` and, where there was
/// validation, the loss on held-out data (points at their steps), and below them the learning
/// rate; `steps` is the run's `train.steps`.
pub fn run_chart(
    title: &str,
    (first, steps): (usize, usize),
    loss: &[f32],
    val: &[(usize, f32)],
    lr: &[f32],
) -> String {
    let mut names = vec![("training loss", COLORS[0])];
    if !val.is_empty() {
        names.push(("loss on held-out data", COLORS[2]));
    }
    names.push(("learning rate", COLORS[1]));
    let mut svg = canvas(title, &names);
    let steps = steps.max(2);
    let along = |values: &[f32]| -> Vec<(usize, f64)> {
        values.iter().enumerate().map(|(i, &v)| (first + i, v as f64)).collect()
    };
    let val: Vec<(usize, f64)> = val.iter().map(|&(s, v)| (s, v as f64)).collect();
    let range = |points: &[&[(usize, f64)]]| {
        let all = points.iter().flat_map(|p| p.iter().map(|q| q.1)).filter(|v| v.is_finite());
        let (lo, hi) = all.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
        if lo < hi {
            (lo, hi)
        } else {
            (lo.min(0.0), lo.max(0.0) + 1.0)
        }
    };
    let (loss, lr) = (along(loss), along(lr));
    let losses = range(&[&loss, &val]);
    panel(&mut svg, TOP, "loss", steps, losses, &fmt_loss);
    polyline(&mut svg, TOP, steps, losses, &loss, COLORS[0], true);
    if !val.is_empty() {
        polyline(&mut svg, TOP, steps, losses, &val, COLORS[2], false);
        for &(s, v) in &val {
            let (x, y) = at(TOP, steps, losses, s, v);
            let _ = writeln!(svg, "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{}\"/>", COLORS[2]);
        }
    }
    let top2 = TOP + PANEL + GAP;
    let rates = range(&[&lr]);
    panel(&mut svg, top2, "learning rate", steps, rates, &|v| format!("{v:.1e}"));
    polyline(&mut svg, top2, steps, rates, &lr, COLORS[1], true);
    legend(&mut svg, &names);
    svg.push_str("</svg>\n");
    svg
}

/// A line and a name for each curve, top right.
fn legend(svg: &mut String, names: &[(&str, &str)]) {
    for (i, (name, color)) in names.iter().enumerate() {
        let (x, y) = (LEGEND, TOP + 16.0 * i as f64 + 10.0);
        let _ = writeln!(
            svg,
            "<line x1=\"{x}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{color}\" stroke-width=\"3\"/>",
            x + 20.0
        );
        let _ = writeln!(svg, "<text x=\"{}\" y=\"{}\">{}</text>", x + 26.0, y + 4.0, escape(name));
    }
}

fn fmt_loss(v: f64) -> String {
    format!("{v:.2}")
}

/// A panel's frame, its value ticks, and its step ticks: the point of index i is step i + 1.
fn panel(svg: &mut String, top: f64, label: &str, steps: usize, (lo, hi): (f64, f64), fmt: &dyn Fn(f64) -> String) {
    let _ = writeln!(
        svg,
        "<rect x=\"{LEFT}\" y=\"{top}\" width=\"{}\" height=\"{PANEL}\" fill=\"none\" stroke=\"#999\"/>",
        RIGHT - LEFT
    );
    for k in 0..=4 {
        let v = lo + (hi - lo) * k as f64 / 4.0;
        let y = top + PANEL * (1.0 - k as f64 / 4.0);
        let _ = writeln!(svg, "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>", LEFT - 6.0, y + 4.0, fmt(v));
    }
    // five step ticks, each at a whole step (fewer where the run has fewer steps)
    let mut ticks: Vec<usize> = (0..=4).map(|k| ((steps - 1) as f64 * k as f64 / 4.0).round() as usize).collect();
    ticks.dedup();
    for s in ticks {
        let (x, _) = at(top, steps, (lo, hi), s, lo);
        let _ =
            writeln!(svg, "<text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>", top + PANEL + 16.0, s + 1);
    }
    let _ = writeln!(svg, "<text x=\"{LEFT}\" y=\"{}\">{} (x: step)</text>", top - 8.0, escape(label));
}

fn polyline(
    svg: &mut String,
    top: f64,
    steps: usize,
    range: (f64, f64),
    pts: &[(usize, f64)],
    color: &str,
    wide: bool,
) {
    let points = coords(top, steps, range, pts);
    let (width, dash) = if wide { (4.0, "") } else { (1.5, " stroke-dasharray=\"6 3\"") };
    let _ = writeln!(
        svg,
        "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"{width}\"{dash} points=\"{points}\"/>"
    );
}

/// Where the value `v` of index `s` is drawn in the panel at `top` (clamped into it).
fn at(top: f64, steps: usize, (lo, hi): (f64, f64), s: usize, v: f64) -> (f64, f64) {
    let x = LEFT + (RIGHT - LEFT) * s as f64 / (steps - 1) as f64;
    (x, top + PANEL * (1.0 - ((v - lo) / (hi - lo)).clamp(0.0, 1.0)))
}

/// The finite points as an SVG `points` list.
fn coords(top: f64, steps: usize, range: (f64, f64), pts: &[(usize, f64)]) -> String {
    let xy = pts.iter().filter(|(_, v)| v.is_finite()).map(|&(s, v)| at(top, steps, range, s, v));
    xy.map(|(x, y)| format!("{x:.1},{y:.1}")).collect::<Vec<_>>().join(" ")
}

/// How wide `text` is drawn at `font_px` pixels, by a stated width per character: 0.7 em bounds the
/// mean advance of what these pictures write (DejaVu Sans, the usual sans-serif on Linux, draws
/// digits 0.64 em, `F` 0.58, `B` 0.69, lower case 0.6–0.65, `.` 0.32; Helvetica narrower), so a
/// label measured by it fits its box. Only `W` (1.0 em) is wider, and no label has two.
pub(crate) fn text_width(text: &str, font_px: f64) -> f64 {
    text.chars().count() as f64 * 0.7 * font_px
}

/// Text as SVG (XML) character data: a title or path may hold `&` or `<`.
pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}
