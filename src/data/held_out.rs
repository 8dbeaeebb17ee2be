//! # Data no training step reads: the held-out sequences validation and samples use
//!
//! The synthetic source holds out by index: its held-out sequences are stream sequences no step
//! reaches. A text source holds out its tail (`validation.split`): training reads windows of the
//! rest only (`Dataset::sequence`), validation windows of the tail.

use super::{rows, Dataset};
use anyhow::{bail, Context, Result};
use rand::Rng;

/// Held-out sequence `i` of the synthetic source is stream sequence `HELD_OUT + i`: an index no
/// training step reaches (step × global batch stays far below 2⁶²).
const HELD_OUT: u64 = 1 << 62;

impl Dataset {
    /// Holds out the last `share` of a text source for validation: training reads only the rest
    /// (the synthetic source needs nothing: its held-out sequences are indices it never trains on).
    pub fn hold_out(&mut self, share: f64, len: usize) -> Result<()> {
        if let Dataset::Text { tokens, train_end, .. } = self {
            let kept = ((tokens.len() as f64) * (1.0 - share)) as usize;
            if kept < len || tokens.len() - kept < len {
                bail!(
                    "validation.split = {share}: of the text's {} tokens, {kept} are left to train on and {} held out, but each needs train.seq_len + 1 = {len}; use a longer text or another split",
                    tokens.len(),
                    tokens.len() - kept
                );
            }
            *train_end = kept;
        }
        Ok(())
    }

    /// Held-out sequence `i`, `len` tokens long: never in a training batch.
    pub fn held_out(&self, i: u64, len: usize) -> Result<Vec<u32>> {
        match self {
            Dataset::Synthetic(s) => Ok(s.sequence(HELD_OUT + i, len)),
            Dataset::Text { tokens, seed, train_end, .. } => {
                let span = tokens
                    .len()
                    .checked_sub(train_end + len)
                    .context("validation: nothing is held out; call hold_out first")?;
                let start =
                    train_end + crate::model::init::stream(*seed, &format!("text/held-out/{i}")).gen_range(0..=span);
                tokens.window(start, len)
            }
        }
    }

    /// The first `len` tokens of held-out sequence 0, or, where a text source holds nothing out
    /// (no validation), of the text itself: what a sample continues by default.
    pub fn first_tokens(&self, len: usize) -> Result<Vec<u32>> {
        match self {
            Dataset::Text { tokens, train_end, .. } if *train_end == tokens.len() => {
                tokens.window(0, len.min(tokens.len()))
            }
            _ => self.held_out(0, len),
        }
    }

    /// Held-out sequences `first .. first + count` (validation), `len` tokens each, as (inputs,
    /// next-token targets).
    pub fn held_out_rows(&self, first: u64, count: usize, len: usize) -> Result<(Vec<u32>, Vec<i32>)> {
        rows((first..first + count as u64).map(|i| self.held_out(i, len)))
    }
}
