//! # The pipeline schedule as a picture: where the bubble is
//!
//! `ferrotron schedule --pp 4 --microbatches 8` plays the schedules of `parallel/pipeline_parallel.rs`
//! on an idealised clock (a forward takes 1 unit, a backward 2, sending is free): each stage
//! runs its actions in order, a forward waits for the previous stage's forward of the same
//! micro-batch, a backward for the next stage's backward. The idle time left over is the bubble,
//! (p − 1)/(m + p − 1) of the step for both AFAB and 1F1B; what differs is how many micro-batches'
//! activations each stage holds at once. The interleaved schedule's V chunks per rank each take
//! 1/V of that time, and its bubble is (p − 1)/(V·m + p − 1). The zero-bubble schedules split the
//! backward into B and W of 1 unit each (a W waits only for its own B): ZB-H1's bubble is
//! (p − 1)/(3m + p − 1), a third of 1F1B's idle time; ZBV's (two chunks of 1/2) is what the clock
//! says, close to none.

use crate::config::PpSchedule;
use crate::model::stage::Stage;
use crate::parallel::pipeline_schedule::{Action, Work};
use crate::parallel::schedules::schedule_of;
use anyhow::{bail, Result};
use std::fmt::Write;

/// One action placed on the clock.
pub struct Slot {
    pub stage: usize,
    pub action: Action,
    pub start: f64,
    pub end: f64,
}

pub struct Timeline {
    /// What is drawn: "AFAB", "1F1B", or the trace file it came from.
    pub name: String,
    /// Rows: pipeline stages (or, from a trace, ranks).
    pub stages: usize,
    pub micro_batches: usize,
    /// Model chunks per stage (1 but for the interleaved schedule).
    pub chunks: usize,
    pub slots: Vec<Slot>,
    pub makespan: f64,
    /// The most micro-batches whose activations each stage held at once (a chunk's count 1/V).
    pub peak_activations: Vec<f64>,
    /// The textbook bubble, where there is one (`bubble_formula`).
    formula: Option<f64>,
}

impl Timeline {
    /// The textbook bubble, where there is one: (p − 1)/(V·m + p − 1), or ZB-H1's
    /// (p − 1)/(3m + p − 1) when m ≥ p (its idle (p − 1)(F + B − W) over 3m units of work);
    /// `None` for ZBV and a trace.
    pub fn bubble_formula(&self) -> Option<f64> {
        self.formula
    }

    /// Idle share of stages × makespan.
    pub fn bubble(&self) -> f64 {
        let busy: f64 = self.slots.iter().map(|s| s.end - s.start).sum();
        1.0 - busy / (self.stages as f64 * self.makespan)
    }
}

