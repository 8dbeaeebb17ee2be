//! Step 05 — data parallel, bucketed and overlapped with backward, seen in a trace.
//! `cargo run --release --example step05`  (then open step05_trace.json in ui.perfetto.dev)

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::trace::Trace;
use ferrotron::parallel::data_parallel::gradient_all_reduce;
use ferrotron::train::{train, Options};

fn run(tiny: bool) -> Result<()> {
    let naive = common::config(tiny, &["parallel.dp=2", "train.micro_batch_size=8", "parallel.dp_mode=\"naive\""])?;
    let mut bucketed = naive.clone();
    bucketed.parallel.dp_mode = ferrotron::config::DpMode::Bucketed;
    bucketed.parallel.bucket_mb = 0.25; // small buckets: several per backward, even for this small model
    let trace = Trace::default();
    let quiet = Options { quiet: true, ..Default::default() };
    let a = train(&naive, quiet)?.losses;
    let b = train(&bucketed, Options { trace: Some(&trace), ..quiet })?.losses;
    let path = std::path::Path::new(if tiny { "target/step05_trace.json" } else { "step05_trace.json" });
    trace.write(path)?;
    let buckets = trace.spans().iter().filter(|s| s.rank == 0 && gradient_all_reduce(&s.name)).count();
    println!(
        "bucketed: {} bucket all-reduces per step, {:.0}% of their time ran during backward; trace: {}",
        buckets / bucketed.train.steps,
        100.0 * trace.hidden_fraction(gradient_all_reduce, "backward"),
        path.display()
    );
    common::verdict("bucketed and naive give the same losses, bit for bit", &b, &a, 0.0)?;
    common::verdict("bucketed dp = 2 follows step 01", &b, &common::reference(&bucketed)?, 1e-5)
}

step!(run);
