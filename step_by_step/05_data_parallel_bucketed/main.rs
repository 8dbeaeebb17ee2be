//! Step 05 — data parallel, bucketed and overlapped with backward, seen in a trace.
//! `cargo run --release --example step05`  (then open step05_trace.json in ui.perfetto.dev)

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::trace::{Lane, Trace};
use ferrotron::parallel::data_parallel::gradient_all_reduce;
use ferrotron::train::{train, Options};

fn run(tiny: bool) -> Result<()> {
    let naive = common::config(tiny, &["parallel.dp=2", "train.micro_batch_size=8", "parallel.dp_mode=\"naive\""])?;
    let mut bucketed = naive.clone();
    bucketed.parallel.dp_mode = ferrotron::config::DpMode::Bucketed;
    // small buckets: several per backward, even for this small model (and for --tiny's smaller one)
    bucketed.parallel.bucket_mb = if tiny { 0.03 } else { 0.25 };
    let trace = Trace::default();
    let quiet = Options { quiet: true, ..Default::default() };
    let a = train(&naive, quiet)?.losses;
    let b = train(&bucketed, Options { trace: Some(&trace), ..quiet })?.losses;
    let path = std::path::Path::new(if tiny { "target/step05_trace.json" } else { "step05_trace.json" });
    trace.write(path)?;
    let rank0 = |lane, keep: &dyn Fn(&str) -> bool| -> Vec<_> {
        trace.spans().into_iter().filter(|s| s.rank == 0 && s.lane == lane && keep(&s.name)).collect()
    };
    let buckets = rank0(Lane::Comm, &gradient_all_reduce);
    let backwards = rank0(Lane::Compute, &|n| n.starts_with("backward"));
    // a bucket's all-reduce is handed to the comm thread (issued) while backward still runs; when it
    // then runs depends on the comm thread getting a core and on the other rank arriving
    let during_backward = |t: f64| backwards.iter().any(|w| w.start_us < t && t < w.end_us);
    let issued = buckets.iter().filter(|b| during_backward(b.issued_us)).count();
    let started = buckets.iter().filter(|b| during_backward(b.start_us)).count();
    let per_step = buckets.len() / bucketed.train.steps;
    println!(
        "bucketed: {per_step} bucket all-reduces per step; of {}, {issued} issued and {started} started during \
         backward, {:.0}% of their time ran during backward; trace: {}",
        buckets.len(),
        100.0 * trace.hidden_fraction(gradient_all_reduce, "backward"),
        path.display()
    );
    if per_step < 2 || issued < buckets.len() {
        anyhow::bail!("expected several buckets per step, each issued during backward");
    }
    common::verdict("bucketed and naive give the same losses, bit for bit", &b, &a, 0.0)?;
    common::follows("bucketed dp = 2 follows step 01", &b, &bucketed, 1e-5)
}

step!(run);
