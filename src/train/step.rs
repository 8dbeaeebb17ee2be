//! # The training step
//!
//! Every rank runs this same step (SPMD):
//!
//! ```text
//! zero the gradients
//! for each micro-batch (grad_accum_steps of them):
//!     forward → loss;  backward(1 / grad_accum_steps)          the gradients add up
//!     on the last one, each finished gradient goes to data parallelism, whose all-reduce
//!     starts while backward goes on with the earlier layers
//! data parallel: wait until every gradient is the average over the dp ranks
//! global gradient norm → clip → learning rate for this step → the optimizer (AdamW)
//!     (ZeRO-1, 2: of this rank's partitions, then gathered back into whole weights)
//! ```
//! On a GPU the loss stays on the device until the step reads it with the gradient norm: the
//! step's one wait for the GPU.
//! That is the step below, between its two marker lines, written out for one pipeline stage. With
//! pp > 1 the same forwards and backwards run in the pipeline schedule's order, with activations
//! travelling between stages (`parallel/pipeline_parallel.rs`). Tensor, context and expert
//! parallelism are inside the model (its `TensorSplit`, `SequenceSplit` and `ExpertSplit`); data
//! parallelism is the two calls `grad_ready`/`finish` of `train/gradients.rs` (each gradient
//! averaged over its replicas' axis). The loss is the mean over all of the batch's tokens,
//! whatever way it is cut into ranks and micro-batches (`train/feed.rs`: what a rank reads).

use super::feed::MicroBatches;
use super::gradients::{self, Gradients, NormGroups};
use crate::comm::launcher::Rank;
use crate::comm::process_grid::Axis;
use crate::comm::ReduceOp;
use crate::config::Config;
use crate::model::optimizer::{self, Optimizer};
use crate::model::Llama;
use crate::ops::{self, tensor::Tensor, DType};
use crate::parallel::pipeline_parallel::{self, StepPlan};
use crate::parallel::StepHooks;
use anyhow::Result;
use std::time::Instant;

/// What one rank trains, as `train/compose.rs` put it together.
pub(super) struct Trainer<'g> {
    pub(super) cfg: &'g Config,
    /// This rank's part of the model, with its splits (tp, sp, cp, FSDP, experts) plugged in.
    pub(super) model: Llama<'g>,
    /// The optimizer seam (`model/optimizer.rs`): AdamW, under ZeRO-1 and 2 with the gather after.
    pub(super) optimizer: Box<dyn Optimizer + 'g>,
    /// Where each finished gradient goes: the reducer of its replicas' axis.
    pub(super) grads: Gradients<'g>,
    /// The groups the gradient norm sums over.
    pub(super) norm: NormGroups<'g>,
    pub(super) me: &'g Rank,
    /// What this rank reads: its micro-batches (`train/feed.rs`).
    pub(super) feed: Box<dyn MicroBatches + 'g>,
    /// This rank's pipeline stage and its part in the step (one stage without pipelining).
    pub(super) pipeline: StepPlan<'g>,
    pub(super) first_step: usize,
}

/// How a step ended.
pub(super) enum Stepped {
    /// Trained: the loss (the mean over the global batch), the learning rate, the gradient norm
    /// before clipping, and the most micro-batches' activations held at once.
    Done { loss: f32, lr: f32, grad_norm: f64, activations_held: usize },
    /// The hooks ended it before this many micro-batches: the weights are those of the step before.
    Stopped { micro_batches: usize },
}

