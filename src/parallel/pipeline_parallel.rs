//! # Pipeline parallelism: layers split into stages, micro-batches flowing through them
//!
//! Stage s holds a contiguous run of layers (the first stage also the embedding, the last the
//! final norm, the output layer and the loss). A micro-batch's activations travel forward from
//! stage to stage with `send`/`recv`, and its gradients travel back. With `m` micro-batches
//! (`grad_accum_steps`) and `p` stages, the order in which a stage runs its forwards (F) and
//! backwards (B) is the *schedule*:
//!
//! ```text
//! AFAB (all forward, all backward)            1F1B (one forward, one backward)
//! s0 F0F1F2F3 ·  ·  ·  ·  B0B1B2B3            s0 F0F1F2 ·  ·  B0F3 ·  B1 ·  B2 ·  B3
//! s1    F0F1F2F3 ·  · B0B1B2B3                s1    F0F1 ·  B0F2 ·B1F3 ·B2 ·  B3
//! s2       F0F1F2F3 B0B1B2B3                  s2       F0 B0F1 B1F2 B2F3 B3
//! ```
//! Both leave the same idle "bubble", (p − 1)/(m + p − 1) of the step, but AFAB keeps the
//! activations of all m micro-batches until the backwards start, while 1F1B starts backward as
//! soon as it can: stage s holds at most p − s micro-batches. `ferrotron schedule` draws them.
//!
//! **Interleaved 1F1B** (Megatron-LM, Narayanan et al. 2021) gives each rank V chunks of layers
//! instead of one run (`model/stage.rs`): a micro-batch goes through the ranks V times, each pass
//! 1/V of the work. The pipeline fills and drains in units of a chunk, so the bubble shrinks V
//! times, to (p − 1)/(V·m + p − 1) of the step, for V times more messages. Each rank runs the
//! forwards in groups of p micro-batches per chunk (chunk 0 of micro-batches 0..p, chunk 1 of the
//! same, …), the backwards in the same order with the chunks reversed:
//!
//! ```text
//! p = 2, V = 2, m = 4 (Fᶜᵢ: micro-batch i through chunk c; a backward takes twice a forward)
//! rank 0  F⁰₀F⁰₁F¹₀F¹₁F⁰₂   B¹₀···F⁰₃B¹₁···F¹₂B⁰₀···F¹₃B⁰₁···   B¹₂···   B¹₃···B⁰₂···B⁰₃···
//! rank 1     F⁰₀F⁰₁F¹₀B¹₀···F¹₁B¹₁···F⁰₂B⁰₀···F⁰₃B⁰₁···F¹₂B¹₂···F¹₃B¹₃···B⁰₂···B⁰₃···
//! ```
//! (`ferrotron schedule --schedule all --virtual 2` draws it beside AFAB and 1F1B.)
//!
//! **Zero bubble** (ZB-H1, ZBV: `pipeline_zero_bubble.rs`) cuts each backward in two:
//! B, the input gradient, goes upstream at once (`Llama::backward_chunk` given `Later`), and W,
//! the weight GEMMs (`model/deferred_grads.rs`), runs later in time the stage would spend idle
//! (`Llama::backward_weights`). Data parallelism hears a gradient is ready only after its W.
//!
//! Messages between neighbours have the names they have in Megatron and picotron:
//!
//! ```text
//! recv_forward   activations from the previous stage     send_forward   activations to the next
//! recv_backward  their gradient from the next stage      send_backward  a gradient to the previous
//! send_forward_recv_backward   (1F1B, steady state: a forward's output out, a gradient in)
//! send_backward_recv_forward   (1F1B, steady state: a gradient out, the next input in)
//! ```
//! The paired forms go in one `send_recv`, so two neighbours that both send never wait on each
//! other (`pipeline_messages.rs`). On the first stage there is nothing to receive forward (its
//! input is tokens), on the last nothing to send forward (its output is the loss): those
//! messages are `None`.
//!
//! **A schedule is a walk** (`Walk`): this file's engine runs a stage's forwards and backwards
//! (`Runner`) in the order a walk says. AFAB is below: two loops. 1F1B's walk, with its paired
//! messages, is its lesson's (`pipeline_1f1b.rs`, step 13); the interleaved and zero-bubble
//! schedules are walked as lists of actions, each message through a mailbox
//! (`pipeline_actions.rs`, steps 14 and 15). The composition root picks the walk.
//!
//! **Between micro-batches** the driver may end a step early (a signal): the schedule asks its
//! `StepHooks` before each forward (`Runner::stops_here`), and the hooks say at which forwards
//! every stage may stop together (`train/driver.rs`); what the others sent before they stopped
//! is drained around the walk (`schedules.rs`).

