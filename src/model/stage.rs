//! # A pipeline stage: which layers this rank's model holds
//!
//! The model is built for one stage of the pipeline (`parallel/pipeline_parallel.rs` runs the
//! stages): the first stage also holds the embedding, the last the final norm, the output layer
//! and the loss. On one rank the stage is the whole model.

use std::ops::Range;

/// A pipeline stage: `index` of `count`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stage {
    pub index: usize,
    pub count: usize,
}

impl Stage {
    /// The whole model on one stage.
    pub const WHOLE: Stage = Stage { index: 0, count: 1 };

    pub fn is_first(&self) -> bool {
        self.index == 0
    }
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    /// This stage's layers out of `n`: `n / count` each, and one more on each of the first
    /// `n % count` stages (the last stage also carries the output layer and the loss).
    pub fn layers(&self, n: usize) -> Range<usize> {
        let (base, extra) = (n / self.count, n % self.count);
        let start = self.index * base + self.index.min(extra);
        start..start + base + usize::from(self.index < extra)
    }
}
