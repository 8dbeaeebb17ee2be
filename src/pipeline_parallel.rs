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
//! Where a stage sends one way and the next action receives from the same neighbour (a forward
//! followed by a backward, or the reverse), both go in one paired `send_recv`.

use crate::comm::Group;
use crate::config::PpSchedule;
use crate::model::{Llama, Param, StageGrad, StageInput, StageOutput};
use crate::tensor::{Place, Tensor};
use anyhow::Result;
use std::ops::Range;
use std::time::Instant;

/// A pipeline stage: `index` of `count`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stage {
    pub index: usize,
    pub count: usize,
}

impl Stage {
    /// The whole model on one stage.
    pub const WHOLE: Stage = Stage { index: 0, count: 1 };

    pub fn is_first(&self) -> bool {
        self.index == 0
    }
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    /// This stage's layers out of `n`: `n / count` each, and one more on each of the first
    /// `n % count` stages (the last stage also carries the output layer and the loss).
    pub fn layers(&self, n: usize) -> Range<usize> {
        let (base, extra) = (n / self.count, n % self.count);
        let start = self.index * base + self.index.min(extra);
        start..start + base + usize::from(self.index < extra)
    }
}

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
/// stage, 0 elsewhere) and the most micro-batch activations it held at once.
pub struct StepStats {
    pub loss: f32,
    pub peak_activations: usize,
}

/// Runs the schedule over the pp group `pp`. `ready` sees each parameter whose gradient is
/// complete for the step (during the last micro-batch's backward), for data parallelism.
pub fn run_step(model: &mut Llama, pp: &Group, plan: &StepPlan, ready: &mut dyn FnMut(&Param)) -> Result<StepStats> {
    let stage = Stage { index: pp.index(), count: pp.size() };
    let m = plan.micro_batches;
    let actions = schedule(plan.kind, stage.count, stage.index, m);
    let (prev, next) = (stage.index.wrapping_sub(1), stage.index + 1);
    let mut inbox: Option<Tensor> = None; // what the next action needs, received early
    let place = model.place(); // received activations land on this rank's device
    let mut stats = StepStats { loss: 0.0, peak_activations: 0 };
    for (a, &action) in actions.iter().enumerate() {
        let start = Instant::now();
        let outgoing = match action {
            Action::Forward(i) => {
                // tokens feed the first stage, targets the last; the stages between need neither
                let (tokens, targets) = match stage.is_first() || stage.is_last() {
                    true => (plan.data)(i)?,
                    false => (Vec::new(), Vec::new()),
                };
                let input = match stage.is_first() {
                    true => StageInput::Tokens(&tokens),
                    false => StageInput::Hidden(receive(&mut inbox, pp, plan.hidden, prev, &place)?),
                };
                let out = model.forward_stage(input, plan.batch, &targets)?;
                stats.peak_activations = stats.peak_activations.max(model.activations_held());
                (plan.record)(format!("forward {i}"), start);
                match out {
                    StageOutput::Loss(loss) => {
                        stats.loss += loss / m as f32;
                        None
                    }
                    StageOutput::Hidden(x) => Some((x, next)),
                }
            }
            Action::Backward(i) => {
                let grad = match stage.is_last() {
                    true => StageGrad::Loss(1.0 / m as f32),
                    false => StageGrad::Hidden(receive(&mut inbox, pp, plan.hidden, next, &place)?),
                };
                let last = i + 1 == m;
                let dx = model.backward_stage(grad, &mut |p| {
                    if last {
                        ready(p)
                    }
                })?;
                (plan.record)(format!("backward {i}"), start);
                dx.map(|dx| (dx, prev))
            }
        };
        // the next action's input, if it comes from the neighbour this action sends to
        let wanted = match actions.get(a + 1) {
            Some(Action::Forward(_)) if !stage.is_first() => Some(prev),
            Some(Action::Backward(_)) if !stage.is_last() => Some(next),
            _ => None,
        };
        match (outgoing, wanted) {
            (Some((x, to)), Some(from)) if from == to => {
                let len = plan.hidden[0] * plan.hidden[1];
                inbox = Some(Tensor::from_host(&plan.hidden, pp.send_recv(&x.host_view(), to, len, from)?, &place));
            }
            (Some((x, to)), _) => pp.send(&x.host_view(), to)?,
            (None, _) => {}
        }
    }
    Ok(stats)
}

/// The tensor received early, or a blocking receive from `from` now.
fn receive(inbox: &mut Option<Tensor>, pp: &Group, shape: [usize; 2], from: usize, place: &Place) -> Result<Tensor> {
    match inbox.take() {
        Some(t) => Ok(t),
        None => Ok(Tensor::from_host(&shape, pp.recv(shape[0] * shape[1], from)?, place)),
    }
}
