//! # The training loop
//!
//! Every rank runs this same loop (SPMD). One step:
//!
//! ```text
//! zero the gradients
//! for each micro-batch (grad_accum_steps of them):
//!     forward → loss;  backward(1 / grad_accum_steps)          the gradients add up
//!     on the last one, each finished gradient goes to data parallelism, whose all-reduce
//!     starts while backward goes on with the earlier layers
//! data parallel: wait until every gradient is the average over the dp ranks
//! global gradient norm → clip → learning rate for this step → AdamW
//! every validation.every steps: the loss on held-out data
//! ```
//! On a GPU the loss stays on the device until the step reads it with the gradient norm: the
//! step's one wait for the GPU.
//! That is the loop below, written out for one pipeline stage. With pp > 1 the same forwards and
//! backwards run in the pipeline schedule's order, with activations travelling between stages
//! (`parallel/pipeline_parallel.rs`). Tensor, context and expert parallelism are inside the model
//! (its `TensorSplit`, `SequenceSplit` and `ExpertSplit`); data parallelism is the two calls
//! `grad_ready`/`finish` of `train/gradients.rs` (each gradient averaged over its replicas' axis).
//!
//! Each rank reads its slice of the step's global batch of `micro_batch_size × grad_accum_steps
//! × dp` sequences: its dp share, and of each sequence its cp positions. The loss is the mean
//! over all of the batch's tokens, whatever way it is cut into ranks and micro-batches.
//! Starting and checkpoints are bookkeeping, in `train/run.rs`; logging and timing each step in
//! `train/watch.rs`; the memory check before a run in `train/memory.rs`; stopping cleanly on a
//! signal in `train/stop.rs`; the held-out loss in `train/validate.rs`.

mod agree;
mod gradients;
pub mod memory;
pub mod metrics;
mod run;
pub mod stop;
mod validate;
mod watch;

pub use run::{Options, Stopped, Summary};

use crate::comm::launcher::{launch_on, Rank};
use crate::comm::process_grid::Axis;
use crate::comm::ReduceOp;
use crate::config::Config;
use crate::data::Dataset;
use crate::model::optimizer::{self, NormGroups};
use crate::model::routing_tape::{self, RoutingTape};
use crate::model::Stage;
use crate::ops::{self, tensor::Tensor, DType};
use crate::parallel::context_parallel;
use crate::parallel::data_parallel::bucket_values;
use crate::parallel::fsdp::{self, Fsdp};
use crate::parallel::pipeline_parallel::{self, StepPlan};
use crate::parallel::sequence_parallel;
use crate::parallel::zero;
use anyhow::Result;
use gradients::Gradients;
use run::{Run, Start};
use std::cell::Cell;
use std::rc::Rc;
use std::time::Instant;
use watch::{StepEnd, Watch};

/// Trains on every rank of the configured grid; returns rank 0's summary.
pub fn train(cfg: &Config, opts: Options) -> Result<Summary> {
    Ok(train_all(cfg, opts)?.swap_remove(0))
}

/// Trains and returns every rank's summary, in rank order: each rank a thread running
/// `train_rank` (`comm/launcher.rs`).
pub fn train_all(cfg: &Config, opts: Options) -> Result<Vec<Summary>> {
    let run = Run::prepare(cfg, opts)?; // the grid, the data, where the weights come from
    if run.finished {
        return Ok(run.nothing_to_train(cfg)); // the checkpoint is the run's last step
    }
    let summaries = launch_on(run.grid, run.setup.clone(), |me| train_rank(me, cfg, &run.data, opts, run.start()))?;
    Ok(run.finish(cfg, opts, summaries))
}

