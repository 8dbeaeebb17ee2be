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

/// Told each micro-batch's (step, micro-batch, this rank's positions of each sequence) before it
/// runs: a hook for what must know which rows a micro-batch holds (a routing tape).
pub(super) type Told<'g> = Box<dyn Fn(usize, usize, &[u32]) + 'g>;

/// A rank's micro-batches.
pub(super) struct Feed<'g> {
    pub me: &'g Rank,
    cfg: &'g Config,
    data: &'g Dataset,
    /// This rank's positions of each sequence (all of them without context parallelism).
    positions: Vec<u32>,
    /// Who is told each micro-batch's rows (`Told`), if anyone.
    told: Option<Told<'g>>,
}

impl<'g> Feed<'g> {
    /// Reads `positions` of each sequence (all of them without context parallelism).
    pub fn new(
        me: &'g Rank,
        cfg: &'g Config,
        data: &'g Dataset,
        positions: Vec<u32>,
        told: Option<Told<'g>>,
    ) -> Feed<'g> {
        Feed { me, cfg, data, positions, told }
    }

    /// Micro-batch `micro` of step `step` on this rank: (tokens, targets), its dp share and its
    /// positions of each sequence.
    pub fn micro_batch(&self, step: usize, micro: usize) -> Result<(Vec<u32>, Vec<i32>)> {
        let (t, p, me) = (&self.cfg.train, &self.cfg.parallel, self.me);
        let (tokens, targets) = self.data.micro_batch(t, (me.coords.dp, p.dp), step, micro)?;
        let (seq, pos) = (t.seq_len, &self.positions);
        if let Some(told) = &self.told {
            told(step, micro, pos);
        }
        Ok((data::rows_at(&tokens, seq, pos), data::rows_at(&targets, seq, pos)))
    }
}
