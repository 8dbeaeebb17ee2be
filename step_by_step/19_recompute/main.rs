//! Step 19 — activation recomputation: keep less for backward, compute it again there.
//! `cargo run --release --example step19`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::train::{train, Options};

fn run(tiny: bool) -> Result<()> {
    let quiet = Options { quiet: true, ..Default::default() };
    let mut runs = Vec::new();
    for mode in ["none", "selective", "full"] {
        let cfg = common::config(tiny, &["train.micro_batch_size=8", &format!("train.recompute=\"{mode}\"")])?;
        let s = train(&cfg, quiet)?;
        let step_s = s.step_s.iter().skip(1).sum::<f64>() / (s.step_s.len().max(2) - 1) as f64; // after the first
        println!(
            "recompute = {mode:<9}  peak {:>7.2} MiB   step {:>6.1} ms   final loss {:.4}",
            s.peak_bytes as f64 / (1 << 20) as f64,
            1e3 * step_s,
            s.losses.last().copied().unwrap_or(f32::NAN)
        );
        runs.push(s);
    }
    let [none, selective, full] = &runs[..] else { unreachable!("three modes") };
    // the same numbers recomputed in the same order: not close, equal
    common::verdict("selective recomputation changes no loss", &selective.losses, &none.losses, 0.0)?;
    common::verdict("full recomputation changes no loss", &full.losses, &none.losses, 0.0)?;
    let pass = full.peak_bytes < selective.peak_bytes && selective.peak_bytes < none.peak_bytes;
    let detail = format!("peaks {} > {} > {} bytes", none.peak_bytes, selective.peak_bytes, full.peak_bytes);
    common::claim("each mode keeps less", pass, &detail)
}

step!(run);
