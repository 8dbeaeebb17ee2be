//! # Stopping a pipeline inside a step
//!
//! The driver may end a step between micro-batches (a signal, `train/stop.rs`): every rank asks
//! "stop?" in one collective, so every rank must ask at the same points. Without a pipeline the
//! ranks are all between micro-batches at once; in a pipeline they never are, so each asks at
//! the same points of its *own* schedule: before receiving its k-th forward's input, for k a
//! multiple of p·V (one round of the pipeline; `Rounds`). Sends are buffered, so a rank waits
//! only on receives; what a rank receives before its k-th forward was sent by its neighbours
//! before their k-th, and no one waits on a rank already asking. After a stop each rank takes in
//! what its neighbours sent it before theirs (`drain`), so that the group's next message (a
//! checkpoint's gather) is not taken for one of them.
//!
//! (Asking before every forward deadlocks the interleaved schedule from p = 3: rank p − 1 would
//! wait for a gradient rank 0 makes only after its own question. Tried on a model of the
//! schedules for p ≤ 8, V ≤ 4.) On NCCL a send waits on the GPU for its receive, so there the
//! driver asks nothing inside a pipeline's step.

use crate::config::PpSchedule;
use crate::parallel::pipeline_messages::Messages;
use crate::parallel::pipeline_schedule::{schedule, sent_by, Action};
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

/// After every rank stopped before its k-th forward of a step of `micro_batches` in schedule
/// `kind`: receives, and drops, what the others sent this rank before their own k-th forward and
/// it did not take (a gradient on its way back). What they sent is known by replaying their
/// schedules.
pub(crate) fn drain(msg: &Messages, (kind, micro_batches): (PpSchedule, usize), k: usize) -> Result<()> {
    let (stage, me) = (msg.stage, msg.stage.index);
    for from in (0..stage.count).filter(|&f| f != me) {
        let mut forwards = 0;
        let sent = schedule(kind, stage.count, from, micro_batches, stage.chunks)
            .take_while(|a| {
                forwards += usize::from(matches!(a, Action::Forward(_)));
                forwards <= k
            })
            .filter(|&a| sent_by(stage, from, a).is_some_and(|(to, _)| to == me))
            .count();
        let taken = msg.received.borrow()[from];
        for _ in taken..sent {
            msg.recv(Some(from))?;
        }
    }
    Ok(())
}
