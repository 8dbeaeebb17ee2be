//! Step 12 — pipeline parallel with AFAB: all forwards, then all backwards.
//! `cargo run --release --example step12`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::commands::schedule;
use ferrotron::config::PpSchedule;
use ferrotron::train::{train_all, Options};

fn run(tiny: bool) -> Result<()> {
    // 2 stages of 2 layers; the global batch of 16 as 4 micro-batches of 4
    let cfg = common::config(
        tiny,
        &["parallel.pp=2", "parallel.pp_schedule=\"afab\"", "train.grad_accum_steps=4", "train.micro_batch_size=4"],
    )?;
    let timeline = schedule::simulate(PpSchedule::Afab, 2, 4, 1)?;
    for stage in 0..2 {
        let row: Vec<String> =
            timeline.slots.iter().filter(|s| s.stage == stage).map(|s| s.action.to_string()).collect();
        println!("stage {stage}: {}", row.join(" "));
    }
    println!(
        "bubble {:.0}% of the step, as (p−1)/(m+p−1) = {:.0}%",
        100.0 * timeline.bubble(),
        100.0 * timeline.bubble_formula().expect("AFAB has one")
    );
    let ranks = train_all(&cfg, Options { quiet: true, ..Default::default() })?;
    let held: Vec<usize> = ranks.iter().map(|r| r.peak_activations).collect();
    println!("micro-batch activations held at once, per stage: {held:?} (AFAB keeps all 4 until the backwards start)");
    common::follows("pp = 2 with AFAB follows step 01", &ranks[0].losses, &cfg, 1e-5)
}

step!(run);
