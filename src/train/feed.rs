//! # What a rank reads
//!
//! Each rank reads its slice of the step's global batch of `micro_batch_size × grad_accum_steps
//! × dp` sequences: its dp share (`data/`), and of each sequence its cp positions
//! (`parallel/context_parallel.rs`). The order of the data depends only on the step and the
//! global batch, never on the layout, so every layout trains on the same tokens.

use crate::comm::launcher::Rank;
use crate::comm::process_grid::Axis;
use crate::config::Config;
use crate::data::Dataset;
use crate::parallel::context_parallel;
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
    pub fn new(me: &'g Rank, cfg: &'g Config, data: &'g Dataset, told: Option<Told<'g>>) -> Feed<'g> {
        let (cp, p) = (me.group(Axis::Cp), &cfg.parallel);
        let positions = context_parallel::positions(p.cp_split, cp.size(), cp.index(), cfg.train.seq_len);
        Feed { me, cfg, data, positions, told }
    }

    /// Micro-batch `micro` of step `step` on this rank: (tokens, targets), its dp share and its
    /// cp positions of each sequence.
    pub fn micro_batch(&self, step: usize, micro: usize) -> Result<(Vec<u32>, Vec<i32>)> {
        let (t, p, me) = (&self.cfg.train, &self.cfg.parallel, self.me);
        let (tokens, targets) = self.data.micro_batch(t, (me.coords.dp, p.dp), step, micro)?;
        let (seq, pos) = (t.seq_len, &self.positions);
        if let Some(told) = &self.told {
            told(step, micro, pos);
        }
        Ok((context_parallel::local_rows(&tokens, seq, pos), context_parallel::local_rows(&targets, seq, pos)))
    }
}
