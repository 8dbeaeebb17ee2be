//! Step 14 — the interleaved pipeline, and what each axis's traffic costs on a real link.
//! `cargo run --release --example step14`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::cost::{AxisTally, Link};
use ferrotron::commands::schedule::simulate;
use ferrotron::config::PpSchedule;
use ferrotron::train::{train_all, Options};

fn run(tiny: bool) -> Result<()> {
    // the bubble on an idealised clock: 4 stages, 8 micro-batches, 1F1B against V = 2 chunks
    let (plain, twice) = (simulate(PpSchedule::OneFOneB, 4, 8, 1)?, simulate(PpSchedule::Interleaved, 4, 8, 2)?);
    for t in [&plain, &twice] {
        println!(
            "{}: bubble {:.1}% of the step (formula {:.1}%)",
            t.name,
            100.0 * t.bubble(),
            100.0 * t.bubble_formula().expect("1F1B has one")
        );
    }
    let pass = (twice.bubble() - twice.bubble_formula().expect("interleaving has one")).abs() < 1e-9
        && twice.bubble() < plain.bubble();
    let detail = format!("{:.1}% against 1F1B's {:.1}%", 100.0 * twice.bubble(), 100.0 * plain.bubble());
    common::claim("interleaving with V = 2 shrinks the bubble to (p−1)/(V·m+p−1)", pass, &detail)?;
    // the real thing: 2 stages of 2 chunks each (layers 0, 2 on rank 0; 1, 3 on rank 1), and
    // with dp and tp, to see every axis talk
    let base = ["parallel.pp=2", "parallel.pp_schedule=\"interleaved\"", "parallel.pp_virtual_stages=2"];
    let cfg = common::config(tiny, &[&base[..], &["train.grad_accum_steps=4", "train.micro_batch_size=2"]].concat())?;
    let quiet = Options { quiet: true, ..Default::default() };
    let ranks = train_all(&cfg, quiet)?;
    common::follows("interleaved 1F1B (pp 2, V 2) follows step 01", &ranks[0].losses, &cfg, 1e-5)?;
    let three_d =
        [&base[..], &["parallel.dp=2", "parallel.tp=2", "train.grad_accum_steps=2", "train.steps=4"]].concat();
    let cfg = common::config(tiny, &three_d)?;
    let ranks = train_all(&cfg, quiet)?;
    // the cost table: what each axis moves per step and per rank, and what the α–β model says
    // it would take on each link
    let links = [Link::Nvlink, Link::Pcie, Link::Ib];
    println!("dp 2 × tp 2 × pp 2 (interleaved): per step and per rank, the α–β model's ms on each link");
    println!("{:<7} {:>10} {:>10} {:>10} {:>10}", "axis", "moved MB", "nvlink", "pcie", "ib");
    let per = (ranks.len() * cfg.train.steps) as f64;
    let mut rows: Vec<(&str, f64, [f64; 3])> = Vec::new();
    for t in ranks.iter().flat_map(|s| &s.comm) {
        let AxisTally { axis, ranks: n, call, tally } = t;
        let ms = links.map(|l| tally.predicted_seconds(*call, *n, l) * 1e3 / per);
        let moved = tally.moved_bytes(*call, *n) / per / 1e6;
        match rows.iter_mut().find(|r| r.0 == *axis) {
            Some(r) => (r.1, r.2) = (r.1 + moved, [r.2[0] + ms[0], r.2[1] + ms[1], r.2[2] + ms[2]]),
            None => rows.push((axis, moved, ms)),
        }
    }
    for (axis, moved, [nv, pcie, ib]) in &rows {
        println!("{axis:<7} {moved:>10.3} {nv:>10.3} {pcie:>10.3} {ib:>10.3}");
    }
    let tp = rows.iter().find(|r| r.0 == "tp").map_or(0.0, |r| r.1);
    let most = rows.iter().all(|r| r.1 <= tp);
    let claim = "tensor parallelism moves the most bytes of any axis: keep it on the fastest link";
    common::claim(claim, most, &format!("{tp:.3} MB per step and rank"))
}

step!(run);
