//! Step 24 — which layout: a 70B Llama and a Mixtral on 512 H100s, planned from first principles.
//! `cargo run --release --example step24`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::commands::plan::{self, Ask, Cluster, Layout};
use ferrotron::config::{Config, DeviceDtype};
use std::path::PathBuf;

/// A model of `tests/fixtures/plan/` (Hugging Face config.json files) with `sets` on top.
fn model(name: &str, sets: &[&str]) -> Result<Config> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/plan").join(name);
    plan::model_of(Some(&path), &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>())
}

fn h100s(gpus: usize, per_node: usize) -> Result<Cluster> {
    plan::cluster("h100", (gpus, per_node), DeviceDtype::Bf16, None)
}

fn ask(seq_len: usize) -> Ask {
    Ask { global_batch_tokens: 4 << 20, seq_len, dtype: DeviceDtype::Bf16, runnable: false }
}

/// The line a layout gets here: its cut, memory, step and MFU.
fn line(l: &Layout) -> String {
    format!(
        "dp {} × tp {} × pp {}{} × cp {} × ep {}, ZeRO {}{}, {} micro-batches of {}, recompute {}: {:.1} GiB, {:.2} s a step, MFU {:.1}%",
        l.dp,
        l.tp,
        l.pp,
        match (l.pp, l.pp_virtual_stages) {
            (1, _) => String::new(),
            (_, 1) => format!(" ({})", l.pp_schedule),
            (_, v) => format!(" ({} ×{v})", l.pp_schedule),
        },
        l.cp,
        l.ep,
        l.zero_stage,
        if l.zero_reduce == "once" { " (reduced once a step)" } else { "" },
        l.grad_accum_steps,
        l.micro_batch_size,
        l.recompute,
        l.memory_gib,
        l.step_s.unwrap_or(0.0),
        100.0 * l.mfu.unwrap_or(0.0)
    )
}

fn exposed(l: &Layout, axis: &str) -> f64 {
    let b = l.breakdown.as_ref().expect("a priced layout");
    b.comm.iter().filter(|a| a.flow.axis == axis).map(|a| a.exposed_s).sum()
}

fn run(_tiny: bool) -> Result<()> {
    // (planning reads shapes only: the same at either size, in a few seconds)
    let cluster = h100s(512, 8)?;
    let megatron = [
        "parallel.tp=8",
        "parallel.pp=4",
        "parallel.sequence_parallel=true",
        "parallel.zero_stage=1",
        "train.micro_batch_size=1",
    ];

    // 1. memory first: a 70B model does not fit a GPU by data parallelism alone
    let plain = plan::fixed(&model("llama-3-70b.json", &["train.micro_batch_size=1"])?, &cluster, &ask(8192))?;
    println!("70B, plain data parallelism: {:.0} GiB a GPU", plain.memory_gib);
    common::claim(
        "memory first: 70B does not fit by data parallelism alone",
        !plain.fits,
        &format!("{:.0} GiB > 80 GiB", plain.memory_gib),
    )?;

    // 2. the search: every layout that fits, fastest first
    let layouts = plan::plan(&model("llama-3-70b.json", &[])?, &cluster, &ask(8192))?.layouts;
    let fit: Vec<&Layout> = layouts.iter().filter(|l| l.fits).collect();
    println!(
        "70B on 512 H100s, 8,192 tokens a sequence, 4M a step: {} layouts tried, {} fit",
        layouts.len(),
        fit.len()
    );
    for (i, l) in fit.iter().take(3).enumerate() {
        println!("  {}. {}", i + 1, line(l));
    }
    common::claim(
        "every layout the plan ranks fits in 80 GiB",
        fit.iter().all(|l| l.memory_gib <= 80.0),
        &format!("{} of them", fit.len()),
    )?;

    // 3. tensor parallelism inside a node: the same layout with tp crossing nodes of 2 GPUs
    let tp8 = model("llama-3-70b.json", &megatron)?;
    let (inside, across) = (plan::fixed(&tp8, &cluster, &ask(8192))?, plan::fixed(&tp8, &h100s(512, 2)?, &ask(8192))?);
    let (a, b) = (exposed(&inside, "tp"), exposed(&across, "tp"));
    println!("tp 8 inside a node (NVLink): {:.2} s exposed a step; across nodes of 2 (the network): {:.2} s", a, b);
    common::claim("tensor parallelism stays inside a node", b > 5.0 * a, &format!("{:.1}× slower across", b / a))?;

    // 4. the micro-batch against the bubble: pp 4 with 32 micro-batches of 1 or 4 of 8
    for mbs in ["train.micro_batch_size=1", "train.micro_batch_size=8"] {
        let l = plan::fixed(&model("llama-3-70b.json", &[&megatron[..], &[mbs]].concat())?, &cluster, &ask(8192))?;
        let (p, m) = (l.pp as f64, l.grad_accum_steps as f64);
        let bubble = l.breakdown.as_ref().map_or(0.0, |b| b.bubble);
        println!(
            "pp {} with {} micro-batches of {}: bubble {:.1}% of the compute",
            l.pp,
            l.grad_accum_steps,
            l.micro_batch_size,
            100.0 * bubble
        );
        let formula = (p - 1.0) / (m + p - 1.0);
        common::claim(
            "1F1B's bubble is (p − 1)/(m + p − 1)",
            (bubble - formula).abs() < 1e-9,
            &format!("{:.3} = {formula:.3}", bubble),
        )?;
    }

    // 5. long sequences: at 131,072 tokens a sequence the fastest layout cuts the sequence
    let long = plan::plan(&model("llama-3-70b.json", &[])?, &cluster, &ask(131072))?.layouts;
    let best = long.iter().find(|l| l.fits).expect("a layout fits");
    println!("70B at 131,072 tokens a sequence: {}", line(best));
    common::claim("long sequences take context parallelism", best.cp > 1, &format!("cp {}", best.cp))?;

    // 6. a mixture of experts: Mixtral 8×22B, 4,096 tokens a sequence
    let moe = plan::plan(&model("mixtral-8x22b.json", &[])?, &cluster, &ask(4096))?.layouts;
    let fit: Vec<&Layout> = moe.iter().filter(|l| l.fits).collect();
    println!("Mixtral 8×22B on 512 H100s: {} layouts tried, {} fit", moe.len(), fit.len());
    for (i, l) in fit.iter().take(3).enumerate() {
        println!("  {}. {}", i + 1, line(l));
    }
    common::claim("the experts spread over ranks", fit[0].ep > 1, &format!("ep {} in the fastest", fit[0].ep))
}

step!(run);
