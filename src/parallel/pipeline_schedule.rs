//! # A pipeline's schedule: the order of a stage's forwards and backwards
//!
//! The schedules of `pipeline_parallel.rs`'s lesson (AFAB, 1F1B, interleaved 1F1B) as data: for
//! stage s of p, with m micro-batches and V model chunks per rank, the list of `F` and `B` it
//! runs in one step. The training step walks it (`pipeline_parallel::run_step`), each rank also
//! replays its neighbours' to know what they send (the interleaved mailbox, and the drain after a
//! stop), and `ferrotron schedule` plays it on a clock to draw it. It is made as it is walked: a
//! step of millions of micro-batches holds no list of them.

use crate::config::PpSchedule;
use crate::model::Stage;

/// Micro-batch `micro` through model chunk `chunk` (always 0 but in the interleaved schedule).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Work {
    pub micro: usize,
    pub chunk: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Forward(Work),
    Backward(Work),
}

/// `F3` / `B3`: the forward or backward of micro-batch 3; `{:#}` adds the model chunk, `F3.1`
/// (the interleaved schedule's names).
impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (letter, w) = match self {
            Action::Forward(w) => ('F', w),
            Action::Backward(w) => ('B', w),
        };
        match f.alternate() {
            true => write!(f, "{letter}{}.{}", w.micro, w.chunk),
            false => write!(f, "{letter}{}", w.micro),
        }
    }
}

/// The order of stage `stage`'s forwards and backwards of `m` micro-batches, each rank holding
/// `chunks` model chunks (1 but for `Interleaved`). Made as it is walked: a step of millions of
/// micro-batches holds no list of them.
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
    }
}

/// A stage's actions of one step, in order.
pub type Schedule = Box<dyn Iterator<Item = Action> + Send>;

/// The forwards (of a chunk each) stage `stage` runs before its first backward: all of them
/// (AFAB); one per stage below it (1F1B); with interleaving, those twice over (they come back
/// through chunk 1, …) plus a group of `stages` per further chunk.
pub fn warmup(kind: PpSchedule, stages: usize, stage: usize, m: usize, chunks: usize) -> usize {
    match kind {
        PpSchedule::Afab => m,
        PpSchedule::OneFOneB => (stages - stage - 1).min(m),
        PpSchedule::Interleaved => ((stages - stage - 1) * 2 + (chunks - 1) * stages).min(m * chunks),
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

/// Where rank `from`'s `action` sends its result, and what it is; `None` for the loss and the
/// first chunk's input gradient, which go nowhere. With interleaving the stages form a ring:
/// rank p − 1's chunk c feeds rank 0's chunk c + 1.
pub fn sent_by(stage: Stage, from: usize, action: Action) -> Option<(usize, (Carries, Work))> {
    let (p, v) = (stage.count, stage.chunks);
    match action {
        Action::Forward(w) if !(from == p - 1 && w.chunk == v - 1) => Some(((from + 1) % p, (Carries::Activations, w))),
        Action::Backward(w) if !(from == 0 && w.chunk == 0) => Some(((from + p - 1) % p, (Carries::Gradient, w))),
        _ => None,
    }
}
