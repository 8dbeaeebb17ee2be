//! # The driver: the steps, and everything around them
//!
//! `train_rank` is what every rank runs: it has `train/compose.rs` put the rank's trainer
//! together, then runs the steps, doing between them what is not training:
//!
//! ```text
//! before a step   start its clock (and the GPU profile, when asked)
//! the step        `Trainer::step` (`train/step.rs`), with the hooks below
//! after it        the held-out loss and a sample when due (`validate.rs`, `sample.rs`), the
//!                 step's line, metrics and trace (`watch.rs`), a checkpoint when due (`run.rs`)
//! a signal        every rank agrees on it after the step, or between micro-batches (the
//!                 hooks' stop points), saves where it stopped and ends (`stop.rs`)
//! ```
//! The step sees the driver only through `StepHooks` (`parallel/mod.rs`): the spans it records,
//! and the stop points it asks at.
//!
//! **Stopping inside a step.** Every rank asks "stop?" in one collective, so every rank must ask
//! at the same points. Without a pipeline the ranks are all between micro-batches at once; in a
//! pipeline they never are, so each asks at the same points of its *own* schedule: before
//! receiving its k-th forward's input, for k a multiple of p·V (one round of the pipeline).
//! (Asking before every forward deadlocks the interleaved schedule from p = 3: rank p − 1 would
//! wait for a gradient rank 0 makes only after its own question. Tried on a model of the
//! schedules for p ≤ 8, V ≤ 4.) What the other stages sent before they stopped is drained around
//! the walk (`parallel/schedules.rs`'s `Drained`). On NCCL a send waits on the GPU for its
//! receive, so there the driver asks nothing inside a pipeline's step.

use super::compose;
use super::memory::Held;
use super::run::Shared;
use super::step::Stepped;
use super::watch::{StepEnd, Watch};
use super::{memory, sample, stop, validate, Options, Stopped, Summary};
use crate::comm::launcher::Rank;
use crate::comm::process_grid::Axis;
use crate::comm::Group;
use crate::config::Config;
use crate::data::Dataset;
use crate::model::optimizer::Optimizer;
use crate::model::Llama;
use crate::parallel::StepHooks;
use anyhow::Result;
use std::cell::Cell;
use std::time::Instant;

/// The steps of one rank, from its first to the run's last, or to a signal.
pub(super) fn train_rank(me: &Rank, cfg: &Config, data: &Dataset, opts: Options, shared: Shared) -> Result<Summary> {
    // this rank's model, optimizer and reducers, as the config says (`train/compose.rs`)
    let (mut tr, beside) = compose::assemble(me, cfg, data, opts.routing_tape, &shared)?;
    let first_step = tr.first_step;
    let at = (first_step, tr.model.place(), shared.cpu_peak, shared.checkpoints.run_id());
    let mut watch = Watch::new(me, cfg, opts, at)?; // metrics, trace, timing, memory
    let pp = me.group(Axis::Pp);
    // on NCCL a pipeline's send waits on the GPU for its receive, and a step stopped part-way
    // leaves some unreceived: there a signal waits for the step's end
    let may_stop = opts.stop_on_signal && (pp.size() == 1 || !pp.moves_on_device(&tr.model.place()));
    // where every stage may stop together: at the start of a round of the pipeline (1: anywhere)
    let (stage, one_stage) = (tr.pipeline.stage, pp.size() == 1);
    let round = if one_stage { 1 } else { stage.count * stage.chunks };
    // what samples continue, found (and checked) before the first step
    let prompt = (cfg.train.sample_every > 0).then(|| sample::prompt(cfg, data)).transpose()?;
    for step in first_step..cfg.train.steps {
        watch.step_starts(step);
        let (signal, held) = (Cell::new(None), Cell::new(None));
        let hooks = Hooks { watch: &watch, world: me.group(Axis::World), may_stop, round, signal, held };
        let stepped = tr.step(step, &hooks)?;
        let (signal, held) = (hooks.signal.get(), hooks.held.get());
        beside.step_done();
        let (loss, lr, grad_norm, activations_held) = match stepped {
            Stepped::Done { loss, lr, grad_norm, activations_held } => (loss, lr, grad_norm, activations_held),
            Stepped::Stopped { micro_batches } => {
                // the step's gradients so far are dropped: the weights are still those of the step before
                let saved = shared.checkpoints.save_before(me, cfg, (step, first_step), (&tr.model, &*tr.optimizer))?;
                let signal = signal.expect("only a signal stops a step part-way");
                watch.stopped(Stopped { signal, checkpoint: saved, dropped: Some(micro_batches) });
                break;
            }
        };
        beside.balance(me, cfg)?; // DeepSeekMoE's bias moves towards even loads
        let held = held.expect("a finished step had its gradients ready");
        // the loss on held-out data and a sample, of the whole model gathered onto rank 0
        // (`train/validate.rs`, `train/sample.rs`), when due
        let validating = std::time::Instant::now();
        let state = (&tr.model, &*tr.optimizer);
        let (val_loss, sample) = validate::after_step(me, (cfg, data), step, state, prompt.as_deref())?;
        let validation_s = validating.elapsed().as_secs_f64();
        let end = StepEnd { step, loss, lr, grad_norm, activations_held, held, val_loss, sample, validation_s };
        watch.step_ends(&end, &mut tr.model, beside.experts())?;
        // a signal stops every rank after the same step: they agree on it in one collective
        let signal = if opts.stop_on_signal { stop::agreed(me.group(Axis::World))? } else { None };
        let saved = shared.checkpoints.save_if_due(me, cfg, step, (&tr.model, &*tr.optimizer), signal.is_some())?;
        if let (Some(at), None) = (&saved, signal) {
            watch.saved(at); // a signal's save is said with the stop
        }
        if let Some(signal) = signal {
            watch.stopped(Stopped { signal, checkpoint: saved, dropped: None });
            break;
        }
    }
    let mut summary = watch.finish(&tr.model)?;
    beside.finish(me, cfg, &mut summary)?;
    Ok(summary)
}

/// The driver's side of the step: its spans go to the watch, and between micro-batches every
/// rank asks whether a signal came (`train/stop.rs`).
struct Hooks<'h, 'w> {
    watch: &'h Watch<'w>,
    world: &'h Group,
    /// Whether the step may stop part-way at all (a run that stops on signals, not a pipeline on
    /// NCCL).
    may_stop: bool,
    /// It asks only before forwards k that are a multiple of this: p·V (1 without a pipeline).
    round: usize,
    /// The signal every rank agreed on, once one came.
    signal: Cell<Option<i32>>,
    /// What weights, gradients and AdamW held when the gradients were ready.
    held: Cell<Option<Held>>,
}

impl StepHooks for Hooks<'_, '_> {
    fn span(&self, name: String, start: Instant) {
        self.watch.span(name, start);
    }

    /// Before every micro-batch but the first (in a pipeline, every round's first): a step of
    /// many micro-batches still stops soon after a signal.
    fn asks_before(&self, k: usize) -> bool {
        self.may_stop && k > 0 && k.is_multiple_of(self.round)
    }

    fn stop_here(&self) -> Result<bool> {
        self.signal.set(stop::agreed(self.world)?);
        Ok(self.signal.get().is_some())
    }

    fn gradients_ready(&self, start: Instant, model: &Llama, optimizer: &dyn Optimizer) {
        self.held.set(Some(memory::held(model, optimizer)));
        self.watch.span("wait for gradients".into(), start);
    }
}
