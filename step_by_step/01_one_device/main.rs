//! Step 01 — one device: the model, explicit forward and backward, the training loop.
//! `cargo run --release --example step01`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::data::Dataset;
use ferrotron::model::optimizer::{self, AdamW, Optimizer};
use ferrotron::model::Llama;

fn run(tiny: bool) -> Result<()> {
    let cfg = common::config(tiny, &[])?;
    let t = &cfg.train;
    let data = Dataset::open(&cfg.data, &cfg.model)?;
    let mut model = Llama::new(&cfg.model, t.seed); // every weight from its (seed, name) stream
    model.to_place(&common::place(&cfg, 0)?); // with --gpu the weights move to the GPU; nothing else changes
    let mut optimizer = AdamW::new(&model.params_mut(), t);
    let mut losses = Vec::new();
    for step in 0..t.steps {
        model.zero_grads();
        let (inputs, targets) = data.micro_batch(t, (0, 1), step, 0)?;
        let loss = model.forward(&inputs, t.micro_batch_size, &targets)?; // keeps the activations
        model.backward(1.0)?; // walks the model right to left, filling every parameter's grad
        let mut params = model.params_mut();
        let norm = optimizer::grad_sum_squares(&params).sqrt();
        let clip = optimizer::clip_factor(norm, t.grad_clip); // < 1 when the norm is over the limit
        optimizer.step(&mut params, optimizer::lr_at(t, step), clip)?;
        if step % 10 == 0 || step + 1 == t.steps {
            println!("step {step:>3}  loss {loss:.4}  grad norm {norm:.3}");
        }
        losses.push(loss);
    }
    if let Some(floor) = data.entropy_floor(t.seq_len) {
        println!("entropy floor of the data: {floor:.4} nats/token (train longer to approach it: `cargo run --release -- train`)");
    }
    let library = common::reference(&cfg)?;
    common::verdict("this loop gives the losses of the library's `train` on one rank", &losses, &library, 1e-6)
}

step!(run);
