//! # Zero bubble: the backward's two halves apart, W in the bubble
//!
//! Qi et al. 2023. A backward is two halves (`model/deferred_grads.rs`): B, the input gradient,
//! which the previous stage waits for, and W, the weight gradients, which nobody waits for. Split, B goes upstream sooner and W fills the time a stage would sit idle:
//!
//! - **ZB-H1**: 1F1B's order of F and B, and stage s runs micro-batch k's W right after its B of
//!   micro-batch k + s (the rest at the end). Stage s then holds s more micro-batches than 1F1B's
//!   p − s (their W's inputs), p in all, so no stage holds more than 1F1B's first; the bubble falls
//!   from (p − 1)(F + B + W) to (p − 1)(F + B − W), a third of it when the three take as long.
//! - **ZBV**: two chunks per rank laid out as a V (`model/stage.rs`: rank r holds virtual stages
//!   r and 2p − 1 − r), so rank 0 both starts and ends each micro-batch (and a tied embedding
//!   and output layer are one weight on one rank). Each rank fills the
//!   pipeline with chunk-0 forwards (2(p − r) − 1), interleaves chunk-1 forwards as the V turns,
//!   then repeats F B W on chunk 0 and on chunk 1; in the cool-down the B's go first, and the W's
//!   fill the gaps the B's leave. With F = B = W the bubble is nearly gone for the same peak
//!   memory as 1F1B (p micro-batches, 2p chunks of half a micro-batch). It needs m ≥ 2p − 1.
//!
//! Both are walked as lists of actions (`pipeline_actions.rs`'s `Listed`); each B keeps its
//! weight GEMMs where `keeps_w` says, a `Later` (`model/deferred_grads.rs`), until its W.

use crate::model::deferred_grads::Later;
use crate::model::split::WeightGrads;
use crate::model::stage::Stage;
use crate::ops::tensor::Tensor;
use crate::parallel::pipeline_1f1b::OneFOneB;
use crate::parallel::pipeline_parallel::{name, Runner};
use crate::parallel::pipeline_schedule::{Action, Actions, Schedule, Work};
use anyhow::Result;
use std::collections::VecDeque;
use std::time::Instant;

/// A stage's B and W, what `Listed` drives for a zero-bubble schedule.
impl Runner<'_, '_, '_> {
    /// `backward_chunk` whose weight GEMMs go to `kept`, which keeps them for a later `weights`
    /// (a zero-bubble schedule's B): no gradient is complete yet.
    pub fn backward_input(
        &mut self,
        work: (usize, usize),
        dy: Option<Tensor>,
        kept: &mut dyn WeightGrads,
    ) -> Result<Option<Tensor>> {
        self.backward_into(work, dy, kept, false)
    }

    /// The W of micro-batch `i` through model chunk `chunk`: the weight GEMMs its B left.
    pub fn weights(&mut self, (i, chunk): (usize, usize)) -> Result<()> {
        let start = Instant::now();
        let last = i + 1 == self.plan.micro_batches;
        let ready = &mut *self.ready;
        self.model.backward_weights(chunk, &mut |p| ready(p, last))?;
        self.hooks.span(name("weights", (i, chunk), self.stage), start);
        Ok(())
    }
}

/// ZB-H1: 1F1B's F and B, each stage's W's `stage` backwards late.
pub struct ZbH1;

impl Schedule for ZbH1 {
    fn actions(&self, stages: usize, stage: usize, m: usize, _: usize) -> Actions {
        let plan = OneFOneB.actions(stages, stage, m, 1);
        Box::new(DelayedWeights { plan, delay: stage, pending: VecDeque::new(), next: None })
    }
    /// 1F1B's: one forward per stage below.
    fn warmup(&self, stages: usize, stage: usize, m: usize, _: usize) -> usize {
        OneFOneB.warmup(stages, stage, m, 1)
    }
    /// Its W's come `stage` backwards late: p micro-batches on every stage (at most m).
    fn held(&self, stages: usize, _: usize, m: usize, _: usize) -> usize {
        stages.min(m)
    }
    fn keeps_w(&self) -> Option<Box<dyn WeightGrads>> {
        Some(Box::new(Later::default()))
    }
}

