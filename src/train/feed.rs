//! # What a rank reads
//!
//! Each rank reads its slice of the step's global batch of `micro_batch_size × grad_accum_steps
//! × dp` sequences: its dp share (`data/`), and of each sequence the positions the composition
//! root gives it (all of them, or with context parallelism its cp positions). The order of the data depends only on the step and the
//! global batch, never on the layout, so every layout trains on the same tokens.

use crate::comm::launcher::Rank;
use crate::config::Config;
use crate::data::{self, Dataset};
use anyhow::Result;

/// Where the step reads its micro-batches: `Feed` below, or a later lesson's wrapper around it
/// (chosen by `train/compose.rs`).
pub(super) trait MicroBatches {
    /// Micro-batch `micro` of step `step` on this rank: (tokens, targets).
    fn micro_batch(&self, step: usize, micro: usize) -> Result<(Vec<u32>, Vec<i32>)>;
}

/// A rank's micro-batches.
pub(super) struct Feed<'g> {
    pub me: &'g Rank,
    cfg: &'g Config,
    data: &'g Dataset,
    /// This rank's positions of each sequence (all of them without context parallelism).
    positions: Vec<u32>,
}

impl<'g> Feed<'g> {
    /// Reads `positions` of each sequence (all of them without context parallelism).
    pub fn new(me: &'g Rank, cfg: &'g Config, data: &'g Dataset, positions: Vec<u32>) -> Feed<'g> {
        Feed { me, cfg, data, positions }
    }

    /// This rank's positions of each sequence.
    pub fn positions(&self) -> &[u32] {
        &self.positions
    }
}

impl MicroBatches for Feed<'_> {
    /// Its dp share of the global batch, and its positions of each sequence.
    fn micro_batch(&self, step: usize, micro: usize) -> Result<(Vec<u32>, Vec<i32>)> {
        let (t, p, me) = (&self.cfg.train, &self.cfg.parallel, self.me);
        let (tokens, targets) = self.data.micro_batch(t, (me.coords.dp, p.dp), step, micro)?;
        let (seq, pos) = (t.seq_len, &self.positions);
        Ok((data::rows_at(&tokens, seq, pos), data::rows_at(&targets, seq, pos)))
    }
}
