//! # One pipeline stage's forward and backward (lesson 12)
//!
//! A pipeline stage holds some of the model's layers (`model/stage.rs`: which), and with the
//! interleaved schedule several model chunks of them. Its forward starts from tokens (the first
//! stage: the embedding runs first) or from the previous stage's activations, and ends with the
//! loss (the last stage) or activations for the next; its backward starts from the loss or from
//! the next stage's gradient. These are the model's own body (`Llama::forward_layers`,
//! `backward_layers`, the same code a single rank runs) entered and left at a chunk's ends.
//! The schedule (`parallel/pipeline_parallel.rs`) decides which micro-batch goes through which
//! chunk when: a stage holds one cache per micro-batch in flight.

use super::Llama;
use crate::model::param::Param;
use crate::model::split::WeightGrads;
use crate::ops::tensor::Tensor;
use anyhow::{bail, Result};

/// What a pipeline stage receives: tokens (first stage) or the previous stage's activations.
pub enum StageInput<'a> {
    Tokens(&'a [u32]),
    Hidden(Tensor),
}

/// What a stage produces: the mean loss (last stage; a one-number f32 tensor on the stage's
/// device) or activations for the next stage.
pub enum StageOutput {
    Loss(Tensor),
    Hidden(Tensor),
}

/// Where a stage's backward starts: the loss, scaled (last stage), or the next stage's gradient.
pub enum StageGrad {
    Loss(f32),
    Hidden(Tensor),
}

impl Llama<'_> {
    /// One micro-batch of `batch` sequences through model chunk `chunk` of this stage (a stage
    /// holds one chunk, or V with the interleaved pipeline): the embedding before chunk 0 of the
    /// first stage, the head after the last chunk of the last stage; `targets` are used there.
    /// The activations stay until this micro-batch's backward.
    pub fn forward_chunk(
        &mut self,
        chunk: usize,
        input: StageInput,
        batch: usize,
        targets: &[i32],
    ) -> Result<StageOutput> {
        let (x, tokens) = match input {
            StageInput::Tokens(t) if chunk == 0 => (self.embed(t)?, Some(t.to_vec())),
            StageInput::Tokens(_) => bail!("forward: tokens given to a model chunk without the embedding"),
            StageInput::Hidden(x) => (x, None),
        };
        let y = self.forward_layers(chunk, x, tokens, batch, targets)?;
        Ok(if self.ends_with_head(chunk) { StageOutput::Loss(y) } else { StageOutput::Hidden(y) })
    }

    /// The backward of the oldest micro-batch whose forward through model chunk `chunk` is done.
    /// Returns the gradient of the chunk's input activations (`None` where its input was tokens).
    /// Each weight GEMM goes to `dw` (`split.rs`): with `Now` every gradient is made here,
    /// and `ready(param)` hears each parameter as soon as its gradient is complete. A `dw` that
    /// keeps them (the zero-bubble pipelines' B, `model/llama/zero_bubble.rs`) leaves them
    /// waiting in the model; its caller then passes a `ready` that does nothing, since no
    /// gradient is complete yet.
    pub fn backward_chunk(
        &mut self,
        chunk: usize,
        grad: StageGrad,
        dw: &mut dyn WeightGrads,
        ready: &mut dyn FnMut(&mut Param),
    ) -> Result<Option<Tensor>> {
        let start = match grad {
            StageGrad::Loss(scale) => (scale, None),
            StageGrad::Hidden(dy) => (1.0, Some(dy)),
        };
        let dx = self.backward_layers(chunk, start, dw, ready)?;
        if let Some(kept) = dw.deferred() {
            self.deferred.push_back((chunk, kept)); // until the schedule's W for this chunk
        }
        Ok(dx)
    }

    /// Micro-batches whose activations this rank holds now (forward done, backward not yet, or
    /// with a zero-bubble pipeline its weight gradients not yet; with model chunks, micro-batch
    /// chunks, each 1/V of a micro-batch's).
    pub fn activations_held(&self) -> usize {
        self.caches.len() + self.deferred.len()
    }
}
