//! Step 08 — hybrid sharding (HSDP): ZeRO within groups, replicated across them.
//! `cargo run --release --example step08`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::cost::{AxisTally, Call, Link};
use ferrotron::config::Config;
use ferrotron::train::memory::{per_rank, RankMemory};
use ferrotron::train::{train_all, Options};

/// The layouts compared, all dp = 4 (4 sequences a rank): plain replicas, FSDP over all four,
/// FSDP in two shard groups of two.
const LAYOUTS: [(&str, &[&str]); 3] = [
    ("replicas", &["parallel.dp=4"]),
    ("FSDP", &["parallel.dp=4", "parallel.zero_stage=3"]),
    ("HSDP 2 × 2", &["parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=2"]),
];

fn config(tiny: bool, layout: &[&str]) -> Result<Config> {
    common::config(tiny, &[layout, &["train.micro_batch_size=4"]].concat())
}

fn run(tiny: bool) -> Result<()> {
    // 1. each layout on the single-device curve, and what each collective costs per step and rank
    println!("per step and rank, by axis and call: bytes B and the α–β model's ms on each link");
    println!("{:<11} {:<10} {:<15} {:>10} {:>8} {:>8} {:>8}", "layout", "axis", "call", "B", "nvlink", "pcie", "ib");
    let mut hsdp_calls: Vec<(&str, Call)> = Vec::new();
    for (name, layout) in LAYOUTS {
        let cfg = config(tiny, layout)?;
        let ranks = train_all(&cfg, Options { quiet: true, ..Default::default() })?;
        common::follows(&format!("{name} follows step 01"), &ranks[0].losses, &cfg, 1e-5)?;
        let steps = cfg.train.steps as f64;
        for t in ranks[0].comm.iter().filter(|t| t.axis != "world" && t.tally.calls > 0) {
            let AxisTally { axis, ranks: n, call, tally } = t;
            let ms = [Link::Nvlink, Link::Pcie, Link::Ib].map(|l| tally.predicted_seconds(*call, *n, l) * 1e3 / steps);
            let b = tally.bytes as f64 / steps;
            println!(
                "{name:<11} {axis:<10} {:<15} {b:>10.0} {:>8.3} {:>8.3} {:>8.3}",
                call.name(),
                ms[0],
                ms[1],
                ms[2]
            );
            if name.starts_with("HSDP") {
                hsdp_calls.push((axis, *call));
            }
        }
    }
    // the gathers and reduce-scatters stay inside a shard group; only an all-reduce of each
    // rank's partitions crosses between the groups (the shard axis's small all-reduce is the
    // gradient norm's sum over the partitions)
    let inside = hsdp_calls.iter().all(|&(axis, call)| match call {
        Call::AllGather | Call::ReduceScatter => axis == "shard",
        _ => axis != "replicate" || call == Call::AllReduce,
    });
    let across = hsdp_calls.contains(&("replicate", Call::AllReduce));
    let detail = "every all-gather and reduce-scatter on the shard axis, only an all-reduce on the replicate axis";
    common::claim("HSDP keeps ZeRO's collectives inside a shard group", inside && across, detail)?;
    // 2. what a rank holds: ZeRO's state over 4 ranks, or over a shard group's 2
    println!("\nrank 0's bytes, estimated by `ferrotron memory` (src/train/memory.rs)");
    println!("{:<11} {:>10} {:>10} {:>10} {:>10}", "layout", "weights", "grads", "AdamW", "total");
    let mut held: Vec<RankMemory> = Vec::new();
    for (name, layout) in LAYOUTS {
        let m = per_rank(&config(tiny, layout)?)?.swap_remove(0);
        let RankMemory { weights_bytes: w, grads_bytes: g, optimizer_bytes: o, total_bytes: t, .. } = m;
        println!("{name:<11} {w:>10.0} {g:>10.0} {o:>10.0} {t:>10.0}");
        held.push(m);
    }
    let (fsdp, hsdp) = (held[1].optimizer_bytes, held[2].optimizer_bytes);
    common::share(
        "HSDP's AdamW state is a shard group's share, twice FSDP's over 4",
        hsdp as usize,
        fsdp as usize * 2,
        1.0,
    )
}

step!(run);
