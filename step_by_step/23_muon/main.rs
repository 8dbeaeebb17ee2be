//! Step 23 — Muon: an optimizer that needs the whole matrix, under every layout.
//! `cargo run --release --example step23`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::cost::{Call, Tally};
use ferrotron::comm::launcher::launch;
use ferrotron::comm::process_grid::Grid;
use ferrotron::config::Config;
use ferrotron::model::{muon, Llama};
use ferrotron::ops::tensor::Tensor;
use ferrotron::parallel::layout;
use ferrotron::parallel::muon_owners::Owners;
use ferrotron::parallel::zero::Sharding;
use ferrotron::train::{train, train_all, Options, Summary};
use std::time::Duration;

/// The two singular values of a 2 × n matrix, from its 2 × 2 Gram matrix's eigenvalues.
fn singular_values(m: &[f32], n: usize) -> (f64, f64) {
    let dot = |i: usize, j: usize| (0..n).map(|k| m[i * n + k] as f64 * m[j * n + k] as f64).sum::<f64>();
    let (a, b, d) = (dot(0, 0), dot(0, 1), dot(1, 1));
    let root = ((a - d) * (a - d) + 4.0 * b * b).sqrt();
    (((a + d + root) / 2.0).sqrt(), ((a + d - root) / 2.0).max(0.0).sqrt())
}

/// The values of the matrices Muon updates, in the whole model.
fn muon_values(cfg: &Config) -> usize {
    let model = Llama::new(&cfg.model, 1);
    model.params().iter().filter(|p| muon::updates(&p.name, p.shape())).map(|p| p.value.numel()).sum()
}

/// Every rank's all_to_all traffic per step on `axis`, added up.
fn exchanged(ranks: &[Summary], axis: &str) -> Tally {
    let steps = ranks[0].losses.len() as u64;
    let mut total = Tally::default();
    for t in ranks.iter().flat_map(|s| &s.comm).filter(|t| t.axis == axis && t.call == Call::AllToAll) {
        (total.calls, total.bytes) = (total.calls + t.tally.calls, total.bytes + t.tally.bytes);
    }
    Tally { calls: total.calls / steps, bytes: total.bytes / steps, ..total }
}

fn run(tiny: bool) -> Result<()> {
    // Newton–Schulz by hand: a 2 × 3 matrix with singular values 3 and 0.1 (a rotation of
    // diag(3, 0.1)); five iterations bring both near 1, in the quintic's band
    let (c, s) = (0.6f32, 0.8f32);
    let u = vec![3.0 * c, -0.1 * s, 0.0, 3.0 * s, 0.1 * c, 0.0];
    let o = muon::newton_schulz(&Tensor::from_vec(&[2, 3], u.clone()), 5).to_vec();
    let (before, after) = (singular_values(&u, 3), singular_values(&o, 3));
    println!("singular values: {:.3}, {:.3} → after Newton–Schulz {:.3}, {:.3}", before.0, before.1, after.0, after.1);
    common::claim(
        "Newton–Schulz brings every direction to about the same size",
        (0.6..1.3).contains(&after.0) && (0.6..1.3).contains(&after.1),
        &format!("{:.0}× apart before, {:.2}× after", before.0 / before.1, after.0 / after.1),
    )?;

    // AdamW and Muon side by side, from the same init on the same batches
    let quiet = Options { quiet: true, ..Default::default() };
    // (40 steps at either size: `--tiny`'s 4 are still warming up)
    let adamw_run = train(&common::config(tiny, &["train.micro_batch_size=8", "train.steps=40"])?, quiet)?;
    let cfg = common::config(tiny, &["train.micro_batch_size=8", "train.steps=40", "train.optimizer=\"muon\""])?;
    let muon_run = train(&cfg, quiet)?;
    let (adamw, mine) = (&adamw_run.losses, &muon_run.losses);
    let (target, muon_final) = (adamw_run.final_loss(), muon_run.final_loss());
    let window = adamw.len().div_ceil(10); // the steps `final_loss` averages
    let reached = mine.windows(window).position(|w| w.iter().sum::<f32>() / (w.len() as f32) <= target);
    println!(
        "after {} steps: AdamW {:.4}, Muon {:.4}; Muon reaches AdamW's final loss at step {}",
        adamw.len(),
        target,
        muon_final,
        reached.map_or("— (not yet)".into(), |i| (i + window).to_string())
    );
    common::claim("Muon ends below AdamW", muon_final < target, &format!("{:.4} < {target:.4}", muon_final))?;

    // every layout on the one-device curve, and what the owners' exchange moves a step
    let n = muon_values(&cfg) as u64;
    for (layout, axis, ranks) in [
        (&["parallel.dp=2", "train.micro_batch_size=4"][..], "dp×cp", 2),
        (&["parallel.dp=2", "train.micro_batch_size=4", "parallel.zero_stage=2"][..], "dp×cp", 2),
        (&["parallel.tp=2", "train.micro_batch_size=8"][..], "tp", 2),
    ] {
        let cfg = common::config(tiny, &[&["train.optimizer=\"muon\"", "train.steps=40"][..], layout].concat())?;
        let all = train_all(&cfg, quiet)?;
        let nudged = (Options { nudge_weights: true, ..Default::default() }, "every initial weight moved by one ulp");
        common::follows_with(&format!("Muon with {}", layout.join(" ")), (&all[0].losses, mine), &cfg, 1e-4, nudged)?;
        let t = exchanged(&all, axis);
        // replicas: each owner sends its results to every rank; partitions (ZeRO) and tp slices:
        // every piece to its owner and back
        let want = if cfg.parallel.zero_stage == 0 && axis != "tp" { ranks * n * 4 } else { 2 * n * 4 };
        let (calls, held) = (t.calls, all[0].held.optimizer);
        let detail = format!("{calls} all_to_all calls, {} bytes a step over the ranks ({n} values of matrices); rank 0 holds {held} bytes of optimizer state", t.bytes);
        common::claim(&format!("the owners' exchange on {axis} moves what the lesson says"), t.bytes == want, &detail)?;
    }

    // what Muon holds: one momentum per matrix value, where AdamW kept two moments
    let (a, m) = (adamw_run.held.optimizer, muon_run.held.optimizer);
    let detail = format!("{m} bytes, AdamW's {a}: 4 bytes less for each of the {n} values of matrices");
    common::claim("Muon keeps one momentum where AdamW kept two moments", m + 4 * n as usize == a, &detail)?;

    // the owners: each of 4 data-parallel ranks orthogonalises the matrices assigned to it
    let dp4 = Grid::new(4, 1, 1, 1)?;
    let loads = launch(dp4, Duration::from_secs(60), |me| {
        let model = Llama::new(&cfg.model, 1);
        Ok(Owners::new(me, &Sharding::new(0, layout::replicas), layout::replicas, &model.params()).load())
    })?;
    let largest = Llama::new(&cfg.model, 1).params().iter().map(|p| p.value.numel()).max().unwrap_or(0);
    let mean = loads.iter().sum::<usize>() as f64 / loads.len() as f64;
    let max = *loads.iter().max().unwrap_or(&0);
    println!("Newton–Schulz values per rank at dp = 4: {loads:?} (mean {mean:.0})");
    common::claim(
        "largest first, to the least loaded: no rank owns more than the mean and one matrix",
        max as f64 <= mean + largest as f64 && loads.iter().sum::<usize>() == n as usize,
        &format!("max {max}, mean {mean:.0}, largest matrix {largest}"),
    )
}

step!(run);
