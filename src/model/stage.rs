//! # A pipeline stage: which layers this rank's model holds
//!
//! The model is built for one stage of the pipeline (`parallel/pipeline_parallel.rs` runs the
//! stages): the first stage also holds the embedding, the last the final norm, the output layer
//! and the loss. On one rank the stage is the whole model. The model asks a stage what to build
//! through its `LayerSplit` seam (`model/split.rs`), implemented at the end of this file.
//!
//! With the interleaved schedule a rank holds `chunks` (V) non-adjacent pieces of the model: the
//! layers are cut into p·V *virtual* stages and rank r holds virtual stages r, r + p, r + 2p, …
//! (p = 2, V = 2, 8 layers: rank 0 holds layers 0–1 and 4–5, rank 1 holds 2–3 and 6–7). A
//! micro-batch then visits every rank V times, so a rank can start working V times sooner.
//!
//! The V-shaped zero-bubble schedule (`zbv`) gives each rank two chunks the other way round:
//! rank r holds virtual stages r and 2p − 1 − r, so a micro-batch goes down the ranks and comes
//! back up (p = 2, 8 layers: rank 0 holds layers 0–1 and 6–7, rank 1 holds 2–5). Rank p − 1's
//! two chunks are neighbours (what one sends the other is local), and rank 0 holds both ends of
//! the model: the embedding and the loss.
//!
//! ```text
//! loop (interleaved), p = 2, V = 2:  rank 0: 0 → rank 1: 1 → rank 0: 2 → rank 1: 3
//! V (zbv), p = 2:                    rank 0: 0 → rank 1: 1 → rank 1: 2 → rank 0: 3
//! ```

use crate::model::split::LayerSplit;
use std::ops::Range;

/// A pipeline stage: `index` of `count`, holding `chunks` model chunks (1 unless interleaved or
/// V-shaped), laid out as `shape` says.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stage {
    pub index: usize,
    pub count: usize,
    pub chunks: usize,
    pub shape: Shape,
}

/// Which virtual stages a rank's chunks are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Chunk c of rank r is virtual stage c·p + r: the micro-batch loops round the ranks.
    Loop,
    /// Two chunks: rank r holds virtual stages r and 2p − 1 − r (`zbv`).
    V,
}

impl Stage {
    /// The whole model on one stage.
    pub const WHOLE: Stage = Stage { index: 0, count: 1, chunks: 1, shape: Shape::Loop };

    /// Stage `index` of `count`, one chunk each.
    pub fn new(index: usize, count: usize) -> Stage {
        Stage::looped(index, count, 1)
    }

    /// Stage `index` of `count`, `chunks` each, looped (the interleaved schedule's).
    pub fn looped(index: usize, count: usize, chunks: usize) -> Stage {
        Stage { index, count, chunks, shape: Shape::Loop }
    }

    /// Stage `index` of `count`, the two chunks of the V shape.
    pub fn v(index: usize, count: usize) -> Stage {
        Stage { index, count, chunks: 2, shape: Shape::V }
    }

    /// Holds the embedding (the first virtual stage is its chunk 0).
    pub fn is_first(&self) -> bool {
        self.index == 0
    }
    /// Holds the output layer and the loss (the last virtual stage is its last chunk).
    pub fn is_last(&self) -> bool {
        match self.shape {
            Shape::Loop => self.index + 1 == self.count,
            Shape::V => self.index == 0,
        }
    }

    /// The rank holding the output layer and the loss.
    pub fn loss_rank(&self) -> usize {
        self.place_of(self.count * self.chunks - 1).0
    }

    /// The virtual stage chunk `c` of this rank is.
    pub fn virtual_stage(&self, c: usize) -> usize {
        match (self.shape, c) {
            (Shape::V, 1) => 2 * self.count - 1 - self.index,
            _ => c * self.count + self.index,
        }
    }

    /// Where virtual stage `u` is: (rank, chunk).
    pub fn place_of(&self, u: usize) -> (usize, usize) {
        match self.shape {
            Shape::V if u >= self.count => (2 * self.count - 1 - u, 1),
            _ => (u % self.count, u / self.count),
        }
    }

    /// Chunk `c` of this stage as a stage of its own: its virtual stage of count·chunks.
    pub fn chunk(&self, c: usize) -> Stage {
        Stage::new(self.virtual_stage(c), self.count * self.chunks)
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

/// The model asks a stage which layers to build (`model/split.rs`).
impl LayerSplit for Stage {
    fn chunk_layers(&self, n: usize) -> Vec<Range<usize>> {
        Stage::chunk_layers(self, n)
    }
    fn has_embedding(&self) -> bool {
        self.is_first()
    }
    fn has_head(&self) -> bool {
        self.is_last()
    }
}
