//! # The training loop
//!
//! Every rank runs the same loop (SPMD), in three parts, each in its own file:
//!
//! ```text
//! train/step.rs      the step: micro-batches through forward and backward (or through the
//!                    pipeline schedule), each gradient's way, AdamW, the weights' way back
//! train/compose.rs   what this rank's step is made of (the model's splits, ZeRO, the gradient
//!                    reducers), chosen once from the config; train/feed.rs, what a rank reads
//! train/driver.rs    around the step and never inside it: logging and timing (watch.rs),
//!                    checkpoints (run.rs), the held-out loss (validate.rs), stopping cleanly
//!                    on a signal (stop.rs)
//! ```
//! Read `train/step.rs` first: it is the whole of training. The step sees the driver only
//! through `StepHooks` (`parallel/mod.rs`): where a compute span is recorded, and where between
//! micro-batches the driver may end the step.

mod agree;
mod compose;
mod driver;
mod feed;
mod gradients;
pub mod memory;
pub mod metrics;
mod run;
mod sample;
mod step;
pub mod stop;
mod validate;
mod watch;

pub use run::{Options, Stopped, Summary};

use crate::comm::launcher::launch_on;
use crate::config::Config;
use anyhow::Result;
use run::Run;

/// Trains on every rank of the configured grid; returns rank 0's summary.
pub fn train(cfg: &Config, opts: Options) -> Result<Summary> {
    Ok(train_all(cfg, opts)?.swap_remove(0))
}

/// Trains and returns every rank's summary, in rank order: each rank a thread running the
/// driver's `train_rank` (`comm/launcher.rs`, `train/driver.rs`).
pub fn train_all(cfg: &Config, opts: Options) -> Result<Vec<Summary>> {
    let run = Run::prepare(cfg, opts, compose::state_kinds(cfg))?; // the grid, the data, where the weights come from
    if run.finished {
        return Ok(run.nothing_to_train(cfg)); // the checkpoint is the run's last step
    }
    let summaries =
        launch_on(run.grid, run.setup.clone(), |me| driver::train_rank(me, cfg, &run.data, opts, run.shared()))?;
    Ok(run.finish(cfg, opts, summaries))
}
