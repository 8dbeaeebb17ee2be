//! Step 07 — FSDP (ZeRO-3): gather a unit's weights, compute, free; the next gather prefetched.
//! `cargo run --release --example step07`  (then open step07_trace.json in ui.perfetto.dev)

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::trace::{Lane, Trace};
use ferrotron::train::{train_all, Options};

fn run(tiny: bool) -> Result<()> {
    let base = ["parallel.dp=4", "train.micro_batch_size=2"];
    let replicas = common::config(tiny, &base)?;
    let fsdp = common::config(tiny, &[&base[..], &["parallel.zero_stage=3"]].concat())?;
    let quiet = Options { quiet: true, ..Default::default() };
    let plain = train_all(&replicas, quiet)?.swap_remove(0);
    let trace = Trace::default();
    let sharded = train_all(&fsdp, Options { trace: Some(&trace), ..quiet })?.swap_remove(0);
    let path = std::path::Path::new(if tiny { "target/step07_trace.json" } else { "step07_trace.json" });
    trace.write(path)?;
    // rank 0's weight gathers: each issued while the step computes (the forward or backward span
    // around it), one unit ahead of the unit that needs it
    let spans = trace.spans();
    let gathers: Vec<_> =
        spans.iter().filter(|s| s.rank == 0 && s.lane == Lane::Comm && s.name.starts_with("all_gather")).collect();
    let computing =
        |t: f64| spans.iter().any(|w| w.rank == 0 && w.lane == Lane::Compute && w.start_us < t && t < w.end_us);
    let issued = gathers.iter().filter(|g| computing(g.issued_us)).count();
    let units = fsdp.model.num_hidden_layers + 2; // the embedding, each block, the head
    println!(
        "rank 0: {} weight all-gathers per step ({units} units in forward, {} in backward), {issued} of {} issued during forward or backward; trace: {}",
        gathers.len() / fsdp.train.steps,
        units - 1,
        gathers.len(),
        path.display()
    );
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "weights held between uses: {:.2} MiB with FSDP, {:.2} MiB as replicas; step peak {:.2} MiB vs {:.2} MiB",
        mib(sharded.held.weights),
        mib(plain.held.weights),
        mib(sharded.peak_bytes),
        mib(plain.peak_bytes)
    );
    if gathers.len() != (2 * units - 1) * fsdp.train.steps || issued != gathers.len() {
        anyhow::bail!("expected one gather per unit in forward and per unit but the embedding in backward, each during the step's compute");
    }
    common::follows("FSDP at dp = 4 follows step 01", &sharded.losses, &fsdp, 1e-5)?;
    common::share("FSDP keeps 1/4 of the weights between uses", sharded.held.weights, plain.held.weights, 0.25)
}

step!(run);
