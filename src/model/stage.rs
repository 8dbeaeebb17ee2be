//! # A pipeline stage: which layers this rank's model holds
//!
//! The model is built for one stage of the pipeline (`parallel/pipeline_parallel.rs` runs the
//! stages): the first stage also holds the embedding, the last the final norm, the output layer
//! and the loss. On one rank the stage is the whole model.
//!
//! With the interleaved schedule a rank holds `chunks` (V) non-adjacent pieces of the model: the
//! layers are cut into p·V *virtual* stages and rank r holds virtual stages r, r + p, r + 2p, …
//! (p = 2, V = 2, 8 layers: rank 0 holds layers 0–1 and 4–5, rank 1 holds 2–3 and 6–7). A
//! micro-batch then visits every rank V times, so a rank can start working V times sooner.

use std::ops::Range;

/// A pipeline stage: `index` of `count`, holding `chunks` model chunks (1 unless interleaved).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stage {
    pub index: usize,
    pub count: usize,
    pub chunks: usize,
}

impl Stage {
    /// The whole model on one stage.
    pub const WHOLE: Stage = Stage { index: 0, count: 1, chunks: 1 };

    /// Stage `index` of `count`, one chunk each.
    pub fn new(index: usize, count: usize) -> Stage {
        Stage { index, count, chunks: 1 }
    }

    /// Holds the embedding (the first virtual stage is its chunk 0).
    pub fn is_first(&self) -> bool {
        self.index == 0
    }
    /// Holds the output layer and the loss (the last virtual stage is its last chunk).
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    /// Chunk `c` of this stage as a stage of its own: virtual stage c·count + index of
    /// count·chunks.
    pub fn chunk(&self, c: usize) -> Stage {
        Stage::new(c * self.count + self.index, self.count * self.chunks)
    }

    /// The layers (out of `n`) of each chunk, in order.
    pub fn chunk_layers(&self, n: usize) -> Vec<Range<usize>> {
        (0..self.chunks).map(|c| self.chunk(c).contiguous(n)).collect()
    }

    /// Every layer this stage holds, out of `n`, in order.
    pub fn layers(&self, n: usize) -> Vec<usize> {
        self.chunk_layers(n).into_iter().flatten().collect()
    }

    /// How many layers this stage holds, out of `n` (without listing them: `n` may be absurd).
    pub fn layer_count(&self, n: usize) -> usize {
        self.chunk_layers(n).iter().map(|r| r.len()).sum()
    }

    /// One chunk's layers out of `n`: `n / count` each, and one more on each of the first
    /// `n % count` stages (the last stage also carries the output layer and the loss).
    fn contiguous(&self, n: usize) -> Range<usize> {
        let (base, extra) = (n / self.count, n % self.count);
        let start = self.index * base + self.index.min(extra);
        start..start + base + usize::from(self.index < extra)
    }
}
