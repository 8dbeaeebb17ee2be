//! Step 03 — micro-batches, gradient accumulation and the global batch.
//! `cargo run --release --example step03`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::data::Dataset;
use ferrotron::model::optimizer::{self, AdamW, Optimizer};
use ferrotron::model::Llama;

fn run(tiny: bool) -> Result<()> {
    // the global batch of step 01 (16 sequences), cut into 4 micro-batches of 4
    let cfg = common::config(tiny, &["train.micro_batch_size=4", "train.grad_accum_steps=4"])?;
    let t = &cfg.train;
    let data = Dataset::open(&cfg.data, &cfg.model)?;
    let mut model = Llama::new(&cfg.model, t.seed);
    model.to_place(&common::place(&cfg, 0)?);
    let mut optimizer = AdamW::new(&model.params_mut(), t);
    let mut losses = Vec::new();
    for step in 0..t.steps {
        model.zero_grads();
        let mut loss = 0.0;
        for micro in 0..t.grad_accum_steps {
            let (inputs, targets) = data.micro_batch(t, (0, 1), step, micro)?;
            // each micro-batch adds 1/accum of its gradient: the sum is the gradient of the mean
            loss += model.forward(&inputs, t.micro_batch_size, &targets)? / t.grad_accum_steps as f32;
            model.backward(1.0 / t.grad_accum_steps as f32)?;
        }
        let mut params = model.params_mut();
        let norm = optimizer::grad_sum_squares(&params).sqrt();
        let clip = optimizer::clip_factor(norm, t.grad_clip); // < 1 when the norm is over the limit
        optimizer.step(&mut params, optimizer::lr_at(t, step), clip)?;
        if step % 10 == 0 || step + 1 == t.steps {
            println!(
                "step {step:>3}  loss {loss:.4}  ({} micro-batches of {})",
                t.grad_accum_steps, t.micro_batch_size
            );
        }
        losses.push(loss);
    }
    // against 1 micro-batch of 16
    common::follows("4 micro-batches of 4 give the losses of 1 batch of 16 (step 01)", &losses, &cfg, 1e-5)
}

step!(run);
