//! # B and W: a backward split in two
//!
//! A linear layer y = x · Wᵀ has a backward of two GEMMs that need nothing of each other:
//!
//! ```text
//! B   dx  = dy · W        the input gradient: the layer before waits for it (and, on a
//!                         pipeline, the stage before)
//! W   dW += dyᵀ · x       the weight gradient: nobody reads it before the optimizer step
//! ```
//! Every backward in this repository runs both where it meets them (`WeightGrads::Now`). The
//! zero-bubble pipelines (Qi et al. 2023, `parallel/pipeline_schedule.rs`) run B at once, so the
//! gradient leaves for the previous stage sooner, and W later, in time the stage would otherwise
//! spend idle: the backward is given `WeightGrads::Later`, which keeps, instead of computing, each
//! weight GEMM's two inputs (x and dy), and `Deferred::apply` runs them when the schedule says W.
//!
//! What waits: every linear layer's weight GEMM (q, k, v, o, gate, up, down, the router, each
//! expert's w1, w2, w3, the output layer) and the embedding's scatter-add (its backward is all
//! weight gradient). What does not: the RMSNorms' weight gradients, a row sum that falls out of
//! the kernel computing their input gradient. What it costs: between B and W a micro-batch
//! still holds each GEMM's input x (an activation it held anyway, now kept past B) and its
//! output gradient dy (new: about what the activations of the layer outputs were). The schedules
//! bound how many micro-batches wait for their W; `train/memory.rs` counts them.
//!
//! Nothing changes in the numbers: the same GEMMs run on the same inputs into the same
//! gradients, in the same order per parameter, so a split backward is bitwise the plain one.

use crate::model::param::Param;
use crate::ops;
use crate::ops::tensor::Tensor;
use std::borrow::Cow;

/// Where a backward's weight gradients go.
pub enum WeightGrads {
    /// Computed as backward meets them.
    Now,
    /// Kept, in backward's order, for `Deferred::apply`.
    Later(Vec<Deferred>),
}

/// One weight gradient a backward left for later.
pub enum Deferred {
    /// dW += dyᵀ · x for each named parameter that reads the same input x.
    Linear { x: Tensor, dys: Vec<(String, Tensor)> },
    /// The embedding table's rows += the gradient of the rows that looked them up (ids from
    /// `first`: a vocab-parallel slice).
    Embedding { name: String, dx: Tensor, tokens: Vec<u32>, first: usize },
}

impl WeightGrads {
    /// dW += dyᵀ · x for each `(dy, W)` of `layers`, all reading `x`: now, or kept.
    pub fn linear(&mut self, x: Cow<Tensor>, layers: Vec<(Cow<Tensor>, &mut Param)>) {
        match self {
            WeightGrads::Now => {
                layers.into_iter().for_each(|(dy, p)| ops::linear_weight_grad(&dy, &x, &mut p.grad, p.precision))
            }
            WeightGrads::Later(kept) => {
                let dys = layers.into_iter().map(|(dy, p)| (p.name.clone(), dy.into_owned())).collect();
                kept.push(Deferred::Linear { x: x.into_owned(), dys });
            }
        }
    }

    /// The embedding's backward: `table`'s rows += `dx`'s rows by token id (from `first`).
    pub fn embedding(&mut self, table: &mut Param, dx: Cow<Tensor>, tokens: &[u32], first: usize) {
        match self {
            WeightGrads::Now => ops::embedding_backward(&dx, tokens, first, &mut table.grad),
            WeightGrads::Later(kept) => kept.push(Deferred::Embedding {
                name: table.name.clone(),
                dx: dx.into_owned(),
                tokens: tokens.to_vec(),
                first,
            }),
        }
    }
}

impl Deferred {
    /// Runs it into the gradients of `params` (found by name).
    pub fn apply(self, params: &mut [&mut Param]) {
        match self {
            Deferred::Linear { x, dys } => {
                for (name, dy) in dys {
                    let p = grad_of(params, &name);
                    ops::linear_weight_grad(&dy, &x, &mut p.grad, p.precision)
                }
            }
            Deferred::Embedding { name, dx, tokens, first } => {
                ops::embedding_backward(&dx, &tokens, first, &mut grad_of(params, &name).grad)
            }
        }
    }

    /// The parameters it adds into.
    pub fn names(&self) -> Vec<&str> {
        match self {
            Deferred::Linear { dys, .. } => dys.iter().map(|(name, _)| name.as_str()).collect(),
            Deferred::Embedding { name, .. } => vec![name.as_str()],
        }
    }

    /// The bytes it keeps.
    pub fn bytes(&self) -> usize {
        match self {
            Deferred::Linear { x, dys } => x.bytes() + dys.iter().map(|(_, dy)| dy.bytes()).sum::<usize>(),
            Deferred::Embedding { dx, tokens, .. } => dx.bytes() + tokens.len() * 4,
        }
    }
}

/// The parameter named `name` among `params`, its gradient made if it was freed (ZeRO-2 and 3
/// free a gradient once handed over; a W may be the first to add into it this step).
fn grad_of<'a>(params: &'a mut [&mut Param], name: &str) -> &'a mut Param {
    let p = params.iter_mut().find(|p| p.name == name).expect("a deferred gradient's parameter is among those given");
    p.ensure_grad();
    p
}