/// Plays `kind` for `stages` stages, `m` micro-batches and `chunks` model chunks per stage
/// (`Zbv`: always 2).
pub fn simulate(kind: PpSchedule, stages: usize, m: usize, chunks: usize) -> Result<Timeline> {
    if stages == 0 || m == 0 || chunks == 0 {
        bail!("schedule: --pp, --microbatches and --virtual must be at least 1");
    }
    if stages > 256 || m > 4096 || chunks > 16 {
        bail!("schedule: --pp {stages} --microbatches {m} --virtual {chunks}: at most 256 stages, 4096 micro-batches and 16 chunks fit in a picture");
    }
    if kind == PpSchedule::Interleaved && (chunks < 2 || stages < 2 || !m.is_multiple_of(stages)) {
        bail!("schedule: the interleaved schedule needs --pp ≥ 2, --virtual ≥ 2 and --microbatches a multiple of --pp");
    }
    if kind == PpSchedule::Zbv && (stages < 2 || m < 2 * stages - 1) {
        bail!("schedule: the V-shaped zero-bubble schedule needs --pp ≥ 2 and --microbatches ≥ 2·pp − 1");
    }
    let schedule = schedule_of(kind);
    let shape = schedule.stage(0, stages, if kind == PpSchedule::Interleaved { chunks } else { 1 });
    let chunks = shape.chunks;
    let plans: Vec<Vec<Action>> = (0..stages).map(|s| schedule.actions(stages, s, m, chunks).collect()).collect();
    // a whole backward takes 2 units, B and W 1 each; a chunk does 1/V of its stage's work
    let per = 1.0 / chunks as f64;
    let last = stages * chunks - 1;
    let mut done = vec![vec![[None::<f64>; 3]; m]; last + 1]; // [virtual stage][micro][F, B, W] end times
    let (mut next, mut free) = (vec![0; stages], vec![0.0f64; stages]);
    let mut slots = Vec::new();
    let actions: usize = plans.iter().map(Vec::len).sum();
    while slots.len() < actions {
        let before = slots.len();
        for s in 0..stages {
            let Some(&action) = plans[s].get(next[s]) else { continue };
            let w = action.work();
            let (u, i) = (Stage { index: s, ..shape }.virtual_stage(w.chunk), w.micro);
            let (dep, kind_at, units) = match action {
                Action::Forward(_) if u == 0 => (Some(0.0), 0, 1.0),
                Action::Forward(_) => (done[u - 1][i][0], 0, 1.0),
                Action::Backward(_) if u == last => (done[u][i][0], 1, 2.0),
                Action::Backward(_) => (done[u + 1][i][1], 1, 2.0),
                Action::InputGrad(_) if u == last => (done[u][i][0], 1, 1.0),
                Action::InputGrad(_) => (done[u + 1][i][1], 1, 1.0),
                Action::Weights(_) => (done[u][i][1], 2, 1.0),
            };
            if let Some(ready) = dep {
                let start = free[s].max(ready);
                free[s] = start + units * per;
                done[u][i][kind_at] = Some(free[s]);
                slots.push(Slot { stage: s, action, start, end: free[s] });
                next[s] += 1;
            }
        }
        if slots.len() == before {
            bail!("schedule: {kind:?} deadlocks for {stages} stages and {m} micro-batches");
        }
    }
    let makespan = free.iter().cloned().fold(0.0, f64::max);
    let name = match kind {
        PpSchedule::Afab => "AFAB".to_string(),
        PpSchedule::OneFOneB => "1F1B".to_string(),
        PpSchedule::Interleaved => format!("interleaved 1F1B, V = {chunks}"),
        PpSchedule::ZbH1 => "ZB-H1 (zero bubble, B and W split)".to_string(),
        PpSchedule::Zbv => "ZBV (zero bubble, V-shaped, 2 chunks)".to_string(),
    };
    let formula = match kind {
        PpSchedule::Afab | PpSchedule::OneFOneB | PpSchedule::Interleaved => {
            Some(((stages - 1) as f64, (chunks * m) as f64))
        }
        // (with fewer micro-batches than stages there are too few W's to fill the gaps)
        PpSchedule::ZbH1 if m >= stages => Some(((stages - 1) as f64, 3.0 * m as f64)),
        PpSchedule::ZbH1 | PpSchedule::Zbv => None,
    };
    let formula = formula.map(|(idle, work)| idle / (work + idle));
    let peak_activations = peaks(&plans, chunks);
    Ok(Timeline { name, stages, micro_batches: m, chunks, slots, makespan, peak_activations, formula })
}

/// The most micro-batches held at once along each row's sequence of actions (a chunk's 1/V): from
/// a forward to its backward, or where the backward is split, to its W.
fn peaks(plans: &[Vec<Action>], chunks: usize) -> Vec<f64> {
    let held = |plan: &Vec<Action>| {
        let mut n = 0i64;
        plan.iter()
            .map(|a| {
                n += match a {
                    Action::Forward(_) => 1,
                    Action::Backward(_) | Action::Weights(_) => -1,
                    Action::InputGrad(_) => 0, // what it read stays for its W
                };
                n
            })
            .max()
            .unwrap_or(0) as f64
            / chunks as f64
    };
    plans.iter().map(held).collect()
}