use crate::comm::Group;
use crate::model::llama::pipeline::{StageGrad, StageInput, StageOutput};
use crate::model::split::{Now, WeightGrads};
use crate::model::stage::Stage;
use crate::model::{Llama, Param};
use crate::ops::tensor::Tensor;
use crate::ops::{self, DType};
use crate::parallel::pipeline_messages::Messages;
use crate::parallel::StepHooks;
use anyhow::Result;
use std::cell::RefCell;
use std::ops::Range;
use std::time::Instant;

/// This stage's part in every training step.
#[derive(Clone, Copy)]
pub struct StepPlan<'g> {
    /// The pipeline group: this stage and its neighbours.
    pub pp: &'g Group,
    /// How this stage walks the schedule (`Afab` below; the others from their lessons' files).
    pub walk: &'static dyn Walk,
    pub micro_batches: usize,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// This rank's pipeline stage: its model chunks and how they are laid out (`schedules::stage_of`).
    pub stage: Stage,
    /// The shape of the activations between stages, `[batch × seq, hidden]`.
    pub hidden: [usize; 2],
}

/// Micro-batch i's (tokens, targets).
pub type Data<'a> = &'a dyn Fn(usize) -> Result<(Vec<u32>, Vec<i32>)>;

/// What a step left: this stage's share of the loss (the mean over micro-batches on the last
/// stage, 0 elsewhere; a one-number f32 tensor on the stage's device) and the most micro-batch
/// activations it held at once.
pub struct StepStats {
    pub loss: Tensor,
    pub peak_activations: usize,
    /// Set when the hooks ended the step part-way: the micro-batches this rank had begun.
    pub stopped: Option<usize>,
}

/// Runs one step's schedule on this stage, reading `data` and telling the driver's `hooks`.
/// `ready(p, last)` sees each parameter whose gradient is complete for a micro-batch (`last`: for
/// the step), for data parallelism.
pub fn run_step(
    model: &mut Llama,
    plan: &StepPlan,
    (data, hooks): (Data, &dyn StepHooks),
    ready: &mut dyn FnMut(&mut Param, bool),
) -> Result<StepStats> {
    let (stage, pp) = (plan.stage, plan.pp);
    let received = RefCell::new(vec![0; stage.count]);
    let msg = Messages { pp, stage, shape: plan.hidden, place: model.place(), received };
    let loss = Tensor::zeros_on(&[1], &model.place(), DType::F32);
    let stats = StepStats { loss, peak_activations: 0, stopped: None };
    let mut run = Runner { model, plan, stage, ready, stats, forwards: 0, data, hooks };
    if let Some(k) = plan.walk.walk(&mut run, &msg)? {
        run.stats.stopped = Some(k / stage.chunks);
    }
    Ok(run.stats)
}

/// How a stage walks one step's schedule: its forwards and backwards in order, and the messages
/// between them — the seam every schedule plugs into. AFAB is below; 1F1B walks in
/// `pipeline_1f1b.rs`, the schedules walked as lists of actions (interleaved, zero bubble) in
/// `pipeline_actions.rs`, each chosen by the composition root (`train/compose.rs`).
pub trait Walk {
    /// The step on this stage; `Some(k)` if the hooks stopped it before forward k.
    fn walk(&self, run: &mut Runner, msg: &Messages) -> Result<Option<usize>>;
}

/// All forward, all backward: every micro-batch's forward, then every backward.
pub struct Afab;

impl Walk for Afab {
    fn walk(&self, run: &mut Runner, msg: &Messages) -> Result<Option<usize>> {
        let m = run.plan.micro_batches;
        if let Some(k) = run.forward_each(msg, 0..m)? {
            return Ok(Some(k));
        }
        run.backward_each(msg, 0..m)?;
        Ok(None)
    }
}

/// A stage's forward and backward of micro-batch i, with the step's bookkeeping: what a `Walk`
/// drives.
pub struct Runner<'a, 'm, 'g> {
    pub(super) model: &'m mut Llama<'g>,
    pub plan: &'a StepPlan<'a>,
    pub stage: Stage,
    data: Data<'a>,
    pub(super) ready: &'a mut dyn FnMut(&mut Param, bool),
    stats: StepStats,
    /// The forwards run so far in the step.
    pub forwards: usize,
    pub hooks: &'a dyn StepHooks,
}

