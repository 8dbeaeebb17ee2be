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
//! second signal   exits at once (the last complete checkpoint stays the latest)
//! ```
//! In a pipeline the ranks are never all between micro-batches at once: each asks at the same
//! points of its own schedule instead (`parallel/pipeline_parallel.rs`), and takes in the
//! messages its neighbours sent before they stopped. On NCCL a pipeline's send waits on the GPU
//! for its receive, so there a signal waits for the step's end.

use crate::comm::{Group, ReduceOp};
use crate::ops::tensor::Tensor;
use anyhow::Result;
use std::sync::atomic::{AtomicI32, Ordering};

/// The first signal received, 0 while none.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// Installs the handler for SIGINT and SIGTERM (the `ferrotron` binary does, for `train`).
pub fn install() {
    #[cfg(unix)]
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `on_signal` only touches an atomic and calls async-signal-safe functions.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    let first = RECEIVED.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst).is_ok();
    let msg: &[u8] = if first {
        b"\nsignal received: stopping at the next micro-batch, then saving a checkpoint (signal again to stop at once)\n"
    } else {
        b"\nsecond signal: stopping now\n"
    };
    // SAFETY: write(2) and _exit(2) are async-signal-safe.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        if !first {
            libc::_exit(128 + sig);
        }
    }
}

/// The signal received so far, if any.
pub fn received() -> Option<i32> {
    Some(RECEIVED.load(Ordering::SeqCst)).filter(|&s| s != 0)
}

/// Whether any rank of `world` has seen a signal, and which: every rank gets the same answer.
pub fn agreed(world: &Group) -> Result<Option<i32>> {
    let mut seen = Tensor::from_vec(&[1], vec![received().unwrap_or(0) as f32]); // on the host: no GPU wait
    world.all_reduce_tensor(&mut seen, ReduceOp::Max)?;
    Ok(Some(seen.to_vec()[0] as i32).filter(|&s| s != 0))
}

/// The signal's name, for messages.
pub fn name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}