/// The last step of a real run, from the `forward i` / `backward i` spans of `train --trace`: a
/// row per rank, time in units of the mean forward span.
pub fn from_trace(path: &std::path::Path) -> Result<Timeline> {
    let text = crate::files::read_text(path, "--trace")?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{}: not a trace-event JSON file: {e}", path.display()))?;
    let mut spans = Vec::new(); // (rank, action, start µs, end µs)
    let mut pipelined = false;
    for e in json["traceEvents"].as_array().into_iter().flatten().filter(|e| e["ph"] == "X") {
        let (Some(name), Some(rank), Some(ts), Some(dur)) =
            (e["name"].as_str(), e["pid"].as_u64(), e["ts"].as_f64(), e["dur"].as_f64())
        else {
            continue;
        };
        // activations and gradients between stages: "send of N values to R pp[...]"
        pipelined |= name.starts_with("send ") && name.contains(" pp[");
        // "forward 3", or "forward 3.1" for micro-batch 3 through model chunk 1
        let work = |w: &str| {
            let (micro, chunk) = w.split_once('.').unwrap_or((w, "0"));
            Some(Work { micro: micro.parse().ok()?, chunk: chunk.parse().ok()? })
        };
        let action = match name.split_once(' ') {
            Some(("forward", w)) => work(w).map(Action::Forward),
            Some(("backward", w)) => work(w).map(Action::Backward),
            Some(("weights", w)) => work(w).map(Action::Weights),
            _ => None,
        };
        spans.extend(action.map(|a| (rank as usize, a, ts, ts + dur)));
    }
    // where the backward was split (its W spans apart), a `backward` span was its B
    if spans.iter().any(|s| matches!(s.1, Action::Weights(_))) {
        for s in &mut spans {
            if let Action::Backward(w) = s.1 {
                s.1 = Action::InputGrad(w);
            }
        }
    }
    if !pipelined {
        bail!(
            "{}: this run had no pipeline (no send between pipeline stages), so it has no schedule to draw; trace a run with parallel.pp of 2 or more",
            path.display()
        );
    }
    // the last step starts at the earliest of the ranks' last `forward 0`
    let mut last_start: Vec<(usize, f64)> = Vec::new();
    for &(rank, _, ts, _) in spans.iter().filter(|s| s.1 == Action::Forward(Work { micro: 0, chunk: 0 })) {
        match last_start.iter_mut().find(|(r, _)| *r == rank) {
            Some(entry) => entry.1 = entry.1.max(ts),
            None => last_start.push((rank, ts)),
        }
    }
    let Some(t0) = last_start.iter().map(|&(_, ts)| ts).reduce(f64::min) else {
        bail!("{}: no `forward 0` spans; write one with `ferrotron train --trace`", path.display());
    };
    let step: Vec<_> = spans.into_iter().filter(|s| s.2 >= t0).collect();
    let ranks = step.iter().map(|s| s.0 + 1).max().unwrap_or(1);
    let forwards: Vec<f64> = step.iter().filter(|s| matches!(s.1, Action::Forward(_))).map(|s| s.3 - s.2).collect();
    let unit = (forwards.iter().sum::<f64>() / forwards.len().max(1) as f64).max(1e-9);
    let slots: Vec<Slot> = step
        .iter()
        .map(|s| Slot { stage: s.0, action: s.1, start: (s.2 - t0) / unit, end: (s.3 - t0) / unit })
        .collect();
    let makespan = slots.iter().map(|s| s.end).fold(0.0, f64::max);
    let chunks = step.iter().map(|s| 1 + if let Action::Forward(w) = s.1 { w.chunk } else { 0 }).max().unwrap_or(1);
    let micro_batches = forwards.len() / ranks / chunks;
    let plans: Vec<Vec<Action>> = (0..ranks).map(|r| step.iter().filter(|s| s.0 == r).map(|s| s.1).collect()).collect();
    Ok(Timeline {
        name: format!("{} (last step)", path.display()),
        stages: ranks,
        micro_batches,
        chunks,
        slots,
        makespan,
        peak_activations: peaks(&plans, chunks),
        formula: None,
    })
}

