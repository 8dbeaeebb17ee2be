//! Step 04 — data parallel, naive: every rank a replica, gradients averaged one by one.
//! `cargo run --release --example step04`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::launcher::launch;
use ferrotron::comm::ReduceOp;
use ferrotron::data::Dataset;
use ferrotron::model::optimizer::{self, Optimizer};
use ferrotron::model::Llama;
use ferrotron::parallel::process_grid::{Axis, Grid};
use std::time::Duration;

fn run(tiny: bool) -> Result<()> {
    let dp = 2;
    // the same global batch of 16 sequences: 8 per rank
    let cfg = common::config(tiny, &["train.micro_batch_size=8", "parallel.dp=2"])?;
    let t = &cfg.train;
    let data = Dataset::open(&cfg.data, &cfg.model)?;
    let losses = launch(Grid::new(dp, 1, 1, 1)?, Duration::from_secs(60), |me| {
        let group = me.group(Axis::Dp);
        let mut model = Llama::new(&cfg.model, t.seed); // identical replicas: same seed
        model.to_place(&common::place(&cfg, me.rank)?);
        let mut optimizer = Optimizer::new(&model.params_mut());
        let mut losses = Vec::new();
        for step in 0..t.steps {
            model.zero_grads();
            let (inputs, targets) = data.micro_batch(t, (me.coords.dp, dp), step, 0)?; // my slice
            let mut loss = [model.forward(&inputs, t.micro_batch_size, &targets)?];
            model.backward(1.0)?;
            for p in model.params_mut() {
                // the whole lesson: average every gradient over the replicas
                let mut g = p.grad.to_vec();
                group.all_reduce(&mut g, ReduceOp::Avg)?;
                p.grad.write(&g);
            }
            group.all_reduce(&mut loss, ReduceOp::Avg)?; // the loss of the global batch
            let mut params = model.params_mut();
            let norm = optimizer::grad_sum_squares(&params).sqrt();
            optimizer::clip(&mut params, norm, t.grad_clip);
            optimizer.step(&mut params, t, optimizer::lr_at(t, step));
            if me.rank == 0 && (step % 10 == 0 || step + 1 == t.steps) {
                println!("step {step:>3}  loss {:.4}  (mean over {dp} ranks)", loss[0]);
            }
            losses.push(loss[0]);
        }
        Ok(losses)
    })?;
    let one_device = common::reference(&cfg)?;
    common::verdict("dp = 2 follows step 01", &losses[0], &one_device, 1e-5)?;
    common::verdict("the two replicas log the same losses", &losses[1], &losses[0], 0.0)
}

step!(run);
