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
//! soon as it can: stage s holds at most p − s micro-batches. `ferrotron schedule` draws both.
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
//! other. On the first stage there is nothing to receive forward (its input is tokens), on the
//! last nothing to send forward (its output is the loss): those messages are `None`.

use crate::comm::Group;
use crate::config::PpSchedule;
use crate::model::{Llama, Param, Stage, StageGrad, StageInput, StageOutput};
use crate::ops::tensor::{Place, Tensor};
use crate::ops::{self, DType};
use anyhow::Result;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Action {
    Forward(usize),
    Backward(usize),
}

/// The order of stage `stage`'s forwards and backwards of `m` micro-batches.
pub fn schedule(kind: PpSchedule, stages: usize, stage: usize, m: usize) -> Vec<Action> {
    use Action::{Backward, Forward};
    match kind {
        PpSchedule::Afab => (0..m).map(Forward).chain((0..m).map(Backward)).collect(),
        PpSchedule::OneFOneB => {
            let warmup = (stages - stage - 1).min(m);
            let mut actions: Vec<Action> = (0..warmup).map(Forward).collect();
            for i in 0..m - warmup {
                actions.extend([Forward(warmup + i), Backward(i)]); // steady state
            }
            actions.extend((m - warmup..m).map(Backward)); // cool-down
            actions
        }
    }
}

/// One training step's forwards and backwards on this stage.
pub struct StepPlan<'a> {
    pub kind: PpSchedule,
    pub micro_batches: usize,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// The shape of the activations between stages, `[batch × seq, hidden]`.
    pub hidden: [usize; 2],
    /// Micro-batch i's (tokens, targets).
    pub data: &'a dyn Fn(usize) -> Result<(Vec<u32>, Vec<i32>)>,
    /// Records a compute span (name, start).
    pub record: &'a dyn Fn(String, Instant),
}

/// What a step left: this stage's share of the loss (the mean over micro-batches on the last
/// stage, 0 elsewhere; a one-number f32 tensor on the stage's device) and the most micro-batch
/// activations it held at once.
pub struct StepStats {
    pub loss: Tensor,
    pub peak_activations: usize,
}

/// Runs the schedule over the pp group `pp`. `ready(p, last)` sees each parameter whose gradient
/// is complete for a micro-batch (`last`: for the step), for data parallelism.
pub fn run_step(
    model: &mut Llama,
    pp: &Group,
    plan: &StepPlan,
    ready: &mut dyn FnMut(&mut Param, bool),
) -> Result<StepStats> {
    let stage = Stage { index: pp.index(), count: pp.size() };
    let msg = Messages { pp, stage, shape: plan.hidden, place: model.place() };
    let loss = Tensor::zeros_on(&[1], &model.place(), DType::F32);
    let mut run = Runner { model, plan, stage, ready, stats: StepStats { loss, peak_activations: 0 } };
    let m = plan.micro_batches;
    match plan.kind {
        PpSchedule::Afab => {
            for i in 0..m {
                let x = msg.recv_forward()?;
                let y = run.forward(i, x)?;
                msg.send_forward(y)?;
            }
            for i in 0..m {
                let dy = msg.recv_backward()?;
                let dx = run.backward(i, dy)?;
                msg.send_backward(dx)?;
            }
        }
        PpSchedule::OneFOneB => {
            // warm-up: the forwards that fill the pipeline below this stage
            let warmup = (stage.count - stage.index - 1).min(m);
            for i in 0..warmup {
                let x = msg.recv_forward()?;
                let y = run.forward(i, x)?;
                msg.send_forward(y)?;
            }
            // steady state: one forward, one backward, each exchange one paired message
            let steady = m - warmup;
            let mut x = if steady > 0 { msg.recv_forward()? } else { None };
            for i in 0..steady {
                let y = run.forward(warmup + i, x.take())?;
                let dy = msg.send_forward_recv_backward(y)?;
                let dx = run.backward(i, dy)?;
                match i + 1 < steady {
                    true => x = msg.send_backward_recv_forward(dx)?,
                    false => msg.send_backward(dx)?,
                }
            }
            // cool-down: the backwards still owed
            for i in steady..m {
                let dy = msg.recv_backward()?;
                let dx = run.backward(i, dy)?;
                msg.send_backward(dx)?;
            }
        }
    }
    Ok(run.stats)
}

