//! Step 09 — tensor parallel: column and row parallel linear layers, then the whole model.
//! `cargo run --release --example step09`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::launcher::launch;
use ferrotron::comm::process_grid::{Axis, Grid};
use ferrotron::model::{Param, TensorSplit};
use ferrotron::ops::tensor::Tensor;
use ferrotron::ops::{self, Precision::F32, TpCut};
use ferrotron::parallel::tensor_parallel::TensorParallel;
use ferrotron::train::{train, Options};
use std::time::Duration;

fn random(seed: u64, shape: &[usize]) -> Tensor {
    ferrotron::model::init::normal(seed, "step09", shape, 1.0)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    a.to_vec().iter().zip(b.to_vec()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn run(tiny: bool) -> Result<()> {
    // 1. one MLP-shaped pair of layers, dense and on 2 ranks: y = (x·W₁ᵀ)·W₂ᵀ
    let (x, w1, w2) = (random(1, &[6, 16]), random(2, &[32, 16]), random(3, &[16, 32]));
    let dense = ops::linear(&ops::linear(&x, &w1, F32), &w2, F32);
    let diffs = launch(Grid::new(1, 1, 1, 2)?, Duration::from_secs(30), |me| {
        let (tp, i) = (TensorParallel::new(me.group(Axis::Tp)), me.group(Axis::Tp).index());
        let param = |value| Param::new("w".into(), value, TpCut::Whole);
        let column = param(ops::tp_part(&w1, TpCut::Rows, (i, 2))); // my 16 of the 32 hidden features
        let row = param(ops::tp_part(&w2, TpCut::Columns, (i, 2))); // the matching 16 input columns
        let h = ops::linear(&x, &column.value, F32); // column parallel: f is the identity forward
        let y = tp.row_forward(&h, &row)?; // row parallel: g all-reduces the partial products
        Ok(max_diff(&y, &dense))
    })?;
    println!("column → row parallel pair on 2 ranks vs the dense pair: max |Δy| {:.1e}", diffs[0]);

    // 2. the whole model: q, k, v, gate, up column parallel; o, down row parallel; vocab split
    let cfg = common::config(tiny, &["parallel.tp=2"])?;
    let losses = train(&cfg, Options { quiet: true, ..Default::default() })?.losses;
    common::follows("tp = 2 follows step 01", &losses, &cfg, 1e-5)
}

step!(run);