/// The loop of one rank.
fn train_rank(me: &Rank, cfg: &Config, data: &Dataset, opts: Options, start: Start) -> Result<Summary> {
    let t = &cfg.train;
    let (dp, pp, tp) = (me.group(Axis::DpCp), me.group(Axis::Pp), me.group(Axis::Tp));
    let (ep, edp) = (me.group(Axis::Ep), me.group(Axis::ExpertDp)); // experts: 1 and dp×cp without ep
    if start.spread {
        agree::settings(me.group(Axis::World), cfg)?; // processes started differently never train
    }
    let (mut model, first_step) = start.model(me, cfg)?; // this rank's part, on its device

    // debugging a mixture of experts: its routing recorded, or replayed from another run
    let tape = opts.routing_tape.map(|mode| RoutingTape::open(mode, cfg)).transpose()?;
    if let Some(tape) = &tape {
        model = model.with_routing_tape(tape.clone());
    }
    let mut optimizer = start.optimizer(&mut model, tp, cfg)?;
    // ZeRO: each dp rank keeps 1/dp of the optimizer state (stage 1), of the gradients (2), of the
    // weights (3); an expert, 1/(its expert-data ranks)
    let p = &cfg.parallel;
    // hybrid sharding (`parallel.dp_shard`): ZeRO within the shard groups, replicated across them
    let dense = if me.grid.hybrid() { Axis::Shard } else { Axis::DpCp };
    let (stage, sharding) = (p.zero_stage, zero::Sharding::new(p.zero_stage, (dense, me.group(dense)), edp));
    if sharding.any() {
        model = zero::shard(model, &mut optimizer, sharding, stage);
    }
    if sharding.any() && stage == 3 {
        model = model.with_weight_split(Rc::new(Fsdp::new(sharding))); // FSDP: whole weights unit by unit
    }
    // where each finished gradient goes: the reducer of its replicas' axis (`train/gradients.rs`)
    let mut grads = Gradients::new(me, p, &sharding, (&model.params()[..], &model.param_chunks()[..]));
    let mut watch = Watch::new(me, cfg, opts, (first_step, model.place()))?; // metrics, trace, timing, memory
    let cp = me.group(Axis::Cp);
    let positions = context_parallel::positions(cfg.parallel.cp_split, cp.size(), cp.index(), t.seq_len);
    let m = t.grad_accum_steps;
    // on NCCL a pipeline's send waits on the GPU for its receive, and a step stopped part-way
    // leaves some unreceived: there a signal waits for the step's end
    let may_stop = opts.stop_on_signal && (pp.size() == 1 || !pp.moves_on_device(&model.place()));
    for step in first_step..t.steps {
        watch.step_starts(step);
        model.zero_grads();
        // micro-batch `micro` of this rank: its dp share, and its cp positions of each sequence
        let batch = |micro| {
            let (tokens, targets) = data.micro_batch(t, (me.coords.dp, cfg.parallel.dp), step, micro)?;
            let (seq, pos) = (t.seq_len, &positions);
            if let Some(tape) = &tape {
                let sp = p.sequence_parallel.then(|| (tp.index(), tp.size()));
                tape.at(step, routing_tape::batch_rows(cfg, step, (me.coords.dp, micro), pos, sp));
            }
            Ok((context_parallel::local_rows(&tokens, seq, pos), context_parallel::local_rows(&targets, seq, pos)))
        };
        // a step of many micro-batches still stops soon after a signal: every rank asks between
        // micro-batches, at the same points (`train/stop.rs`)
        let signal = Cell::new(None);
        let stop_here = || -> Result<bool> {
            if may_stop {
                signal.set(stop::agreed(me.group(Axis::World))?);
            }
            Ok(signal.get().is_some())
        };
        let mut dropped = None; // the micro-batches begun when a signal stopped the step
        let (mut loss, activations_held) = if pp.size() == 1 {
            let mut loss = Tensor::zeros_on(&[1], &model.place(), DType::F32); // on the device: no wait
            for micro in 0..m {
                if micro > 0 && stop_here()? {
                    dropped = Some(micro);
                    break;
                }
                let (tokens, targets) = batch(micro)?;
                let span = Instant::now();
                ops::add_scaled(&mut loss, model.forward_loss(&tokens, t.micro_batch_size, &targets)?, 1.0 / m as f32);
                watch.span(format!("forward {micro}"), span);
                let (span, last) = (Instant::now(), micro + 1 == m);
                // bucketed: a full bucket's all-reduce (ZeRO: reduce-scatter) starts now
                model.backward_with(1.0 / m as f32, &mut |p| grads.grad_ready(p, last))?;
                watch.span(format!("backward {micro}"), span);
            }
            (loss, 1) // one micro-batch's activations held at a time
        } else {
            // what travels between stages: this rank's rows (of them, 1/tp with sequence parallelism)
            let rows = t.micro_batch_size * t.seq_len / cfg.parallel.cp / if p.sequence_parallel { p.tp } else { 1 };
            let hidden = [rows, cfg.model.hidden_size];
            let (kind, record) = (cfg.parallel.pp_schedule, &|name, span| watch.span(name, span));
            let (batch_size, stage) = (t.micro_batch_size, Stage::planned(pp.index(), p));
            let (data, stop) = (&batch, may_stop.then_some(&stop_here as &dyn Fn() -> Result<bool>));
            let plan = StepPlan { kind, micro_batches: m, batch: batch_size, stage, hidden, data, record, stop };
            let stats = pipeline_parallel::run_step(&mut model, pp, &plan, &mut |p, last| grads.grad_ready(p, last))?;
            dropped = stats.stopped;
            (stats.loss, stats.peak_activations)
        };
        tape.iter().for_each(|t| t.idle());
        if let (Some(micro), Some(signal)) = (dropped, signal.get()) {
            // the step's gradients so far are dropped: the weights are still those of the step before
            let saved = start.checkpoints.save_before(me, cfg, (step, first_step), (&model, &optimizer))?;
            watch.stopped(Stopped { signal, checkpoint: saved, dropped: Some(micro) });
            break;
        }
        // after backward, each gradient's way to the optimizer, in this order:
        let span = Instant::now();
        // 1. the average over its replicas (dp×cp; an expert's, edp): Partial(avg) → Replicate,
        //    or under ZeRO → Shard(0), this rank's chunk of it
        grads.finish(&mut model.params_mut())?;
        if p.sequence_parallel {
            // 2. the norms saw 1/tp of the rows: their gradients, Partial(sum) over tp → Replicate
            sequence_parallel::sum_replicated_grads(&mut model.params_mut(), tp)?;
        }
        let held = memory::held(&model, &optimizer); // what weights, gradients and AdamW hold now
        watch.span("wait for gradients".into(), span);
        // the stage with the loss knows it (the last; in the V, the first); every rank logs the
        // mean over the global batch
        pp.broadcast_tensor(&mut loss, Stage::planned(pp.index(), p).loss_rank())?;
        dp.all_reduce_tensor(&mut loss, ReduceOp::Avg)?;
        let span = Instant::now();
        let mut params = model.params_mut();
        // 3. the global norm: dp replicas hold the same gradients now; tp shards, ZeRO chunks, ep
        //    experts and pp stages add up their parts
        let groups = NormGroups { tp, pp, ep, zero: sharding.dense, expert_zero: sharding.experts };
        let grad_sq = optimizer::global_grad_sum_squares(&params, &groups)?;
        // the step's one CPU–GPU sync point: the loss and the gradient norm, read together
        let read = ops::concat(&[&loss, &grad_sq]).to_vec();
        let (loss, grad_norm) = (read[0], (read[1] as f64).sqrt());
        if !loss.is_finite() {
            return Err(run::not_finite(cfg, loss, step, first_step));
        }
        let lr = optimizer::lr_at(t, step);
        // 4. AdamW, clipping folded in
        optimizer.step(&mut params, t, lr, optimizer::clip_factor(grad_norm, t.grad_clip));
        if stage == 1 || stage == 2 {
            // 5. ZeRO-1, 2: the updated chunks to every rank, Shard(0) → Replicate
            fsdp::gather_weights(&sharding, &mut params, bucket_values(p.bucket_mb))?;
        }
        watch.span("optimizer".into(), span);
        // the loss on held-out data, of the whole model gathered onto rank 0 (`train/validate.rs`)
        let val_loss = match validate::due(cfg, step) {
            true => validate::validate(me, cfg, data, &model, &optimizer)?,
            false => None,
        };
        let end = StepEnd { step, loss, lr, grad_norm, activations_held, held, val_loss };
        watch.step_ends(&end, &mut model)?;
        // a signal stops every rank after the same step: they agree on it in one collective
        let signal = if opts.stop_on_signal { stop::agreed(me.group(Axis::World))? } else { None };
        let saved = start.checkpoints.save_if_due(me, cfg, step, (&model, &optimizer), signal.is_some())?;
        if let Some(signal) = signal {
            watch.stopped(Stopped { signal, checkpoint: saved, dropped: None });
            break;
        }
    }
    let mut summary = watch.finish(&model)?;
    if let Some(tape) = tape {
        tape.save(me.rank, cfg)?;
        summary.routing_replaced = tape.replaced();
    }
    Ok(summary)
}