/// A stage's forward and backward of micro-batch i, with the step's bookkeeping.
struct Runner<'a, 'm, 'g> {
    model: &'m mut Llama<'g>,
    plan: &'a StepPlan<'a>,
    stage: Stage,
    ready: &'a mut dyn FnMut(&mut Param, bool),
    stats: StepStats,
}

impl Runner<'_, '_, '_> {
    /// Micro-batch i through this stage: from tokens (first stage) or `x`; returns the
    /// activations for the next stage, or `None` on the last (which adds up the loss).
    fn forward(&mut self, i: usize, x: Option<Tensor>) -> Result<Option<Tensor>> {
        let start = Instant::now();
        // tokens feed the first stage, targets the last; the stages between need neither
        let (tokens, targets) = match self.stage.is_first() || self.stage.is_last() {
            true => (self.plan.data)(i)?,
            false => (Vec::new(), Vec::new()),
        };
        let input = match x {
            Some(x) => StageInput::Hidden(x),
            None => StageInput::Tokens(&tokens),
        };
        let out = self.model.forward_stage(input, self.plan.batch, &targets)?;
        self.stats.peak_activations = self.stats.peak_activations.max(self.model.activations_held());
        (self.plan.record)(format!("forward {i}"), start);
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
    fn backward(&mut self, i: usize, dy: Option<Tensor>) -> Result<Option<Tensor>> {
        let start = Instant::now();
        let grad = match dy {
            Some(dy) => StageGrad::Hidden(dy),
            None => StageGrad::Loss(1.0 / self.plan.micro_batches as f32),
        };
        // gradients are complete for the step in the last micro-batch's backward
        let last = i + 1 == self.plan.micro_batches;
        let ready = &mut *self.ready;
        let dx = self.model.backward_stage(grad, &mut |p| ready(p, last))?;
        (self.plan.record)(format!("backward {i}"), start);
        Ok(dx)
    }
}

/// A stage's messages to its neighbours in the pp group: activations `[batch × seq, hidden]`
/// forward, their gradients backward.
struct Messages<'a> {
    pp: &'a Group,
    stage: Stage,
    shape: [usize; 2],
    place: Place,
}

impl Messages<'_> {
    fn prev(&self) -> Option<usize> {
        (!self.stage.is_first()).then(|| self.stage.index - 1)
    }
    fn next(&self) -> Option<usize> {
        (!self.stage.is_last()).then(|| self.stage.index + 1)
    }
    /// A message lands on this rank's device (on GPUs with NCCL it never touches the host).
    fn recv(&self, from: Option<usize>) -> Result<Option<Tensor>> {
        from.map(|f| self.pp.recv_tensor(&self.shape, &self.place, f)).transpose()
    }
    fn send(&self, t: Option<Tensor>, to: Option<usize>) -> Result<()> {
        match (t, to) {
            (Some(t), Some(to)) => self.pp.send_tensor(&t, to),
            _ => Ok(()),
        }
    }
    /// Sends `t` to `peer` and receives from the same `peer` in one step.
    fn exchange(&self, t: Option<Tensor>, peer: Option<usize>) -> Result<Option<Tensor>> {
        match (t, peer) {
            (Some(t), Some(p)) => Ok(Some(self.pp.send_recv_tensor(&t, p, &self.shape, p)?)),
            _ => self.recv(peer), // nothing to send: a stage end (first or last)
        }
    }

    fn recv_forward(&self) -> Result<Option<Tensor>> {
        self.recv(self.prev())
    }
    fn send_forward(&self, y: Option<Tensor>) -> Result<()> {
        self.send(y, self.next())
    }
    fn recv_backward(&self) -> Result<Option<Tensor>> {
        self.recv(self.next())
    }
    fn send_backward(&self, dx: Option<Tensor>) -> Result<()> {
        self.send(dx, self.prev())
    }
    fn send_forward_recv_backward(&self, y: Option<Tensor>) -> Result<Option<Tensor>> {
        self.exchange(y, self.next())
    }
    fn send_backward_recv_forward(&self, dx: Option<Tensor>) -> Result<Option<Tensor>> {
        self.exchange(dx, self.prev())
    }
}