/// The timelines one above the other, a row per stage, F boxes light, B boxes dark, W green, on
/// one clock so their lengths compare. The clock's scale is chosen so that the widest label fits
/// its narrowest box (a chunk of an interleaved or V-shaped pipeline is 1/V of a stage's work, so
/// its boxes are V times narrower); only past `MAX_ROW_PX` does it stop growing, and a box too
/// narrow for its label is then drawn without one (a line under the rows says how many). Every
/// title line is measured too, and the canvas is as wide as the widest.
pub fn svg(timelines: &[Timeline]) -> String {
    use crate::commands::plot::{escape, text_width};
    const FONT: f64 = 11.0; // labels, stage names, the second title line
    const TITLE: f64 = 13.0;
    const PAD: f64 = 2.0; // each side of a label inside its box
    const MAX_ROW_PX: f64 = 32768.0;
    let (row, left, box_h) = (26.0, 150.0, 22.0);
    let label = |t: &Timeline, a: &Action| if t.chunks > 1 { format!("{a:#}") } else { a.to_string() };
    let needed = timelines
        .iter()
        .flat_map(|t| t.slots.iter().map(move |s| (t, s)))
        .map(|(t, s)| (text_width(&label(t, &s.action), FONT) + 2.0 * PAD) / (s.end - s.start).max(1e-9));
    let longest = timelines.iter().map(|t| t.makespan).fold(0.0, f64::max).max(1e-9);
    let unit = needed.fold(18.0, f64::max).min(MAX_ROW_PX / longest);
    let titles: Vec<[String; 2]> = timelines
        .iter()
        .map(|t| {
            let formula = t.formula.map_or(String::new(), |f| format!(" (formula: {:.1}%)", 100.0 * f));
            let peaks = t.peak_activations.iter().map(|a| format!("{a:.2}")).collect::<Vec<_>>().join(", ");
            [
                format!("{} — bubble {:.1}%{formula}", t.name, 100.0 * t.bubble()),
                format!("peak micro-batch activations per stage: {peaks}"),
            ]
        })
        .collect();
    let title_px = titles.iter().map(|[a, b]| text_width(a, TITLE).max(text_width(b, FONT))).fold(0.0, f64::max);
    let width = (left + longest * unit).max(10.0 + title_px) + 20.0;
    let block = |t: &Timeline| 40.0 + t.stages as f64 * row + 24.0; // titles, rows, a note line
    let height: f64 = timelines.iter().map(block).sum::<f64>() + 10.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"{FONT}\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let mut top = 10.0;
    for (t, [first, second]) in timelines.iter().zip(&titles) {
        let _ = writeln!(s, "<text x=\"10\" y=\"{}\" font-size=\"{TITLE}\">{}</text>", top + 13.0, escape(first));
        let _ = writeln!(s, "<text x=\"10\" y=\"{}\">{}</text>", top + 30.0, escape(second));
        let rows = top + 40.0;
        for stage in 0..t.stages {
            let y = rows + stage as f64 * row;
            let _ = writeln!(s, "<text x=\"10\" y=\"{}\">stage {stage}</text>", y + 15.0);
            let _ = writeln!(
                s,
                "<rect x=\"{left}\" y=\"{y}\" width=\"{}\" height=\"{box_h}\" fill=\"#eee\"/>",
                t.makespan * unit
            );
        }
        let mut unlabelled = 0;
        for slot in &t.slots {
            let fill = match slot.action {
                Action::Forward(w) => ["#9ecae1", "#c6dbef"][w.chunk % 2],
                Action::Backward(w) | Action::InputGrad(w) => ["#3182bd", "#08519c"][w.chunk % 2],
                Action::Weights(w) => ["#a1d99b", "#74c476"][w.chunk % 2],
            };
            let (x, y, w) = (left + slot.start * unit, rows + slot.stage as f64 * row, (slot.end - slot.start) * unit);
            let _ = writeln!(
                s,
                "<rect x=\"{x}\" y=\"{y}\" width=\"{w}\" height=\"{box_h}\" fill=\"{fill}\" stroke=\"white\"/>"
            );
            let text = label(t, &slot.action);
            match text_width(&text, FONT) + 2.0 * PAD <= w {
                true => {
                    let _ = writeln!(
                        s,
                        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{text}</text>",
                        x + w / 2.0,
                        y + 15.0
                    );
                }
                false => unlabelled += 1,
            }
        }
        if unlabelled > 0 {
            let note = format!("{unlabelled} boxes too narrow for their labels at this width are drawn without them");
            let _ = writeln!(s, "<text x=\"10\" y=\"{}\">{note}</text>", rows + t.stages as f64 * row + 15.0);
        }
        top += block(t);
    }
    s.push_str("</svg>\n");
    s
}
