//! # A pipeline's schedule: the order of a stage's forwards and backwards
//!
//! A schedule as data: for stage s of p, with m micro-batches and V model chunks per rank, the
//! list of `F`, `B` (and `W`) it runs in one step. The walks of AFAB and 1F1B are loops
//! (`pipeline_parallel.rs`, `pipeline_1f1b.rs`); the same orders written down here let each rank
//! replay its neighbours' (to know what they send: the drain after a stop), let `ferrotron
//! schedule` play them on a clock to draw them, and let `ferrotron memory` count what each stage
//! holds. Each schedule is a `Schedule`: AFAB's below, 1F1B's beside its walk, and the later
//! lessons' in their own files — interleaved (`pipeline_actions.rs`, walked as this list) and the
//! zero-bubble ones (`pipeline_zero_bubble.rs`).

use crate::model::split::WeightGrads;
use crate::model::stage::Stage;
use crate::parallel::pipeline_parallel::Afab;

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

/// A stage's actions of one step, in order.
pub type Actions = Box<dyn Iterator<Item = Action> + Send>;

/// A pipeline schedule as data: the seam each schedule's lesson implements — AFAB and 1F1B
/// below, the interleaved one in `pipeline_actions.rs`, the zero-bubble ones in
/// `pipeline_zero_bubble.rs`. Every schedule is looked up by its config name above the lessons
/// (`schedules.rs`).
pub trait Schedule: Sync {
    /// Stage `index` of `count` as this schedule lays out its `chunks` model chunks: looped
    /// (chunk c of rank r is virtual stage c·p + r), unless the schedule says otherwise.
    fn stage(&self, index: usize, count: usize, chunks: usize) -> Stage {
        Stage::looped(index, count, chunks)
    }

    /// The order of stage `stage`'s forwards and backwards of `m` micro-batches, each rank holding
    /// `chunks` model chunks. Made as it is walked: a step of millions of micro-batches holds no
    /// list of them.
    fn actions(&self, stages: usize, stage: usize, m: usize, chunks: usize) -> Actions;

    /// The forwards (of a chunk each) stage `stage` runs before its first backward.
    fn warmup(&self, stages: usize, stage: usize, m: usize, chunks: usize) -> usize;

    /// The most micro-batch chunks stage `stage` holds at once (forward done, backward — or with
    /// the zero-bubble schedules its W — not yet): one more than its warm-up, unless the
    /// schedule says otherwise.
    fn held(&self, stages: usize, stage: usize, m: usize, chunks: usize) -> usize {
        (self.warmup(stages, stage, m, chunks) + 1).min(m * chunks)
    }

    /// Where a B (`InputGrad`) keeps its weight GEMMs until their W, for a schedule that splits
    /// its backwards (zero bubble); `None`: its backwards are whole.
    fn keeps_w(&self) -> Option<Box<dyn WeightGrads>> {
        None
    }
}

/// AFAB: every forward, then every backward; all m forwards before the first backward.
impl Schedule for Afab {
    fn actions(&self, _: usize, _: usize, m: usize, _: usize) -> Actions {
        let one = |micro| Work { micro, chunk: 0 };
        Box::new((0..m).map(move |i| Action::Forward(one(i))).chain((0..m).map(move |i| Action::Backward(one(i)))))
    }
    fn warmup(&self, _: usize, _: usize, m: usize, _: usize) -> usize {
        m
    }
}

/// `n` forwards and `n` backwards (the k-th of each being `work(k, forward)`): `warmup` forwards,
/// then one forward and one backward at a time, then the backwards still owed.
pub fn one_f_one_b(n: usize, warmup: usize, work: impl Fn(usize, bool) -> Work + Copy + Send + 'static) -> Actions {
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
