//! Step 06 — ZeRO-1 and ZeRO-2: reduce-scatter, a sharded update, all-gather; memory measured.
//! `cargo run --release --example step06`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::commands::memory;
use ferrotron::train::{train_all, Options};

fn run(tiny: bool) -> Result<()> {
    // dp = 4, two micro-batches a step: ZeRO-2 reduce-scatters after each of them
    let base = ["parallel.dp=4", "train.micro_batch_size=2", "train.grad_accum_steps=2"];
    let mut held = Vec::new();
    for stage in 0..=2 {
        let zero = format!("parallel.zero_stage={stage}");
        let cfg = common::config(tiny, &[&base[..], &[zero.as_str()]].concat())?;
        let rank0 = train_all(&cfg, Options { quiet: true, ..Default::default() })?.swap_remove(0);
        let estimate = memory::memory(&cfg, false)?.swap_remove(0);
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        let h = rank0.held;
        println!(
            "ZeRO-{stage}: rank 0 holds weights {:.2} MiB, gradients {:.2} MiB, AdamW {:.2} MiB when the gradients are complete; peak {:.2} MiB (estimated {:.2})",
            mib(h.weights),
            mib(h.grads),
            mib(h.optimizer),
            mib(rank0.peak_bytes),
            estimate.total_bytes / (1 << 20) as f64
        );
        common::follows(&format!("ZeRO-{stage} at dp = 4 follows step 01"), &rank0.losses, &cfg, 1e-5)?;
        held.push(h);
    }
    // AdamW's state is a quarter from ZeRO-1 on; the gradients a quarter from ZeRO-2
    common::share("ZeRO-1 keeps 1/4 of the AdamW state", held[1].optimizer, held[0].optimizer, 0.25)?;
    common::share("ZeRO-2 keeps 1/4 of the gradients", held[2].grads, held[0].grads, 0.25)
}

step!(run);