impl Runner<'_, '_, '_> {
    /// Micro-batch i through this stage: from tokens (first stage) or `x`; returns the
    /// activations for the next stage, or `None` on the last (which adds up the loss).
    pub fn forward(&mut self, i: usize, x: Option<Tensor>) -> Result<Option<Tensor>> {
        self.forward_chunk((i, 0), x)
    }

    /// The forwards of micro-batches `range`, each input received from the previous stage and
    /// its output sent to the next (AFAB's; 1F1B's warm-up); `Some(k)` if the hooks stopped the
    /// step before forward k.
    pub fn forward_each(&mut self, msg: &Messages, range: Range<usize>) -> Result<Option<usize>> {
        for i in range {
            if self.stops_here()? {
                return Ok(Some(self.forwards));
            }
            let x = msg.recv_forward()?;
            let y = self.forward(i, x)?;
            msg.send_forward(y)?;
        }
        Ok(None)
    }

    /// The backwards of micro-batches `range`, each gradient received from the next stage and
    /// the result sent to the previous (AFAB's; 1F1B's cool-down).
    pub fn backward_each(&mut self, msg: &Messages, range: Range<usize>) -> Result<()> {
        for i in range {
            let dy = msg.recv_backward()?;
            let dx = self.backward(i, dy)?;
            msg.send_backward(dx)?;
        }
        Ok(())
    }

    /// Before the next forward's input is received: whether the driver ends the step here.
    pub fn stops_here(&self) -> Result<bool> {
        Ok(self.hooks.asks_before(self.forwards) && self.hooks.stop_here()?)
    }

    /// `forward` of micro-batch `i` through model chunk `chunk`.
    pub fn forward_chunk(&mut self, (i, chunk): (usize, usize), x: Option<Tensor>) -> Result<Option<Tensor>> {
        self.forwards += 1;
        let start = Instant::now();
        // tokens feed the first stage, targets the last; the stages between need neither
        let (tokens, targets) = match self.stage.is_first() || self.stage.is_last() {
            true => (self.data)(i)?,
            false => (Vec::new(), Vec::new()),
        };
        let input = match x {
            Some(x) => StageInput::Hidden(x),
            None => StageInput::Tokens(&tokens),
        };
        let out = self.model.forward_chunk(chunk, input, self.plan.batch, &targets)?;
        self.stats.peak_activations = self.stats.peak_activations.max(self.model.activations_held());
        self.hooks.span(name("forward", (i, chunk), self.stage), start);
        Ok(match out {
            StageOutput::Loss(loss) => {
                ops::add_scaled(&mut self.stats.loss, loss, 1.0 / self.plan.micro_batches as f32);
                None
            }
            StageOutput::Hidden(y) => Some(y),
        })
    }

    /// The backward of micro-batch i (the oldest held): from the loss (last stage) or `dy`;
    /// returns the gradient for the previous stage, or `None` on the first.
    pub fn backward(&mut self, i: usize, dy: Option<Tensor>) -> Result<Option<Tensor>> {
        self.backward_chunk((i, 0), dy)
    }

    /// `backward` of micro-batch `i` through model chunk `chunk`: its weight gradients made now,
    /// and data parallelism told of each one complete.
    pub fn backward_chunk(&mut self, work: (usize, usize), dy: Option<Tensor>) -> Result<Option<Tensor>> {
        self.backward_into(work, dy, &mut Now, true)
    }

    /// The backward through `work`'s chunk, its weight GEMMs to `dw`; `tell`: data parallelism
    /// hears of each gradient complete.
    pub(super) fn backward_into(
        &mut self,
        (i, chunk): (usize, usize),
        dy: Option<Tensor>,
        dw: &mut dyn WeightGrads,
        tell: bool,
    ) -> Result<Option<Tensor>> {
        let start = Instant::now();
        let grad = match dy {
            Some(dy) => StageGrad::Hidden(dy),
            None => StageGrad::Loss(1.0 / self.plan.micro_batches as f32),
        };
        // a chunk's gradients are complete for the step in its last micro-batch's backward (W)
        let last = i + 1 == self.plan.micro_batches;
        let ready = &mut *self.ready;
        let dx = match tell {
            true => self.model.backward_chunk(chunk, grad, dw, &mut |p| ready(p, last))?,
            false => self.model.backward_chunk(chunk, grad, dw, &mut |_| {})?,
        };
        self.hooks.span(name("backward", (i, chunk), self.stage), start);
        Ok(dx)
    }
}

/// A span's name: "forward 3", or with model chunks "forward 3.1" (micro-batch 3, chunk 1).
pub(super) fn name(what: &str, (micro, chunk): (usize, usize), stage: Stage) -> String {
    match stage.chunks {
        1 => format!("{what} {micro}"),
        _ => format!("{what} {micro}.{chunk}"),
    }
}