/// ZBV: two chunks a rank, laid out as a V.
pub struct Zbv;

impl Schedule for Zbv {
    /// Always two chunks: rank r holds virtual stages r and 2p − 1 − r.
    fn stage(&self, index: usize, count: usize, _: usize) -> Stage {
        Stage::v(index, count)
    }
    fn actions(&self, stages: usize, stage: usize, m: usize, _: usize) -> Actions {
        zbv(stages, stage, m)
    }
    /// The fill, the turn and the first chunk-1 forward: 2p on every rank.
    fn warmup(&self, stages: usize, _: usize, _: usize, _: usize) -> usize {
        2 * stages
    }
    fn held(&self, stages: usize, _: usize, _: usize, _: usize) -> usize {
        2 * stages
    }
    fn keeps_w(&self) -> Option<Box<dyn WeightGrads>> {
        Some(Box::new(Later::default()))
    }
}

/// A schedule of whole backwards with each split: B where the backward was, and its W after
/// the B `delay` backwards later (the last `delay` at the end).
struct DelayedWeights {
    plan: Actions,
    delay: usize,
    /// The B's whose W is still to come, oldest first (at most `delay` + 1).
    pending: VecDeque<Work>,
    /// A W due right after the action just given.
    next: Option<Action>,
}

impl Iterator for DelayedWeights {
    type Item = Action;
    fn next(&mut self) -> Option<Action> {
        if let Some(work) = self.next.take() {
            return Some(work);
        }
        match self.plan.next() {
            Some(Action::Backward(work)) => {
                self.pending.push_back(work);
                if self.pending.len() > self.delay {
                    self.next = self.pending.pop_front().map(Action::Weights);
                }
                Some(Action::InputGrad(work))
            }
            Some(a) => Some(a),
            None => self.pending.pop_front().map(Action::Weights),
        }
    }
}

/// Rank r's ZBV (m ≥ 2p − 1): chunk 0 is virtual stage r, chunk 1 virtual stage 2p − 1 − r.
fn zbv(p: usize, r: usize, m: usize) -> Actions {
    use Action::{Forward as F, InputGrad as B, Weights as W};
    let (c0, c1) = (|micro| Work { micro, chunk: 0 }, |micro| Work { micro, chunk: 1 });
    let fill = 2 * (p - r) - 1; // chunk-0 forwards before the first chunk-1 forward

    // 1. fill the way down: chunk-0 forwards
    let down = (0..fill).map(move |i| F(c0(i)));
    // 2. the first micro-batches come back up: a chunk-1 forward, then the next chunk-0 one, r times
    let turn = (0..r).flat_map(move |i| [F(c1(i)), F(c0(fill + i))]);
    // 3. the first chunk-1 backwards, B and W at once (p − r of them)
    let first = (r..p).flat_map(move |i| [F(c1(i)), B(c1(i - r)), W(c1(i - r))]);
    // 4. steady: F B W on chunk 0, then on chunk 1 (m − p rounds; chunk-0 forwards run out first)
    let steady = (0..m - p).flat_map(move |k| {
        let f0 = (fill + r + k < m).then(|| F(c0(fill + r + k)));
        f0.into_iter().chain([B(c0(k)), W(c0(k)), F(c1(p + k)), B(c1(p - r + k)), W(c1(p - r + k))])
    });
    // 5. cool-down: the B's first (the previous rank waits for them), W's in the gaps after
    let both = (0..r).flat_map(move |j| [B(c0(m - p + j)), B(c1(m - r + j))]);
    let gaps = (0..p - r).flat_map(move |j| [B(c0(m - p + r + j)), W(c0(m - p + j))]);
    let rest = (m - r..m).map(move |i| W(c1(i))).chain((m - r..m).map(move |i| W(c0(i))));
    Box::new(down.chain(turn).chain(first).chain(steady).chain(both).chain(gaps).chain(rest))
}
