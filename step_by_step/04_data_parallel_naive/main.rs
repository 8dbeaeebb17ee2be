//! Step 04 — data parallel, naive: every rank a replica, gradients averaged one by one.
//! `cargo run --release --example step04`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::launcher::launch;
use ferrotron::comm::process_grid::{Axis, Grid};
use ferrotron::comm::ReduceOp;
use ferrotron::config::Config;
use ferrotron::data::Dataset;
use ferrotron::model::optimizer::{self, AdamW, Optimizer};
use ferrotron::model::Llama;
use std::time::Duration;

/// Trains dp = 2 replicas; returns each rank's losses and a hash of its weights. `average`:
/// whether the gradients are averaged (the lesson) or each replica keeps its own.
fn replicas(cfg: &Config, average: bool) -> Result<Vec<(Vec<f32>, u64)>> {
    let (t, dp) = (&cfg.train, 2);
    let data = Dataset::open(&cfg.data, &cfg.model)?;
    launch(Grid::new(dp, 1, 1, 1)?, Duration::from_secs(60), |me| {
        let group = me.group(Axis::Dp);
        let mut model = Llama::new(&cfg.model, t.seed); // identical replicas: same seed
        model.to_place(&common::place(cfg, me.rank)?);
        let mut optimizer = AdamW::new(&model.params_mut(), t);
        let mut losses = Vec::new();
        for step in 0..t.steps {
            model.zero_grads();
            let (inputs, targets) = data.micro_batch(t, (me.coords.dp, dp), step, 0)?; // my slice
            let mut loss = [model.forward(&inputs, t.micro_batch_size, &targets)?];
            model.backward(1.0)?;
            for p in model.params_mut().into_iter().filter(|_| average) {
                // the whole lesson: average every gradient over the replicas
                group.all_reduce_tensor(&mut p.grad, ReduceOp::Avg)?;
            }
            group.all_reduce(&mut loss, ReduceOp::Avg)?; // the loss of the global batch
            let mut params = model.params_mut();
            let norm = optimizer::grad_sum_squares(&params).sqrt();
            let clip = optimizer::clip_factor(norm, t.grad_clip); // < 1 when the norm is over the limit
            optimizer.step(&mut params, optimizer::lr_at(t, step), clip)?;
            if me.rank == 0 && (step % 10 == 0 || step + 1 == t.steps) {
                println!("step {step:>3}  loss {:.4}  (mean over {dp} ranks)", loss[0]);
            }
            losses.push(loss[0]);
        }
        Ok((losses, model.checksum()))
    })
}

fn run(tiny: bool) -> Result<()> {
    // the same global batch of 16 sequences: 8 per rank
    let cfg = common::config(tiny, &["train.micro_batch_size=8", "parallel.dp=2"])?;
    let ranks = replicas(&cfg, true)?;
    common::follows("dp = 2 follows step 01", &ranks[0].0, &cfg, 1e-5)?;
    common::same_weights("the two replicas hold the same weights, bit for bit", ranks[0].1, ranks[1].1)
}

step!(run);

#[test]
fn without_averaging_the_replicas_drift_apart() {
    let cfg = common::config(true, &["train.micro_batch_size=8", "parallel.dp=2"]).unwrap();
    let ranks = replicas(&cfg, false).unwrap();
    assert!(common::same_weights("replicas without averaging", ranks[0].1, ranks[1].1).is_err());
}
