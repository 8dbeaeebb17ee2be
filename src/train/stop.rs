//! # Stopping on Ctrl-C or SIGTERM without losing the run
//!
//! A scheduler that ends a job sends SIGTERM; a person presses Ctrl-C (SIGINT). Either way the
//! run should end the way it would at a checkpoint:
//!
//! ```text
//! first signal    the handler only notes it (nothing else is safe inside a signal handler)
//! end of a step   every rank asks "did a signal come?" in one all-reduce(max) over the world,
//!                 so all of them stop after the same step (one rank stopping alone would hang
//!                 the others in their next collective)
//! between micro-  the same question: a step of many micro-batches stops at the next one's
//!   batches       start, and its gradients so far are dropped (no update was made with them)
//! then            a checkpoint of the last finished step to checkpoint.dir, the metrics
//!                 flushed, where to resume printed, exit 128 + signal (130 for SIGINT, 143 for
//!                 SIGTERM), as shells expect
//! later signal    one within a second of the first is a copy of it (wrappers pass one on
//!                 twice: `signals.rs`); one after that exits at once (the last complete
//!                 checkpoint stays the latest)
//! ```
//! In a pipeline the ranks are never all between micro-batches at once: each asks at the same
//! points of its own schedule instead (`parallel/pipeline_parallel.rs`), and takes in the
//! messages its neighbours sent before they stopped. On NCCL a pipeline's send waits on the GPU
//! for its receive, so there a signal waits for the step's end.
//!
//! The handler and the flag it sets are `signals.rs`, at the bottom of the crate: the readers
//! and waits outside the step ask it too.

use crate::comm::{Group, ReduceOp};
use crate::ops::tensor::Tensor;
use anyhow::Result;

/// Whether any rank of `world` has seen a signal, and which: every rank gets the same answer.
pub fn agreed(world: &Group) -> Result<Option<i32>> {
    let mut seen = Tensor::from_vec(&[1], vec![crate::signals::received().unwrap_or(0) as f32]); // on the host: no GPU wait
    world.all_reduce_tensor(&mut seen, ReduceOp::Max)?;
    Ok(Some(seen.to_vec()[0] as i32).filter(|&s| s != 0))
}
