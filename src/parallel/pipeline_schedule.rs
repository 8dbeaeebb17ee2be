//! # A pipeline's schedule: the order of a stage's forwards and backwards
//!
//! The schedules of `pipeline_parallel.rs`'s lesson (AFAB, 1F1B, interleaved 1F1B, and the
//! zero-bubble ZB-H1 and ZBV) as data: for stage s of p, with m micro-batches and V model chunks
//! per rank, the list of `F`, `B` (and `W`) it runs in one step. The training step walks it
//! (`pipeline_parallel::run_step`), each rank also replays its neighbours' to know what they send
//! (the mailbox, and the drain after a stop), and `ferrotron schedule` plays it on a clock to draw
//! it. It is made as it is walked: a step of millions of micro-batches holds no list of them.
//!
//! **Zero bubble** (Qi et al. 2023). A backward is two halves (`model/deferred_grads.rs`): B, the
//! input gradient, which the previous stage waits for, and W, the weight gradients, which nobody
//! waits for. Split, B goes upstream sooner and W fills the time a stage would sit idle:
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

use crate::config::PpSchedule;
use crate::model::Stage;
use std::collections::VecDeque;

/// Micro-batch `micro` through model chunk `chunk` (0 but in the schedules with model chunks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Work {
    pub micro: usize,
    pub chunk: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Forward(Work),
    /// The whole backward: the input gradient, sent upstream, and the weight gradients.
    Backward(Work),
    /// The zero-bubble schedules' B: the input gradient alone, the weight GEMMs left for a later
    /// `Weights`.
    InputGrad(Work),
    /// W: the weight GEMMs an `InputGrad` left.
    Weights(Work),
}

impl Action {
    pub fn work(self) -> Work {
        match self {
            Action::Forward(w) | Action::Backward(w) | Action::InputGrad(w) | Action::Weights(w) => w,
        }
    }
}

/// `F3` / `B3` / `W3`: the forward, backward or weight gradients of micro-batch 3; `{:#}` adds
/// the model chunk, `F3.1` (the names of the schedules with chunks).
impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let letter = match self {
            Action::Forward(_) => 'F',
            Action::Backward(_) | Action::InputGrad(_) => 'B',
            Action::Weights(_) => 'W',
        };
        let w = self.work();
        match f.alternate() {
            true => write!(f, "{letter}{}.{}", w.micro, w.chunk),
            false => write!(f, "{letter}{}", w.micro),
        }
    }
}

/// The order of stage `stage`'s forwards and backwards of `m` micro-batches, each rank holding
/// `chunks` model chunks (1 but for `Interleaved`; `Zbv` always 2). Made as it is walked: a step
/// of millions of micro-batches holds no list of them.
pub fn schedule(kind: PpSchedule, stages: usize, stage: usize, m: usize, chunks: usize) -> Schedule {
    use Action::{Backward, Forward};
    let one = |micro| Work { micro, chunk: 0 };
    match kind {
        PpSchedule::Afab => Box::new((0..m).map(move |i| Forward(one(i))).chain((0..m).map(move |i| Backward(one(i))))),
        PpSchedule::OneFOneB => one_f_one_b(m, warmup(kind, stages, stage, m, 1), move |k, _| one(k)),
        PpSchedule::Interleaved => {
            // the k-th forward (or backward) of the rank: groups of `stages` micro-batches per
            // chunk, chunks in order forward and reversed backward
            let per = stages * chunks;
            let work = move |k: usize, forward: bool| {
                let chunk = k % per / stages;
                let chunk = if forward { chunk } else { chunks - 1 - chunk };
                Work { micro: k / per * stages + k % stages, chunk }
            };
            one_f_one_b(m * chunks, warmup(kind, stages, stage, m, chunks), work)
        }
        PpSchedule::ZbH1 => {
            let plan = one_f_one_b(m, warmup(kind, stages, stage, m, 1), move |k, _| one(k));
            Box::new(DelayedWeights { plan, delay: stage, pending: VecDeque::new(), next: None })
        }
        PpSchedule::Zbv => zbv(stages, stage, m),
    }
}

/// A schedule of whole backwards with each split: B where the backward was, and its W after
/// the B `delay` backwards later (the last `delay` at the end).
struct DelayedWeights {
    plan: Schedule,
    delay: usize,
    /// The B's whose W is still to come, oldest first (at most `delay` + 1).
    pending: VecDeque<Work>,
    /// A W due right after the action just given.
    next: Option<Action>,
}

