//! # `ferrotron memory`: what every rank holds, and which axis would shrink it
//!
//! For each rank of a layout, the bytes of weights, gradients, AdamW state, activations and
//! communication buffers, estimated from the shapes (`train/memory.rs::per_rank`); with
//! `--measure`, two training steps run and each rank's measured peak of live tensor bytes is
//! added (a meter in the tensor layer on the CPU, the memory pool's peak on a GPU).

use crate::config::Config;
use crate::train::memory::{per_rank, RankMemory};
use crate::train::{train_all, Options};
use anyhow::Result;

/// The estimate for every rank of `cfg`, measured too when `measure`.
pub fn memory(cfg: &Config, measure: bool) -> Result<Vec<RankMemory>> {
    let mut ranks = per_rank(cfg)?;
    if measure {
        let mut two = cfg.clone();
        (two.train.steps, two.train.warmup_steps, two.checkpoint.every) = (2, 1, 0);
        let summaries = train_all(&two, Options { quiet: true, ..Default::default() })?;
        for (r, s) in ranks.iter_mut().zip(&summaries) {
            r.measured_peak_bytes = Some(s.peak_bytes as f64);
        }
    }
    Ok(ranks)
}

/// The table a person reads: one row per rank (in MiB), then which axis shrinks which column.
pub fn table(cfg: &Config, ranks: &[RankMemory]) -> String {
    let mib = |b: f64| format!("{:.2}", b / (1 << 20) as f64);
    let measured = ranks.iter().any(|r| r.measured_peak_bytes.is_some());
    let mut s = format!(
        "{:>4}  {:>9}  {:>9}  {:>9}  {:>11}  {:>9}  {:>9}{}\n",
        "rank",
        "weights",
        "grads",
        "optimizer",
        "activations",
        "comm",
        "total",
        if measured { "   measured  (estimate/measured)" } else { "" }
    );
    for r in ranks {
        s += &format!(
            "{:>4}  {:>9}  {:>9}  {:>9}  {:>11}  {:>9}  {:>9}",
            r.rank,
            mib(r.weights_bytes),
            mib(r.grads_bytes),
            mib(r.optimizer_bytes),
            mib(r.activations_bytes),
            mib(r.comm_bytes),
            mib(r.total_bytes)
        );
        if let Some(m) = r.measured_peak_bytes {
            s += &format!("  {:>9}  ({:.2})", mib(m), r.total_bytes / m.max(1.0));
        }
        s += "\n";
    }
    let p = &cfg.parallel;
    s += &format!(
        "MiB per rank, dp {} × pp {} × cp {} × tp {}{}, ZeRO stage {}, recompute \"{}\". What shrinks each column:\n",
        p.dp,
        p.pp,
        p.cp,
        p.tp,
        if p.sequence_parallel { " (sequence parallel)" } else { "" },
        p.zero_stage,
        format!("{:?}", cfg.train.recompute).to_lowercase()
    );
    // ZeRO shards over every dp×cp rank, or over a shard group's (hybrid sharding)
    let z = if p.dp_shard == 0 || p.dp_shard == p.dp { "1/(dp·cp)" } else { "1/(dp_shard·cp)" };
    s += &format!("  weights      tp and pp split them; zero_stage 3 keeps {z} plus the unit in use\n");
    s += &format!("  grads        tp and pp split them; zero_stage 2 keeps {z} plus the layer in backward\n");
    s += &format!("  optimizer    tp and pp split it; zero_stage 1 keeps {z}\n");
    s += "  activations  smaller micro_batch_size; cp and tp split them, sequence_parallel also the norms and residuals;\n";
    s += "               recompute selective or full keeps less; 1f1b holds fewer micro-batches than afab\n";
    if cfg.train.loss_stripe_rows == 0 {
        s +=
            "               train.loss_stripe_rows > 0 never holds the whole logits (rows × vocab, on the last stage)\n";
    }
    if p.pp_schedule.splits_backward() {
        s += "               (zb-h1 and zbv hold pp on every stage: their W's wait with what they read)\n";
    }
    s += "  comm         smaller bucket_mb (stage 0 keeps a bucket for every gradient; ZeRO a few at a time)\n";
    s
}

/// The JSON of `--json`: `{"ranks": [...]}`.
pub fn json(ranks: &[RankMemory]) -> Result<String> {
    Ok(serde_json::to_string_pretty(&serde_json::json!({ "ranks": ranks }))?)
}
