//! # Where a backward's weight gradients go: the seam
//!
//! A linear layer y = x · Wᵀ has a backward of two GEMMs that need nothing of each other:
//!
//! ```text
//! B   dx  = dy · W        the input gradient: the layer before waits for it
//! W   dW += dyᵀ · x       the weight gradient: nobody reads it before the optimizer step
//! ```
//! The model's backward computes B itself and hands every W — each linear layer's, and the
//! embedding's scatter-add, whose backward is all weight gradient — to a `WeightGrads`. `Now`
//! computes it on the spot: the plain backward of every lesson. A later lesson, the zero-bubble
//! pipelines (`deferred_grads.rs`), plugs in another that keeps the W's inputs instead and runs
//! them later; what it deferred (`Deferred`) waits in the model until `Llama::backward_weights` runs it.

use crate::model::param::Param;
use crate::ops;
use crate::ops::tensor::Tensor;
use std::borrow::Cow;

/// Where a backward's weight gradients go.
pub trait WeightGrads {
    /// dW += dyᵀ · x for each `(dy, W)` of `layers`, all reading `x`.
    fn linear(&mut self, x: Cow<Tensor>, layers: Vec<(Cow<Tensor>, &mut Param)>);
    /// The embedding's backward: `table`'s rows += `dx`'s rows by token id (from `first`).
    fn embedding(&mut self, table: &mut Param, dx: Cow<Tensor>, tokens: &[u32], first: usize);
    /// What it deferred, when the backward is done (`None`: nothing, all is computed).
    fn deferred(&mut self) -> Option<Box<dyn Deferred>> {
        None
    }
}

/// Weight gradients a backward deferred: the W of a zero-bubble pipeline.
pub trait Deferred {
    /// Runs them into the gradients of `params` (found by name).
    fn apply(self: Box<Self>, params: &mut [&mut Param]);
    /// The bytes they hold until then (activation memory).
    fn bytes(&self) -> usize;
}

/// Every weight gradient computed as backward meets it.
pub struct Now;

impl WeightGrads for Now {
    fn linear(&mut self, x: Cow<Tensor>, layers: Vec<(Cow<Tensor>, &mut Param)>) {
        layers.into_iter().for_each(|(dy, p)| p.linear_weight_grad(&dy, &x))
    }

    fn embedding(&mut self, table: &mut Param, dx: Cow<Tensor>, tokens: &[u32], first: usize) {
        ops::embedding_backward(&dx, tokens, first, &mut table.grad)
    }
}
