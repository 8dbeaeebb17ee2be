//! # Stopping a pipeline inside a step
//!
//! The driver may end a step between micro-batches (a signal, `train/stop.rs`): every rank asks
//! "stop?" in one collective, so every rank must ask at the same points. Without a pipeline the
//! ranks are all between micro-batches at once; in a pipeline they never are, so each asks at
//! the same points of its *own* schedule: before receiving its k-th forward's input, for k a
//! multiple of p·V (one round of the pipeline; `Rounds`). Sends are buffered, so a rank waits
//! only on receives; what a rank receives before its k-th forward was sent by its neighbours
//! before their k-th, and no one waits on a rank already asking. After a stop each rank takes in
//! what its neighbours sent it before theirs (`schedules.rs`'s `Drained`, around every walk), so
//! that the group's next message (a checkpoint's gather) is not taken for one of them.
//!
//! (Asking before every forward deadlocks the interleaved schedule from p = 3: rank p − 1 would
//! wait for a gradient rank 0 makes only after its own question. Tried on a model of the
//! schedules for p ≤ 8, V ≤ 4.) On NCCL a send waits on the GPU for its receive, so there the
//! driver asks nothing inside a pipeline's step.

use crate::parallel::StepHooks;
use anyhow::Result;
use std::time::Instant;

/// The driver's hooks, asked only at the start of a round: before this rank's k-th forward, k a
/// multiple of `round` (p·V).
pub struct Rounds<'h> {
    pub hooks: &'h dyn StepHooks,
    pub round: usize,
}

impl StepHooks for Rounds<'_> {
    fn span(&self, name: String, start: Instant) {
        self.hooks.span(name, start);
    }

    fn asks_before(&self, k: usize) -> bool {
        k.is_multiple_of(self.round) && self.hooks.asks_before(k)
    }

    fn stop_here(&self) -> Result<bool> {
        self.hooks.stop_here()
    }
}
