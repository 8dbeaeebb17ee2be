//! Step 18 — all four together, and the loss-convergence check.
//! `cargo run --release --example step18`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::{bail, Result};
use ferrotron::commands::converge::{self, parse_variants};

fn run(tiny: bool) -> Result<()> {
    let steps = if tiny { 3 } else { 20 };
    let mut sets = vec![
        format!("train.steps={steps}"),
        "train.warmup_steps=5".into(),
        "train.grad_accum_steps=2".into(),
        "train.micro_batch_size=8".into(),
    ];
    sets.extend(common::device_sets());
    if tiny {
        sets.extend(
            ["model.hidden_size=32", "model.intermediate_size=64", "train.seq_len=32", "data.copy_lag=8"]
                .map(String::from),
        );
    }
    // 8 ranks in each variant; the last uses all four dimensions (16 ranks)
    let variants = parse_variants("dp=2,tp=2,pp=2;dp=2,cp=2,tp=2;tp=2,pp=2,cp=2;dp=2,tp=2,pp=2,cp=2")?;
    let report = converge::converge(None, &sets, &variants, 1e-4)?;
    print!("{}", converge::table(&report));
    if report.outcomes.iter().any(|o| !o.pass) {
        bail!("a variant left the single-rank curve");
    }
    println!("verdict: PASS — every 3D and 4D layout follows the single-rank loss curve within 1e-4");
    Ok(())
}

step!(run);
