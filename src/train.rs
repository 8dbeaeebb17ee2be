//! # The training loop
//!
//! ```text
//! for each step:
//!     zero the gradients
//!     for each micro-batch:  forward → loss,  backward(1 / grad_accum_steps)   (gradients add up)
//!     global gradient norm → clip → learning rate for this step → AdamW
//!     log step, loss, lr, grad_norm, tokens/s
//! ```
//! The global batch of a step is `micro_batch_size × grad_accum_steps` sequences; its loss is the
//! mean over all of their tokens, whatever way it is cut into micro-batches.

use crate::config::Config;
use crate::data::Dataset;
use crate::metrics::{Metrics, StepLog};
use crate::model::Llama;
use crate::optimizer::{self, Optimizer};
use anyhow::{bail, Result};
use std::path::Path;
use std::time::Instant;

pub struct Summary {
    pub losses: Vec<f32>,
    pub floor: Option<f64>,
    pub wall_s: f64,
}

impl Summary {
    /// Mean loss of the last tenth of the run (at least one step): less noisy than the last step.
    pub fn final_loss(&self) -> f32 {
        let n = self.losses.len().div_ceil(10).max(1);
        self.losses[self.losses.len() - n..].iter().sum::<f32>() / n as f32
    }
}

pub fn train(cfg: &Config, metrics_path: Option<&Path>, quiet: bool) -> Result<Summary> {
    let t = &cfg.train;
    let data = Dataset::open(&cfg.data, &cfg.model)?;
    let floor = data.entropy_floor(t.seq_len);
    let mut model = Llama::new(&cfg.model, t.seed);
    let n_params: usize = model.params().iter().map(|p| p.value.numel()).sum();
    if !quiet {
        println!(
            "model: {:.2}M parameters | batch {} × {} × {} tokens | {} steps on {}",
            n_params as f64 / 1e6,
            t.micro_batch_size,
            t.grad_accum_steps,
            t.seq_len,
            t.steps,
            format!("{:?}", cfg.device.kind).to_lowercase()
        );
        match floor {
            Some(f) => println!("data: {} | entropy floor {f:.4} nats/token", cfg.data.source),
            None => println!("data: {} | entropy floor unknown", cfg.data.source),
        }
    }
    let mut optimizer = Optimizer::new(&model.params_mut());
    let mut metrics = Metrics::new(t.steps, metrics_path, quiet)?;
    let tokens_per_step = (t.micro_batch_size * t.grad_accum_steps * t.seq_len) as f64;
    let start = Instant::now();
    let mut losses = Vec::with_capacity(t.steps);
    for step in 0..t.steps {
        let step_start = Instant::now();
        model.zero_grads();
        let mut loss = 0.0;
        for micro in 0..t.grad_accum_steps {
            let (inputs, targets) = data.micro_batch(t, step, micro)?;
            loss += model.forward(&inputs, t.micro_batch_size, &targets) / t.grad_accum_steps as f32;
            model.backward(1.0 / t.grad_accum_steps as f32);
        }
        if !loss.is_finite() {
            bail!("the loss became {loss} at step {step}: lower train.lr or set train.grad_clip");
        }
        let mut params = model.params_mut();
        let grad_norm = optimizer::grad_sum_squares(&params).sqrt();
        optimizer::clip(&mut params, grad_norm, t.grad_clip);
        let lr = optimizer::lr_at(t, step);
        optimizer.step(&mut params, t, lr);
        losses.push(loss);
        metrics.log(&StepLog {
            step,
            loss,
            lr,
            grad_norm: grad_norm as f32,
            tokens_per_s: tokens_per_step / step_start.elapsed().as_secs_f64(),
            elapsed_s: start.elapsed().as_secs_f64(),
        })?;
    }
    metrics.finish()?;
    Ok(Summary { losses, floor, wall_s: start.elapsed().as_secs_f64() })
}
