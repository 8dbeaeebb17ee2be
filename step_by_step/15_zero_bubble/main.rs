//! Step 15 — zero-bubble pipelines: the backward split into B and W.
//! `cargo run --release --example step15`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::cost::{AxisTally, Link};
use ferrotron::commands::schedule::{simulate, Timeline};
use ferrotron::config::PpSchedule;
use ferrotron::train::{train_all, Options};

/// The schedules compared: 1F1B, ZB-H1, ZBV (two chunks per rank).
const KINDS: [(PpSchedule, &str); 3] =
    [(PpSchedule::OneFOneB, "1f1b"), (PpSchedule::ZbH1, "zb-h1"), (PpSchedule::Zbv, "zbv")];

/// A timeline's rows: each stage's actions in the order it runs them.
fn rows(t: &Timeline) {
    for stage in 0..t.stages {
        let row: Vec<String> = t.slots.iter().filter(|s| s.stage == stage).map(|s| s.action.to_string()).collect();
        println!("  stage {stage}: {}", row.join(" "));
    }
}

fn run(tiny: bool) -> Result<()> {
    // 1. on the idealised clock (F, B and W one unit each; 1F1B's backward is B + W), 4 stages, 8 micro-batches
    let (p, m) = (4, 8);
    let timelines = KINDS.map(|(kind, _)| simulate(kind, p, m, 2)).into_iter().collect::<Result<Vec<_>>>()?;
    for t in &timelines {
        let peaks: Vec<String> = t.peak_activations.iter().map(|a| format!("{a:.0}")).collect();
        println!("{}: bubble {:.1}%, micro-batches held per stage {}", t.name, 100.0 * t.bubble(), peaks.join(" "));
        if t.name.starts_with("ZB-H1") {
            rows(t); // W (the weight gradients) trails its B by `stage` backwards
        }
    }
    let (one, h1, v) = (&timelines[0], &timelines[1], &timelines[2]);
    let formula = h1.bubble_formula().expect("m ≥ p: ZB-H1 has one");
    let pass = (h1.bubble() - formula).abs() < 1e-9 && v.bubble() < h1.bubble() && h1.bubble() < one.bubble();
    let detail = format!(
        "1F1B {:.1}%, ZB-H1 {:.1}% = (p−1)/(3m+p−1), ZBV {:.1}%",
        100.0 * one.bubble(),
        100.0 * h1.bubble(),
        100.0 * v.bubble()
    );
    common::claim("splitting B from W shrinks the bubble", pass, &detail)?;
    let most = |t: &Timeline| t.peak_activations.iter().cloned().fold(0.0, f64::max);
    let same = most(h1) == most(one) && most(v) == most(one);
    let detail = format!("at most {} micro-batches on any stage, as 1F1B's first", most(one));
    common::claim("for no more memory than 1F1B's busiest stage", same, &detail)?;

    // 2. the real thing: 2 stages, 4 micro-batches of 4; every schedule on step 01's curve, and
    //    ZB-H1 bitwise 1F1B's (the same GEMMs into the same gradients, in the same order)
    println!("\nrank 0 on the pp axis, per step: calls, bytes B and the α–β model's ms on each link;");
    println!("micro-batch chunks each stage held at once");
    println!(
        "{:<6} {:<10} {:>5} {:>10} {:>8} {:>8} {:>8} {:>6}",
        "", "call", "calls", "B", "nvlink", "pcie", "ib", "held"
    );
    let mut curves = Vec::new();
    for (_, name) in KINDS {
        let schedule = format!("parallel.pp_schedule=\"{name}\"");
        let sets = ["parallel.pp=2", &schedule, "train.grad_accum_steps=4", "train.micro_batch_size=4"];
        let cfg = common::config(tiny, &sets)?;
        let ranks = train_all(&cfg, Options { quiet: true, ..Default::default() })?;
        common::follows(&format!("{name} follows step 01"), &ranks[0].losses, &cfg, 1e-5)?;
        let steps = cfg.train.steps as f64;
        for t in ranks[0].comm.iter().filter(|t| t.axis == "pp" && t.tally.calls > 0) {
            let AxisTally { ranks: n, call, tally, .. } = t;
            let ms = [Link::Nvlink, Link::Pcie, Link::Ib].map(|l| tally.predicted_seconds(*call, *n, l) * 1e3 / steps);
            let (calls, b) = (tally.calls as f64 / steps, tally.bytes as f64 / steps);
            let held = ranks.iter().map(|r| r.peak_activations.to_string()).collect::<Vec<_>>().join("/");
            let call = call.name();
            println!(
                "{name:<6} {call:<10} {calls:>5.0} {b:>10.0} {:>8.3} {:>8.3} {:>8.3} {held:>6}",
                ms[0], ms[1], ms[2]
            );
        }
        curves.push(ranks[0].losses.clone());
    }
    let equal = curves[0].iter().zip(&curves[1]).filter(|(a, b)| a == b).count();
    let detail = format!("{equal} of {} steps equal", curves[0].len());
    common::claim("ZB-H1's losses are 1F1B's, bit for bit", equal == curves[0].len(), &detail)
}

step!(run);