impl Iterator for DelayedWeights {
    type Item = Action;
    fn next(&mut self) -> Option<Action> {
        if let Some(w) = self.next.take() {
            return Some(w);
        }
        match self.plan.next() {
            Some(Action::Backward(w)) => {
                self.pending.push_back(w);
                if self.pending.len() > self.delay {
                    self.next = self.pending.pop_front().map(Action::Weights);
                }
                Some(Action::InputGrad(w))
            }
            Some(a) => Some(a),
            None => self.pending.pop_front().map(Action::Weights),
        }
    }
}

/// Rank r's ZBV (m ≥ 2p − 1): chunk 0 is virtual stage r, chunk 1 virtual stage 2p − 1 − r.
fn zbv(p: usize, r: usize, m: usize) -> Schedule {
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

/// A stage's actions of one step, in order.
pub type Schedule = Box<dyn Iterator<Item = Action> + Send>;

/// The forwards (of a chunk each) stage `stage` runs before its first backward: all of them
/// (AFAB); one per stage below it (1F1B, ZB-H1); with interleaving, those twice over (they come
/// back through chunk 1, …) plus a group of `stages` per further chunk; ZBV's 2p on every rank.
pub fn warmup(kind: PpSchedule, stages: usize, stage: usize, m: usize, chunks: usize) -> usize {
    match kind {
        PpSchedule::Afab => m,
        PpSchedule::OneFOneB | PpSchedule::ZbH1 => (stages - stage - 1).min(m),
        PpSchedule::Interleaved => ((stages - stage - 1) * 2 + (chunks - 1) * stages).min(m * chunks),
        PpSchedule::Zbv => 2 * stages, // the fill, the turn and the first chunk-1 forward
    }
}

/// The most micro-batch chunks stage `stage` holds at once (forward done, backward, or with the
/// zero-bubble schedules its W, not yet): one more than its warm-up, but for ZB-H1, whose W's
/// come `stage` backwards late (p, at most m), and ZBV's 2p.
pub fn held(kind: PpSchedule, stages: usize, stage: usize, m: usize, chunks: usize) -> usize {
    match kind {
        PpSchedule::ZbH1 => stages.min(m),
        PpSchedule::Zbv => 2 * stages,
        _ => (warmup(kind, stages, stage, m, chunks) + 1).min(m * chunks),
    }
}

/// `n` forwards and `n` backwards (the k-th of each being `work(k, forward)`): `warmup` forwards,
/// then one forward and one backward at a time, then the backwards still owed.
fn one_f_one_b(n: usize, warmup: usize, work: impl Fn(usize, bool) -> Work + Copy + Send + 'static) -> Schedule {
    let warm = (0..warmup).map(move |k| Action::Forward(work(k, true)));
    let steady =
        (0..n - warmup).flat_map(move |k| [Action::Forward(work(warmup + k, true)), Action::Backward(work(k, false))]);
    let cool = (n - warmup..n).map(move |k| Action::Backward(work(k, false)));
    Box::new(warm.chain(steady).chain(cool))
}

/// What a message between stages carries: the activations a forward made, or the gradient a
/// backward made, of the sender's `Work`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Carries {
    Activations,
    Gradient,
}

/// Where rank `from`'s `action` sends its result (the rank holding the next virtual stage, or
/// for a gradient the previous one), and what it is; `None` for the loss, the first chunk's input
/// gradient and a W, which go nowhere. With interleaving the stages form a ring: rank p − 1's
/// chunk c feeds rank 0's chunk c + 1; in the V, rank p − 1's chunk 0 feeds its own chunk 1.
pub fn sent_by(stage: Stage, from: usize, action: Action) -> Option<(usize, (Carries, Work))> {
    let last = stage.count * stage.chunks - 1;
    let (w, u) = (action.work(), Stage { index: from, ..stage }.virtual_stage(action.work().chunk));
    let (to, carries) = match action {
        Action::Forward(_) if u < last => (u + 1, Carries::Activations),
        Action::Backward(_) | Action::InputGrad(_) if u > 0 => (u - 1, Carries::Gradient),
        _ => return None,
    };
    Some((stage.place_of(to).0, (carries, w)))
}
