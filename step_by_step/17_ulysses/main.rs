//! Step 17 — Ulysses: context parallelism as an all-to-all to a head split, beside the ring.
//! `cargo run --release --example step17`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::cost::Link;
use ferrotron::config::Config;
use ferrotron::train::{train, train_all, Options};

/// One step at cp = 4 of sequences of `seq_len` in `mode` ("ring" or "ulysses").
fn one_step(tiny: bool, seq_len: usize, mode: &str) -> Result<Config> {
    let (seq, mode) = (format!("train.seq_len={seq_len}"), format!("parallel.cp_mode=\"{mode}\""));
    common::config(tiny, &["parallel.cp=4", &seq, &mode, "train.steps=1", "train.warmup_steps=1"])
}

/// What the cp axis of one rank sends in a run of `cfg`, by the ledger: (B summed over its
/// calls, the α–β model's ms on NVLink, PCIe, InfiniBand).
fn cp_cost(cfg: &Config) -> Result<(u64, [f64; 3])> {
    let ranks = train_all(cfg, Options { quiet: true, ..Default::default() })?;
    let cp: Vec<_> = ranks[0].comm.iter().filter(|t| t.axis == "cp").collect();
    let ms = [Link::Nvlink, Link::Pcie, Link::Ib]
        .map(|l| cp.iter().map(|t| t.tally.predicted_seconds(t.call, t.ranks, l)).sum::<f64>() * 1e3);
    Ok((cp.iter().map(|t| t.tally.bytes).sum(), ms))
}

/// The lesson's count of those bytes: per layer and micro-batch, with X = batch × seq/cp ×
/// head_dim × 4 bytes (f32), the ring passes its K and V block 3·cp − 2 times (forward cp − 1,
/// backward cp − 1 and dK, dV cp), each 2·KV·X; Ulysses all-to-alls q, k, v and out forward and
/// q, k, v, out, dout, dq, dk, dv backward (H heads each for q, out, dout, dq; KV·r for k, v,
/// dk, dv), and the log-sum-exp (batch × heads × seq/cp) once each way.
fn predicted(cfg: &Config, mode: &str) -> u64 {
    let (m, t, cp) = (&cfg.model, &cfg.train, cfg.parallel.cp);
    let (h, kv, hd, layers) = (m.num_attention_heads, m.num_key_value_heads, m.head_dim(), m.num_hidden_layers);
    let rows = t.micro_batch_size * t.seq_len / cp;
    let x = rows * hd * 4;
    let per_layer = match mode {
        "ring" => (3 * cp - 2) * 2 * kv * x,
        _ => {
            let r = cp / (1..=kv.min(cp)).rev().find(|&d| kv.is_multiple_of(d) && cp.is_multiple_of(d)).unwrap_or(1);
            6 * (h + kv * r) * x + 2 * rows * h * 4
        }
    };
    (per_layer * layers * t.grad_accum_steps) as u64
}

fn run(tiny: bool) -> Result<()> {
    // 1. Ulysses on the single-device curve: cp = 2 splits the 8 heads and 4 KV heads in two; with
    //    tp = 2 each tp rank has 4 heads and 2 KV heads, and cp = 4 repeats each KV head twice
    for (claim, layout) in [
        ("Ulysses, cp = 2, follows step 01", &["parallel.cp=2"][..]),
        ("Ulysses, tp = 2 × cp = 4 (KV heads repeated), follows step 01", &["parallel.tp=2", "parallel.cp=4"][..]),
    ] {
        let cfg = common::config(tiny, &[layout, &["parallel.cp_mode=\"ulysses\""]].concat())?;
        let losses = train(&cfg, Options { quiet: true, ..Default::default() })?.losses;
        common::follows(claim, &losses, &cfg, 1e-5)?;
    }
    // 2. what the cp axis moves, ring against Ulysses, as the sequence grows (cp = 4)
    println!("cp = 4, one step of 16 sequences: bytes B one rank's cp group sends, and the α–β model's ms");
    println!("{:<8} {:<8} {:>12} {:>9} {:>9} {:>9}", "seq_len", "mode", "B", "nvlink", "pcie", "ib");
    let mut exact = true;
    for seq_len in if tiny { [64, 128] } else { [128, 512] } {
        for mode in ["ring", "ulysses"] {
            let cfg = one_step(tiny, seq_len, mode)?;
            let (bytes, [nv, pcie, ib]) = cp_cost(&cfg)?;
            exact &= bytes == predicted(&cfg, mode);
            println!("{seq_len:<8} {mode:<8} {bytes:>12} {nv:>9.3} {pcie:>9.3} {ib:>9.3}");
        }
    }
    common::claim("every byte the ledger counted is one the lesson's formula counts", exact, "both modes, both lengths")
}

step!(run);
