//! Step 10 — sequence parallelism: the norms and residuals split by tokens over the tp ranks.
//! `cargo run --release --example step10`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::cost::{report, Link};
use ferrotron::commands::memory::memory;
use ferrotron::train::{train_all, Options};

fn run(tiny: bool) -> Result<()> {
    let base = ["parallel.tp=2", "train.micro_batch_size=4"];
    let tp = common::config(tiny, &base)?;
    let sp = common::config(tiny, &[&base[..], &["parallel.sequence_parallel=true"]].concat())?;
    let quiet = Options { quiet: true, ..Default::default() };
    let (plain, split) = (train_all(&tp, quiet)?, train_all(&sp, quiet)?);
    // what travels: all-reduces become all-gathers and reduce-scatters
    for (name, runs) in [("tp = 2", &plain), ("tp = 2, sequence parallel", &split)] {
        let ranks: Vec<_> = runs.iter().map(|s| s.comm.clone()).collect();
        println!("{name}:\n{}", report(&ranks, runs[0].losses.len(), Link::Nvlink));
    }
    common::follows("sequence parallelism at tp = 2 follows step 01", &split[0].losses, &sp, 1e-5)?;
    // what each rank holds at its busiest: two training steps measured, beside the estimate
    let peak = |cfg| -> Result<f64> { Ok(memory(cfg, true)?[0].measured_peak_bytes.unwrap_or(0.0)) };
    let (a, b) = (peak(&tp)?, peak(&sp)?);
    let mib = |b: f64| b / (1 << 20) as f64;
    let detail = format!("{:.2} MiB with, {:.2} MiB without", mib(b), mib(a));
    common::claim("sequence parallelism lowers a rank's measured peak", b < a, &detail)
}

step!(run);
