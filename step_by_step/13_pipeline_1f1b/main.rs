//! Step 13 — pipeline parallel with 1F1B: the same bubble as AFAB, a fraction of the memory.
//! `cargo run --release --example step13`  (writes step13_schedule.svg)

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::commands::schedule;
use ferrotron::config::PpSchedule;
use ferrotron::train::{train_all, Options};

fn run(tiny: bool) -> Result<()> {
    // 4 stages of one layer; 8 micro-batches of 2
    let sets = ["parallel.pp=4", "train.grad_accum_steps=8", "train.micro_batch_size=2"];
    let cfg = common::config(tiny, &sets)?;
    let timelines =
        [schedule::simulate(PpSchedule::Afab, 4, 8, 1)?, schedule::simulate(PpSchedule::OneFOneB, 4, 8, 1)?];
    for t in &timelines {
        let held: Vec<usize> = t.peak_activations.iter().map(|&a| a as usize).collect(); // whole micro-batches
        println!("{}: bubble {:.1}%, activations held per stage {held:?}", t.name, 100.0 * t.bubble());
    }
    let path = if tiny { "target/step13_schedule.svg" } else { "step13_schedule.svg" };
    ferrotron::files::write_atomically(std::path::Path::new(path), schedule::svg(&timelines).as_bytes())?;
    println!("picture: {path}");
    let ranks = train_all(&cfg, Options { quiet: true, ..Default::default() })?;
    let held: Vec<usize> = ranks.iter().map(|r| r.peak_activations).collect();
    println!("measured in the run: 1F1B stage s held at most {held:?} micro-batches (pp − s)");
    common::follows("pp = 4 with 1F1B follows step 01", &ranks[0].losses, &cfg, 1e-5)
}

step!(run);
