//! Step 16 — context parallel: ring attention, the sequence split contiguously, then zigzag.
//! `cargo run --release --example step16`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::parallel::context_parallel::positions;
use ferrotron::train::{train_all, Options};

fn run(tiny: bool) -> Result<()> {
    let seq = if tiny { 32 } else { 128 };
    for split in ["contiguous", "zigzag"] {
        let cfg = common::config(tiny, &["parallel.cp=4", &format!("parallel.cp_split=\"{split}\"")])?;
        let chunks: Vec<String> = (0..4)
            .map(|r| {
                let p = positions(cfg.parallel.cp_split, 4, r, seq);
                format!("rank {r}: {}..{} and {}..{}", p[0], p[p.len() / 2 - 1] + 1, p[p.len() / 2], p[p.len() - 1] + 1)
            })
            .collect();
        println!("{split}: {}", chunks.join(" | "));
        let ranks = train_all(&cfg, Options { quiet: true, ..Default::default() })?;
        let work: Vec<String> = ranks.iter().map(|r| format!("{:.2}M", r.attention_work as f64 / 1e6)).collect();
        println!("{split}: attention score entries per rank and step: {}", work.join(" "));
        common::follows(&format!("cp = 4, {split}, follows step 01"), &ranks[0].losses, &cfg, 1e-5)?;
    }
    Ok(())
}

step!(run);