// ───────────────────────────────── the step ─────────────────────────────────
impl Trainer<'_> {
    /// One step of this rank: `hooks` are the driver's (`train/driver.rs`).
    pub(super) fn step(&mut self, step: usize, hooks: &dyn StepHooks) -> Result<Stepped> {
        let (t, me, pp) = (&self.cfg.train, self.me, self.pipeline.pp);
        let (m, model, grads) = (t.grad_accum_steps, &mut self.model, &mut self.grads);
        model.zero_grads();
        let (mut loss, activations_held) = if pp.size() == 1 {
            // micro-batches (step 03): each one's forward and backward, the gradients adding up
            let mut loss = Tensor::zeros_on(&[1], &model.place(), DType::F32); // on the device: no wait
            for micro in 0..m {
                if hooks.asks_before(micro) && hooks.stop_here()? {
                    return Ok(Stepped::Stopped { micro_batches: micro });
                }
                let ((tokens, targets), span) = (self.feed.micro_batch(step, micro)?, Instant::now());
                ops::add_scaled(&mut loss, model.forward_loss(&tokens, t.micro_batch_size, &targets)?, 1.0 / m as f32);
                hooks.span(format!("forward {micro}"), span);
                let (span, last) = (Instant::now(), micro + 1 == m);
                // data parallel: a full bucket's all-reduce (ZeRO: reduce-scatter) starts now
                model.backward_with(1.0 / m as f32, &mut |p| grads.grad_ready(p, last))?;
                hooks.span(format!("backward {micro}"), span);
            }
            (loss, 1) // one micro-batch's activations held at a time
        } else {
            // pipeline (steps 12, 13): the same forwards and backwards in the schedule's order
            let data = &|micro| self.feed.micro_batch(step, micro);
            let stats = pipeline_parallel::run_step(model, &self.pipeline, (data, hooks), &mut grads.hook())?;
            if let Some(micro_batches) = stats.stopped {
                return Ok(Stepped::Stopped { micro_batches });
            }
            (stats.loss, stats.peak_activations)
        };
        // each gradient's way to the optimizer, in this order: 1. the average over its replicas
        // (dp×cp; an expert's, edp): an all-reduce, or ZeRO's reduce-scatter to this rank's partition;
        // 2. with sequence parallelism, the norms' sum over tp (`train/gradients.rs`)
        let span = Instant::now();
        grads.finish(&mut model.params_mut())?;
        hooks.gradients_ready(span, model, &*self.optimizer);
        // the loss: from the stage that has it (the last; in the V, the first), averaged over dp×cp
        pp.broadcast_tensor(&mut loss, self.pipeline.stage.loss_rank())?;
        me.group(Axis::DpCp).all_reduce_tensor(&mut loss, ReduceOp::Avg)?;
        let (span, mut params) = (Instant::now(), model.params_mut());
        // 3. the global norm: tp shards, ZeRO chunks, ep experts and pp stages add up their parts
        let grad_sq = gradients::global_sum_squares(&params, &self.norm)?;
        // the step's one CPU–GPU sync point: the loss and the gradient norm, read together
        let read = ops::concat(&[&loss, &grad_sq]).to_vec();
        let (loss, grad_norm) = (read[0], (read[1] as f64).sqrt());
        // 4. never an update from a NaN; the optimizer (AdamW) at this step's learning rate,
        //    clipping folded in (ZeRO-1, 2: this rank's partitions, then the whole weights gathered)
        finite(self.cfg, loss, step, self.first_step)?;
        let lr = optimizer::lr_at(t, step);
        self.optimizer.step(&mut params, lr, optimizer::clip_factor(grad_norm, t.grad_clip))?;
        hooks.span("optimizer".into(), span);
        Ok(Stepped::Done { loss, lr, grad_norm, activations_held })
    }
}
// ─────────────────────────────── end of the step ───────────────────────────────

/// Whether the step's loss is still a number: if not, the error says what most likely caused it.
fn finite(cfg: &Config, loss: f32, step: usize, first_step: usize) -> Result<()> {
    if loss.is_finite() {
        return Ok(());
    }
    let (t, m) = (&cfg.train, &cfg.model);
    let why = match (step == first_step, first_step) {
        (true, 0) if !m.init_from.is_empty() => format!("before any update: the weights of {} overflow the forward pass in {:?}", m.init_from, cfg.device.compute_dtype()),
        (true, 0) => format!("before any update: the initial weights overflow the forward pass; check model.initializer_range = {} and model.rms_norm_eps = {}", m.initializer_range, m.rms_norm_eps),
        (true, _) => "on the first step after resuming: the checkpoint's weights overflow the forward pass; resume an earlier checkpoint".into(),
        (false, _) => format!("training diverged; lower train.lr (now {}) or set train.grad_clip (now {}, 0 is off)", t.lr, t.grad_clip),
    };
    anyhow::bail!("the loss became {loss} at step {step}: {why}")
}
