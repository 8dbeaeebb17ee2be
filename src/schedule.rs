//! # The pipeline schedule as a picture: where the bubble is
//!
//! `ferrotron schedule --pp 4 --microbatches 8` plays the schedules of `pipeline_parallel.rs`
//! on an idealised clock (a forward takes 1 unit, a backward 2, sending is free): each stage
//! runs its actions in order, a forward waits for the previous stage's forward of the same
//! micro-batch, a backward for the next stage's backward. The idle time left over is the bubble,
//! (p − 1)/(m + p − 1) of the step for both AFAB and 1F1B; what differs is how many micro-batches'
//! activations each stage holds at once.

use crate::config::PpSchedule;
use crate::pipeline_parallel::{schedule, Action};
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
    pub kind: PpSchedule,
    pub stages: usize,
    pub micro_batches: usize,
    pub slots: Vec<Slot>,
    pub makespan: f64,
    /// The most micro-batches whose activations each stage held at once.
    pub peak_activations: Vec<usize>,
}

impl Timeline {
    /// Idle share of stages × makespan.
    pub fn bubble(&self) -> f64 {
        let busy: f64 = self.slots.iter().map(|s| s.end - s.start).sum();
        1.0 - busy / (self.stages as f64 * self.makespan)
    }

    /// The textbook bubble, (p − 1)/(m + p − 1).
    pub fn bubble_formula(&self) -> f64 {
        let p = self.stages as f64;
        (p - 1.0) / (self.micro_batches as f64 + p - 1.0)
    }
}

/// Plays `kind` for `stages` stages and `m` micro-batches.
pub fn simulate(kind: PpSchedule, stages: usize, m: usize) -> Result<Timeline> {
    if stages == 0 || m == 0 {
        bail!("schedule: --pp and --microbatches must be at least 1");
    }
    let plans: Vec<Vec<Action>> = (0..stages).map(|s| schedule(kind, stages, s, m)).collect();
    let mut done = vec![vec![[None::<f64>; 2]; m]; stages]; // [stage][micro][forward, backward] end times
    let (mut next, mut free) = (vec![0; stages], vec![0.0f64; stages]);
    let mut slots = Vec::new();
    while slots.len() < stages * 2 * m {
        let before = slots.len();
        for s in 0..stages {
            let Some(&action) = plans[s].get(next[s]) else { continue };
            let (dep, duration, k, i) = match action {
                Action::Forward(i) => (if s == 0 { Some(0.0) } else { done[s - 1][i][0] }, 1.0, 0, i),
                Action::Backward(i) if s + 1 == stages => (done[s][i][0], 2.0, 1, i),
                Action::Backward(i) => (done[s + 1][i][1], 2.0, 1, i),
            };
            if let Some(ready) = dep {
                let start = free[s].max(ready);
                free[s] = start + duration;
                done[s][i][k] = Some(free[s]);
                slots.push(Slot { stage: s, action, start, end: free[s] });
                next[s] += 1;
            }
        }
        if slots.len() == before {
            bail!("schedule: {kind:?} deadlocks for {stages} stages and {m} micro-batches");
        }
    }
    let makespan = free.iter().cloned().fold(0.0, f64::max);
    let peak_activations = plans
        .iter()
        .map(|plan| {
            let mut held = 0i64;
            plan.iter()
                .map(|a| {
                    held += if matches!(a, Action::Forward(_)) { 1 } else { -1 };
                    held
                })
                .max()
                .unwrap_or(0) as usize
        })
        .collect();
    Ok(Timeline { kind, stages, micro_batches: m, slots, makespan, peak_activations })
}

/// The timelines one above the other, a row per stage, F boxes light and B boxes dark.
pub fn svg(timelines: &[Timeline]) -> String {
    let (unit, row, left) = (18.0, 26.0, 150.0);
    let width = left + timelines.iter().map(|t| t.makespan).fold(0.0, f64::max) * unit + 20.0;
    let height: f64 = timelines.iter().map(|t| (t.stages as f64 + 2.5) * row).sum::<f64>() + 10.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let mut top = 20.0;
    for t in timelines {
        let title = format!(
            "{} — bubble {:.1}% (formula (p−1)/(m+p−1): {:.1}%), peak activations per stage {:?}",
            if t.kind == PpSchedule::Afab { "AFAB" } else { "1F1B" },
            100.0 * t.bubble(),
            100.0 * t.bubble_formula(),
            t.peak_activations
        );
        let _ = writeln!(s, "<text x=\"10\" y=\"{top}\" font-size=\"13\">{title}</text>");
        for stage in 0..t.stages {
            let y = top + 10.0 + stage as f64 * row;
            let _ = writeln!(s, "<text x=\"10\" y=\"{}\">stage {stage}</text>", y + 16.0);
            let _ = writeln!(
                s,
                "<rect x=\"{left}\" y=\"{y}\" width=\"{}\" height=\"22\" fill=\"#eee\"/>",
                t.makespan * unit
            );
        }
        for slot in &t.slots {
            let (label, fill) = match slot.action {
                Action::Forward(i) => (format!("F{i}"), "#9ecae1"),
                Action::Backward(i) => (format!("B{i}"), "#3182bd"),
            };
            let (x, y, w) =
                (left + slot.start * unit, top + 10.0 + slot.stage as f64 * row, (slot.end - slot.start) * unit);
            let _ =
                writeln!(s, "<rect x=\"{x}\" y=\"{y}\" width=\"{w}\" height=\"22\" fill=\"{fill}\" stroke=\"white\"/>");
            let _ = writeln!(s, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{label}</text>", x + w / 2.0, y + 15.0);
        }
        top += (t.stages as f64 + 2.5) * row;
    }
    s.push_str("</svg>\n");
    s
}
