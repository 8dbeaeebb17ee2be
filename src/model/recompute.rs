//! # Recomputation: keep less in forward, compute it again in backward
//!
//! Every block's forward keeps its activations until its backward (`block.rs`'s `BlockCache`):
//! about (6d + 2·kv + 3f) numbers per row. `train.recompute` trades that memory for compute
//! through the block's seam `Keeps`:
//!
//! ```text
//! none        everything (`KeepAll`)
//! selective   all but the attention core's output and log-sum-exp: backward computes the core
//!             again from the kept q, k and v (Megatron's selective recomputation)
//! full        the block's input alone (d numbers per row): backward runs the block's forward
//!             again first, one more forward for nearly all of the block's activations
//! ```
//! The recomputed numbers are the same operations on the same inputs, so the losses are equal,
//! not just close; under tp and cp the recomputed forward talks to the other ranks again.

use crate::config::Recompute;
use crate::model::block::{BlockCache, Keeps, Kept};
use crate::model::Llama;
use crate::ops::tensor::Tensor;
use anyhow::Result;

impl Keeps for Recompute {
    fn keep(&self, mut cache: BlockCache) -> Box<dyn Kept> {
        match self {
            Recompute::None => Box::new(cache),
            Recompute::Selective => {
                cache.attention.drop_core(); // scores and softmax again in backward; the GEMM outputs stay
                Box::new(cache)
            }
            Recompute::Full => Box::new(Input(cache.x)), // the rest is dropped here
        }
    }
}

/// Full recomputation: the block's input alone.
struct Input(Tensor);

impl Kept for Input {
    fn bytes(&self) -> usize {
        self.0.bytes()
    }
    fn cache(self: Box<Self>, forward: &mut dyn FnMut(Tensor) -> Result<BlockCache>) -> Result<BlockCache> {
        forward(self.0) // the block's forward again, keeping everything
    }
}

impl<'g> Llama<'g> {
    /// Keeps what `recompute` says of each block for backward, and computes the rest again there.
    pub fn with_recompute(self, recompute: Recompute) -> Llama<'g> {
        self.with_keeps(Box::new(recompute))
    }
}
